// The controller: the process the user started. It never opens the device
// (so forking is safe); it makes the directory, forks the workers, SIGKILLs
// and replaces them (chaos), declares a worker hung when its heartbeat stops,
// prints progress, ends the run and prints the report.
#ifndef PCIENTB_STRESS_CONTROLLER_HPP
#define PCIENTB_STRESS_CONTROLLER_HPP

#include "options.hpp"

namespace stress {

// The run; its exit status (0: nothing lost, corrupted, hung or unexpected).
int run_controller(const Options &opt);

}  // namespace stress

#endif
