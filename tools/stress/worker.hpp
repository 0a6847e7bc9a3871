// A worker process: one node of the fabric. It owns an MR others WRITE into
// and do atomics on (the window: one region and one atomic word per incoming
// connection), an MR others READ (a pattern of its slot and generation), an
// SRQ, its initiator QPs, the responder QPs it accepted, a UD QP, and its
// share of the chaos. One thread, one loop, no blocking call: every wait is a
// state polled with a deadline, so the loop's heartbeat in the directory
// stops only when a verbs call hangs.
#ifndef PCIENTB_STRESS_WORKER_HPP
#define PCIENTB_STRESS_WORKER_HPP

#include "directory.hpp"
#include "options.hpp"

namespace stress {

// Runs the worker of `slot`, generation `gen`, in this (forked) process;
// returns its exit status.
int run_worker(Directory &dir, const Options &opt, int slot, uint32_t gen);

}  // namespace stress

#endif
