// The command line the process was started with, kept by main(), and the
// supervisor a worker node runs under so that it can start again after it
// lost its head.
//
// Each run of a worker is a process of its own, forked by the one the user
// started (which stays, with the same pid, until the worker stops). A run
// that lost its head exits with kRunRejoins and the supervisor starts the
// next. A new process and not an exec of the old one: CAF names a node by
// host and pid, and a head that still holds the old run's connection (a
// half-open link it has not timed out yet) would take an exec'd run for the
// old one, routing its replies down the dead connection.
#pragma once

#include <string>
#include <vector>

namespace cleave {

void set_process_args(int argc, char** argv);
const std::vector<std::string>& process_args();

// Exit status of a worker's run that lost its head: start another.
inline constexpr int kRunRejoins = 75;  // EX_TEMPFAIL

// True in a run started by supervise() (an environment variable says so).
bool supervised_run();

// Runs the process's command line again and again as supervised runs, each
// a fresh process, while they exit with kRunRejoins. SIGINT and SIGTERM go
// on to the run of the moment and no run follows them; the supervisor's
// death kills the run (PR_SET_PDEATHSIG). Returns the exit status to end
// with: the last run's, or 128 + the signal that ended it (a run ended by
// SIGINT or SIGTERM ends the supervisor by the same signal). Call it before
// the process starts threads or opens what a run would open itself.
int supervise();

}  // namespace cleave
