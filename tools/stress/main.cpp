// pcientb-stress: the soak test of pcientb0 (see --help and the README's
// "Soak test: pcientb-stress").
#include "controller.hpp"
#include "options.hpp"

int main(int argc, char **argv) {
  stress::Options opt = stress::parse_options(argc, argv);
  return stress::run_controller(opt);
}
