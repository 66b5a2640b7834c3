#include "apps/process_args.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern char** environ;

namespace cleave {
namespace {

constexpr const char* kRunVariable = "CLEAVE_SUPERVISED_RUN";

std::vector<std::string>& args() {
  static std::vector<std::string> a;
  return a;
}

volatile sig_atomic_t g_run_pid = 0;    // the run of the moment, 0 between runs
volatile sig_atomic_t g_stop_signal = 0;

void forward_signal(int sig) {
  g_stop_signal = sig;
  if (g_run_pid > 0) ::kill(pid_t(g_run_pid), sig);
}

// Ends the supervisor as a stop signal ended its run, so that whoever
// started it sees the worker end by that signal.
int end_by(int sig) {
  if (sig == SIGINT || sig == SIGTERM) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  return 128 + sig;
}

}  // namespace

void set_process_args(int argc, char** argv) { args().assign(argv, argv + argc); }
const std::vector<std::string>& process_args() { return args(); }

bool supervised_run() {
  const char* v = std::getenv(kRunVariable);
  return v && std::strcmp(v, "1") == 0;
}

int supervise() {
  // What the child execs, built here: between fork and exec it only makes
  // async-signal-safe calls.
  std::vector<char*> argv;
  for (std::string& s : args()) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::string marker = std::string(kRunVariable) + "=1";
  std::vector<char*> envp{marker.data()};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, kRunVariable, std::strlen(kRunVariable)) != 0 ||
        (*e)[std::strlen(kRunVariable)] != '=')
      envp.push_back(*e);
  envp.push_back(nullptr);
  // A run starts with stdin, stdout and stderr only: nothing the command
  // line's process opened before this point outlives into the runs.
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd > 2 && fd != ::dirfd(d)) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    ::closedir(d);
  }

  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  sigset_t stops, old;
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT);
  sigaddset(&stops, SIGTERM);
  const pid_t supervisor = ::getpid();
  for (;;) {
    if (g_stop_signal) return end_by(g_stop_signal);
    std::fflush(stdout);
    std::fflush(stderr);
    // Blocked over the fork, so a stop signal either comes before it (no
    // run starts) or finds g_run_pid set (the run hears it).
    ::sigprocmask(SIG_BLOCK, &stops, &old);
    const pid_t pid = ::fork();
    if (pid == 0) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      ::sigaction(SIGINT, &dfl, nullptr);
      ::sigaction(SIGTERM, &dfl, nullptr);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != supervisor) ::_exit(1);  // it died before the prctl
      ::sigprocmask(SIG_SETMASK, &old, nullptr);
      ::execve("/proc/self/exe", argv.data(), envp.data());
      static const char msg[] = "cleave: error: cannot start a worker's run (exec failed)\n";
      [[maybe_unused]] auto n = ::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    if (pid < 0) {
      const int err = errno;
      ::sigprocmask(SIG_SETMASK, &old, nullptr);
      std::fprintf(stderr, "cleave: error: cannot start a worker's run: %s\n", std::strerror(err));
      return 1;
    }
    g_run_pid = pid;
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_run_pid = 0;
    if (WIFSIGNALED(status)) return end_by(WTERMSIG(status));
    const int code = WEXITSTATUS(status);
    if (code != kRunRejoins) return code;
    // else: the run lost its head; the loop's first line ends it if a stop
    // signal came meanwhile.
  }
}

}  // namespace cleave
