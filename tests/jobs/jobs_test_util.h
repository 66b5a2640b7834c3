// Helpers of the jobs tests: unique temp directories, files read whole, and
// child processes. A child runs this test binary again (fork + exec, so its
// statics, fault_point's included, start fresh) with one test case marked
// doctest::skip() (normal runs leave it out) and extra environment; it writes
// what it saw to the pipe child_pipe_fd() names, and its stdout and stderr
// come back too.
#pragma once

#include <doctest/doctest.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace jobs_test {

namespace fs = std::filesystem;

constexpr const char* kPipeVariable = "CLEAVE_TEST_CHILD_PIPE_FD";

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path = fs::temp_directory_path() / ("cleave_jobs_" + tag + "_" + std::to_string(::getpid()) +
                                        "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  std::string str(const std::string& name = "") const {
    return name.empty() ? path.string() : (path / name).string();
  }
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

inline bool mentions(const cleave::Status& s, const std::string& what) {
  return s.message().find(what) != std::string::npos;
}

// In a child: the pipe to write to; -1 in a normal run.
inline int child_pipe_fd() {
  const char* v = std::getenv(kPipeVariable);
  return v ? std::atoi(v) : -1;
}

inline void child_say(const std::string& text) {
  const int fd = child_pipe_fd();
  for (size_t done = 0; fd >= 0 && done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += size_t(n);
  }
}

struct ChildResult {
  int status = 0;      // waitpid's
  std::string said;    // what the child wrote with child_say
  std::string output;  // its stdout and stderr
  bool killed_by(int sig) const { return WIFSIGNALED(status) && WTERMSIG(status) == sig; }
  bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Runs test case `name` of this binary in a child with `env` set (a value of
// nullptr unsets the variable).
inline ChildResult run_child(const std::string& name,
                             const std::vector<std::pair<std::string, const char*>>& env) {
  int said[2], output[2];
  REQUIRE(::pipe(said) == 0);
  REQUIRE(::pipe(output) == 0);
  const std::string filter = "--test-case=" + name;
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(said[0]);
    ::close(output[0]);
    ::dup2(output[1], 1);
    ::dup2(output[1], 2);
    ::close(output[1]);
    for (const auto& [key, value] : env) {
      if (value)
        ::setenv(key.c_str(), value, 1);
      else
        ::unsetenv(key.c_str());
    }
    ::setenv(kPipeVariable, std::to_string(said[1]).c_str(), 1);
    ::execl("/proc/self/exe", "test_jobs", "--no-skip", filter.c_str(), "--no-version",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(said[1]);
  ::close(output[1]);
  ChildResult r;
  pollfd fds[2] = {{said[0], POLLIN, 0}, {output[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.said, &r.output};
  for (int open = 2; open > 0;) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, size_t(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      }
    }
  }
  while (::waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
  }
  return r;
}

}  // namespace jobs_test
