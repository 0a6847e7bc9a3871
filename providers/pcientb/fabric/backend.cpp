// Which fabric backend this process uses: the one place that decides.
#include <atomic>

#include "fabric/fabric.hpp"

namespace pcientb::fabric {
namespace {
std::atomic<const Backend *> installed{nullptr};
}  // namespace

const Backend &backend() {
  const Backend *b = installed.load(std::memory_order_acquire);
  return b ? *b : emu_backend();
}

const Backend &backend_for(const char *name) {
  return kernel::is_kernel_fabric(name) ? kernel::kernel_backend() : backend();
}

void install_backend(const Backend &b) {
  installed.store(&b, std::memory_order_release);
}

}  // namespace pcientb::fabric
