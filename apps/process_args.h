// The command line the process was started with, kept by main() so that a
// worker node can start itself again (exec) after it lost its head.
#pragma once

#include <string>
#include <vector>

namespace cleave {

void set_process_args(int argc, char** argv);
const std::vector<std::string>& process_args();

// Replaces the process with a fresh run of the same command line (every
// descriptor but stdin, stdout and stderr closed on exec). Returns only on
// failure, with errno's text.
std::string exec_self();

}  // namespace cleave
