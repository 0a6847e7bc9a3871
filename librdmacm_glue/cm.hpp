// rdma_cm for pcientb devices: the command interface of the kernel's rdma_cm
// character device (rdma/rdma_user_cm.h, ABI 4), served in the process.
//
// Unmodified librdmacm opens /dev/infiniband/rdma_cm, writes one command per
// write() and polls the descriptor for events. ucma_file.cpp interposes those
// libc calls for that path (when no real device node is there) and hands the
// commands to this layer, which keeps the ids, channels and event queues, and
// speaks the CM protocol with other processes (wire.hpp) from one service
// thread. The descriptor the program gets is one end of a socketpair: it is
// readable exactly while its channel has events queued, so poll, epoll,
// select and O_NONBLOCK behave as with the kernel's, without interposing them.
//
// Devices are reached through the public verbs API only (the CM is one of the
// provider's users): every address of this host maps to pcientb0.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>

namespace pcientb::cm {

// A new event channel; the program's descriptor, or -1 with errno.
int open_channel(int open_flags);

// Whether any channel was ever opened (until then, write() is not looked at).
bool any_channel();

// Whether fd was a channel's descriptor when last seen (no system call).
bool known_channel(int fd);

// Whether fd is the descriptor of an event channel (also a dup of one).
bool is_channel(int fd);

// fd is being closed by the program.
void forget(int fd);

// One command written to the channel on `fd`: the byte count, or -1 with errno. `held` is
// a dup of fd that the caller took first and closes after, as the kernel's write() holds
// the file (-1: none could be taken, the command runs on fd).
ssize_t execute(int fd, int held, const void *buf, size_t len);

// What fstat reports for a channel: a character device, as the kernel's.
void describe(struct stat *st);

}  // namespace pcientb::cm
