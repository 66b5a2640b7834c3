// libFuzzer target for the topology loader (actors/topology.h): any text run
// as a topology script under tight sandbox limits gives a ClusterSpec that
// keeps the loader's promises (one head, valid names, counts >= 1; the
// placement table and summary print) or a one-line error naming the script.
// The limits bound every run: 200k Lua instructions, 4 MiB, 1 s of wall time.
// print() writes to stderr: scripts/fuzz.sh closes the target's stderr
// (libFuzzer keeps its own and the sanitizers' reports).
#include <cctype>
#include <ctime>
#include <map>
#include <string>

#include "actors/topology.h"
#include "fuzz_check.h"

namespace {

using namespace cleave;
using fuzz::fail;

const char* const kChunk = "fuzz.lua";

// Some --set values, so param() converts strings, numbers and booleans.
const std::map<std::string, std::string> kArgs = {
    {"head_port", "7000"}, {"decoders", "2"}, {"split", "yes"},
    {"kv_dir", "/tmp/kv"}, {"prefill_host", "10.0.0.1"}, {"word", "x"}};

bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

void check_spec(const ClusterSpec& spec) {
  int heads = 0;
  for (const NodeSpec& n : spec.nodes) {
    heads += n.head ? 1 : 0;
    if (!valid_name(n.name)) fail("node name '%s' is not valid", n.name.c_str());
    if (n.port < 0 || n.port > 65535) fail("node '%s' port %d", n.name.c_str(), n.port);
    for (const ActorGroupSpec& a : n.actors)
      if (a.count < 1 || !is_actor_kind(a.kind))
        fail("node '%s': %d actors of kind '%s'", n.name.c_str(), a.count, a.kind.c_str());
  }
  if (heads != 1) fail("%d head nodes in a loaded spec", heads);
  if (spec.find(spec.head().name) != &spec.head()) fail("head() is not find(head name)");
  if (placement_table(spec).empty() || topology_summary(spec).empty()) fail("empty table or summary");
}

}  // namespace

// Lua 5.4 seeds its string hashes with time(NULL) (luai_makeseed), which
// changes the order lua_next walks a table in, and with it the paths a run
// takes: this process answers a fixed time, so seed and run count decide a
// run (ctest fuzz_topology). Nothing else here reads time(); the sandbox's
// own clock is steady_clock.
extern "C" time_t time(time_t* t) {
  const time_t fixed = 1700000000;
  if (t != nullptr) *t = fixed;
  return fixed;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  TopologyLimits limits;
  limits.max_instructions = 200'000;
  limits.max_memory_bytes = 4 << 20;
  limits.max_seconds = 1.0;
  const std::string script(reinterpret_cast<const char*>(data), size);
  auto spec = load_topology_string(script, kChunk, kArgs, limits);
  if (spec.ok()) {
    check_spec(*spec);
    return 0;
  }
  const Status& st = spec.status();
  fuzz::expect_error(st, {Code::invalid_argument, Code::out_of_memory}, "load_topology_string");
  if (st.message().rfind(std::string(kChunk) + ":", 0) != 0)
    fail("error that does not name the script: %s", st.message().c_str());
  if (st.message().find('\n') != std::string::npos)
    fail("error of more than one line: %s", st.message().c_str());
  return 0;
}
