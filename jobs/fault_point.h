// A test-only seam: the kill tests stop a job at an exact step of its append
// protocol. With CLEAVE_JOB_FAULT=STEP:N in the environment, the Nth time the
// process reaches fault_point(STEP) it kills itself with SIGKILL (no
// destructor, no flush: what kill -9 does). Without the variable,
// fault_point() is one relaxed load.
#pragma once

namespace cleave::jobs {

void fault_point(const char* step);

}  // namespace cleave::jobs
