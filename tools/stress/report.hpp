// What the run did and found: the header, the progress line and the final
// report (counters summed over every worker slot and generation).
#ifndef PCIENTB_STRESS_REPORT_HPP
#define PCIENTB_STRESS_REPORT_HPP

#include "directory.hpp"
#include "options.hpp"

namespace stress {

void print_header(const Options &opt);
void print_progress(const Directory &dir, double seconds);
// Prints the report to stdout; returns the exit status (0: nothing lost,
// corrupted, hung or unexpected).
int print_report(const Directory &dir, const Options &opt, double seconds);

}  // namespace stress

#endif
