#include "wire.hpp"

#include <pcientb/pcientb.h>

#include <arpa/inet.h>
#include <ifaddrs.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pcientb::cm {

namespace {

// The provider's fabric; long names are hashed so that the address fits sun_path.
std::string fabric_tag() {
  std::string name = pcientb_fabric_name();
  if (name.size() <= 64) return name;
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  char buf[32];
  std::snprintf(buf, sizeof buf, "#%016llx", static_cast<unsigned long long>(h));
  return buf;
}

bool same_ip(const sockaddr *a, const sockaddr *b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in *>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in *>(b)->sin_addr.s_addr;
  return std::memcmp(&reinterpret_cast<const sockaddr_in6 *>(a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6 *>(b)->sin6_addr, sizeof(in6_addr)) == 0;
}

bool is_loopback(const sockaddr *a) {
  if (a->sa_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in *>(a)->sin_addr.s_addr) >> 24) == 127;
  if (a->sa_family != AF_INET6) return false;
  const in6_addr &v6 = reinterpret_cast<const sockaddr_in6 *>(a)->sin6_addr;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

}  // namespace

sockaddr_un port_address(uint16_t ps, uint16_t port, socklen_t *len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  // sun_path[0] = 0: the abstract namespace.
  const int n = std::snprintf(a.sun_path + 1, sizeof(a.sun_path) - 1, "pcientb-cm/%s/%x/%u",
                              fabric_tag().c_str(), ps, port);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

bool send_msg(int fd, const Msg &m) {
  // Only what the private data uses travels.
  const size_t len = offsetof(Msg, private_data) + m.private_data_len;
  return fd >= 0 && ::send(fd, &m, len, MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(len);
}

bool is_wildcard(const sockaddr *a) {
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in *>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (a->sa_family == AF_INET6)
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6 *>(a)->sin6_addr);
  return false;
}

bool is_multicast(const sockaddr *a) {
  if (a->sa_family == AF_INET)
    return IN_MULTICAST(ntohl(reinterpret_cast<const sockaddr_in *>(a)->sin_addr.s_addr));
  return a->sa_family == AF_INET6 &&
         IN6_IS_ADDR_MULTICAST(&reinterpret_cast<const sockaddr_in6 *>(a)->sin6_addr);
}

bool is_local_address(const sockaddr *a) {
  if (a->sa_family != AF_INET && a->sa_family != AF_INET6) return false;
  if (is_wildcard(a) || is_loopback(a)) return true;
  ifaddrs *list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs *i = list; i != nullptr && !found; i = i->ifa_next)
    found = i->ifa_addr != nullptr && same_ip(i->ifa_addr, a);
  freeifaddrs(list);
  return found;
}

uint16_t port_of(const sockaddr *a) {
  if (a->sa_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in *>(a)->sin_port);
  if (a->sa_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6 *>(a)->sin6_port);
  return 0;
}

void set_port(sockaddr *a, uint16_t port) {
  if (a->sa_family == AF_INET) reinterpret_cast<sockaddr_in *>(a)->sin_port = htons(port);
  if (a->sa_family == AF_INET6) reinterpret_cast<sockaddr_in6 *>(a)->sin6_port = htons(port);
}

socklen_t addr_len(const sockaddr *a) {
  if (a->sa_family == AF_INET) return sizeof(sockaddr_in);
  if (a->sa_family == AF_INET6) return sizeof(sockaddr_in6);
  return 0;
}

bool listener_matches(const sockaddr *bound, const sockaddr *dst) {
  if (is_wildcard(bound)) return true;
  return same_ip(bound, dst);
}

}  // namespace pcientb::cm
