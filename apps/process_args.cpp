#include "apps/process_args.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace cleave {
namespace {
std::vector<std::string>& args() {
  static std::vector<std::string> a;
  return a;
}
}  // namespace

void set_process_args(int argc, char** argv) { args().assign(argv, argv + argc); }
const std::vector<std::string>& process_args() { return args(); }

std::string exec_self() {
  std::fflush(stdout);
  std::fflush(stderr);
  // Sockets and files the old run held must not outlive it in the new one.
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd > 2 && fd != ::dirfd(d)) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    ::closedir(d);
  }
  std::vector<char*> argv;
  for (std::string& s : args()) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execv("/proc/self/exe", argv.data());
  return std::strerror(errno);
}

}  // namespace cleave
