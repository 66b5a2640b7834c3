// fault_point: CLEAVE_JOB_FAULT=STEP:N kills the process at the Nth hit of
// STEP, other steps do not count, no variable does nothing, a malformed one
// aborts naming it. Each case runs in a child process (the variable is read
// once per process).
#include <doctest/doctest.h>
#include <signal.h>

#include "jobs/fault_point.h"
#include "jobs_test_util.h"

using namespace jobs_test;
using cleave::jobs::fault_point;

namespace {
constexpr const char* kChild = "fault_point: child";
}

// Says "1" after the first hit of step "x" and "2" after the second; steps "y"
// and "x.more" come before and must not count.
TEST_CASE("fault_point: child" * doctest::skip()) {
  if (child_pipe_fd() < 0) return;
  for (int i = 0; i < 3; ++i) fault_point("y");
  fault_point("x.more");
  fault_point("x");
  child_say("1");
  fault_point("x");
  child_say("2");
  for (int i = 0; i < 5; ++i) fault_point("x");
  child_say("3");
}

TEST_CASE("fault_point: the Nth hit of its step kills the process with SIGKILL") {
  auto r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "x:2"}});
  CHECK_MESSAGE(r.killed_by(SIGKILL), r.output);
  CHECK(r.said == "1");  // alive after the first hit, dead at the second

  r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "x:1"}});
  CHECK(r.killed_by(SIGKILL));
  CHECK(r.said == "");

  r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "x:7"}});
  CHECK(r.killed_by(SIGKILL));
  CHECK(r.said == "12");

  r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "y:3"}});  // the third "y" is before any "1"
  CHECK(r.killed_by(SIGKILL));
  CHECK(r.said == "");
}

TEST_CASE("fault_point: without the variable or past the count nothing happens") {
  auto r = run_child(kChild, {{"CLEAVE_JOB_FAULT", nullptr}});
  CHECK_MESSAGE(r.exited_ok(), r.output);
  CHECK(r.said == "123");

  r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "x:8"}});  // "x" is reached 7 times
  CHECK_MESSAGE(r.exited_ok(), r.output);
  CHECK(r.said == "123");

  r = run_child(kChild, {{"CLEAVE_JOB_FAULT", "z:1"}});  // a step never reached
  CHECK(r.exited_ok());
  CHECK(r.said == "123");
}

TEST_CASE("fault_point: a malformed variable aborts and names it") {
  for (const std::string bad :
       {"x", "x:", ":2", "x:0", "x:2a", "x:-1", "x:99999999999999999999999"}) {
    CAPTURE(bad);
    const auto r = run_child(kChild, {{"CLEAVE_JOB_FAULT", bad.c_str()}});
    CHECK(r.killed_by(SIGABRT));
    CHECK(r.said == "");
    CHECK(r.output.find("CLEAVE_JOB_FAULT") != std::string::npos);
    CHECK(r.output.find(bad) != std::string::npos);
  }
}
