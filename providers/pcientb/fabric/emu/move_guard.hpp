// Moving registered memory without losing what other threads write into it.
//
// Registration moves the pages of [va, va + len) onto a memfd: it copies them,
// then mremaps the copy over the range. A store by another thread between the
// copy and the mremap would land in the old page and be lost: the program's own
// threads, or this provider's progress threads, writing to heap data that
// shares a page with the buffer being registered (riostream hung on it). The
// guard makes the range read-only for the move; a thread that writes meanwhile
// faults, waits in a SIGSEGV handler until the move is done, and its store is
// retried on the new page. Faults anywhere else go to the handler that was
// there before (the program's, a sanitizer's, or the default action).
//
// Limits: a system call that writes into the range during the move (read()
// into the buffer by another thread) fails with EFAULT instead of faulting.
#pragma once

#include <cstdint>

namespace pcientb::fabric::emu {

// Runs move() with [va, va + len) (whole pages of private read-write memory)
// read-only to every thread but through move's own system calls. Moves are
// serialized process-wide. Returns what move() returns (0 or an errno); the
// range is read-write again whatever happened.
template <typename Move>
int guarded_move(uint64_t va, uint64_t len, Move &&move);

namespace detail {
int begin_move(uint64_t va, uint64_t len);  // 0 or an errno; on success, end_move() follows
void end_move(uint64_t va, uint64_t len, bool moved);
}  // namespace detail

template <typename Move>
int guarded_move(uint64_t va, uint64_t len, Move &&move) {
  if (const int err = detail::begin_move(va, len); err != 0) return err;
  const int rc = move();
  detail::end_move(va, len, rc == 0);
  return rc;
}

}  // namespace pcientb::fabric::emu
