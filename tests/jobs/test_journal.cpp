// The job journal's database: reopen keeps everything, corrupt records are
// skipped and counted, a corrupt meta is refused, a kill -9 after sync=false
// commits loses nothing, the read-only view beside the holder, the lock, and
// directories that cannot be used.
#include <doctest/doctest.h>
#include <rocksdb/db.h>
#include <signal.h>
#include <sys/stat.h>

#include "jobs/fault_point.h"
#include "jobs_test_util.h"
#include "journal_samples.h"

using namespace jobs_test;

namespace {

std::unique_ptr<Journal> open_ok(const std::string& dir) {
  auto j = Journal::open(dir);
  REQUIRE_MESSAGE(j.ok(), j.status().to_string());
  return std::move(*j);
}

}  // namespace

TEST_CASE("journal: commit then destroy then reopen keeps meta and records and erase removes") {
  TempDir dir("journal");
  const std::string path = dir.str("job");
  {
    auto j = open_ok(path);
    CHECK(j->meta().status().code() == Code::not_found);
    auto none = j->records();
    REQUIRE(none.ok());
    CHECK(none->empty());
    std::vector<std::pair<uint64_t, RequestRecord>> batch;
    for (uint64_t i : {0, 1, 255, 256, 70000}) batch.push_back({i, sample_record(i)});
    const JobMeta m = sample_meta();
    REQUIRE(j->commit(batch, &m, true).ok());
    // A later commit without meta leaves the meta alone.
    RequestRecord done = sample_record(9);
    done.state = RequestState::done;
    REQUIRE(j->commit({{1, done}}, nullptr, false).ok());
  }
  {
    auto j = open_ok(path);  // records and meta of one batch, together
    auto m = j->meta();
    REQUIRE_MESSAGE(m.ok(), m.status().to_string());
    check_same(*m, sample_meta());
    auto rs = j->records();
    REQUIRE(rs.ok());
    std::vector<uint64_t> keys;
    for (const auto& [k, r] : *rs) keys.push_back(k);
    CHECK(keys == std::vector<uint64_t>{0, 1, 255, 256, 70000});  // in line order
    for (const auto& [k, r] : *rs) {
      RequestRecord want = sample_record(k == 1 ? 9 : k);
      if (k == 1) want.state = RequestState::done;
      check_same(r, want);
    }
    REQUIRE(j->erase({0, 256, 12345}, true).ok());
    CHECK(j->counters().corrupt_records == 0);
  }
  auto j = open_ok(path);
  auto rs = j->records();
  REQUIRE(rs.ok());
  CHECK(rs->size() == 3);
  CHECK(rs->count(0) == 0);
  CHECK(rs->count(256) == 0);
  CHECK(rs->count(70000) == 1);
}

TEST_CASE("journal: records() skips a corrupted record and counts it") {
  TempDir dir("journal");
  auto j = open_ok(dir.str());
  std::vector<std::pair<uint64_t, RequestRecord>> batch;
  for (uint64_t i = 0; i < 5; ++i) batch.push_back({i, sample_record(i)});
  REQUIRE(j->commit(batch, nullptr, true).ok());
  REQUIRE(j->corrupt_for_testing(2, 17).ok());
  REQUIRE(j->corrupt_for_testing(4, 1000000).ok());  // modulo the value's size
  CHECK(j->corrupt_for_testing(9, 0).code() == Code::not_found);
  auto rs = j->records();
  REQUIRE(rs.ok());
  CHECK(rs->size() == 3);
  CHECK(j->counters().corrupt_records == 2);
  for (uint64_t i : {0, 1, 3}) {
    REQUIRE(rs->count(i) == 1);
    check_same(rs->at(i), sample_record(i));
  }
  // A fresh commit of the record repairs it.
  REQUIRE(j->commit({{2, sample_record(2)}}, nullptr, false).ok());
  CHECK(j->records()->size() == 4);
}

TEST_CASE("journal: a meta that fails its checksum is corruption") {
  TempDir dir("journal");
  const JobMeta m = sample_meta();
  {
    auto j = open_ok(dir.str());
    REQUIRE(j->commit({}, &m, true).ok());
  }
  {
    rocksdb::DB* raw = nullptr;
    rocksdb::Options o;
    REQUIRE(rocksdb::DB::Open(o, dir.str(), &raw).ok());
    std::string v;
    REQUIRE(raw->Get({}, "meta", &v).ok());
    v[v.size() / 2] ^= 0x01;
    REQUIRE(raw->Put({}, "meta", v).ok());
    delete raw;
  }
  auto j = open_ok(dir.str());
  const Status s = j->meta().status();
  CHECK(s.code() == Code::corruption);
  CHECK(mentions(s, dir.str()));
  CHECK(mentions(s, "checksum mismatch"));
}

// Commits with sync=false, then is killed (kill -9) before it can close.
TEST_CASE("journal: child commits then is killed" * doctest::skip()) {
  if (child_pipe_fd() < 0) return;
  auto j = Journal::open(std::getenv("CLEAVE_TEST_JOURNAL"));
  REQUIRE(j.ok());
  JobMeta m = sample_meta();
  m.status = JobStatus::in_progress;
  for (uint64_t i = 0; i < 50; ++i) {
    m.completed = i + 1;
    REQUIRE((*j)->commit({{i, sample_record(i)}}, &m, false).ok());
  }
  child_say("committed");
  fault_point("test.after_commit");
  child_say(" not killed");
}

TEST_CASE("journal: sync=false commits survive a kill -9") {
  TempDir dir("journal");
  const auto r = run_child(
      "journal: child commits then is killed",
      {{"CLEAVE_TEST_JOURNAL", dir.str().c_str()}, {"CLEAVE_JOB_FAULT", "test.after_commit:1"}});
  REQUIRE_MESSAGE(r.killed_by(SIGKILL), r.output);
  CHECK(r.said == "committed");
  auto j = open_ok(dir.str());
  auto m = j->meta();
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  CHECK(m->status == JobStatus::in_progress);
  CHECK(m->completed == 50);
  auto rs = j->records();
  REQUIRE(rs.ok());
  CHECK(rs->size() == 50);
  check_same(rs->at(49), sample_record(49));
}

TEST_CASE("journal: a read-only view beside the holder and a second open refused") {
  TempDir dir("journal");
  auto j = open_ok(dir.str());
  const JobMeta m = sample_meta();
  REQUIRE(j->commit({{7, sample_record(7)}}, &m, true).ok());

  auto second = Journal::open(dir.str());
  REQUIRE(!second.ok());
  CHECK(second.status().code() == Code::io_error);
  CHECK(mentions(second.status(), dir.str()));

  auto view = Journal::open_read_only(dir.str());
  REQUIRE_MESSAGE(view.ok(), view.status().to_string());
  auto vm = (*view)->meta();
  REQUIRE(vm.ok());
  check_same(*vm, m);
  auto rs = (*view)->records();
  REQUIRE(rs.ok());
  REQUIRE(rs->count(7) == 1);
  check_same(rs->at(7), sample_record(7));
  CHECK((*view)->commit({{8, sample_record(8)}}, &m, true).code() == Code::unsupported);
  CHECK((*view)->erase({7}, true).code() == Code::unsupported);
  CHECK((*view)->corrupt_for_testing(7, 0).code() == Code::unsupported);
  CHECK(j->records()->size() == 1);  // the writer is unaffected
  REQUIRE(j->commit({{8, sample_record(8)}}, nullptr, true).ok());
}

TEST_CASE("journal: no journal or a directory that cannot be written is named") {
  TempDir dir("journal");
  const std::string missing = dir.str("never-made");
  auto ro = Journal::open_read_only(missing);
  CHECK(ro.status().code() == Code::not_found);
  CHECK(mentions(ro.status(), missing));
  auto nocreate = Journal::open(missing, false);
  CHECK(nocreate.status().code() == Code::not_found);
  CHECK(!fs::exists(missing));

  std::string bad = dir.str("locked");
  fs::create_directories(bad);
  ::chmod(bad.c_str(), 0500);
  if (::access(bad.c_str(), W_OK) == 0) {  // root: permissions do not stop us
    MESSAGE("running as root: a regular file stands in for the read-only directory");
    bad = dir.str("a-file");
    write_file(bad, "not a directory");
  }
  for (const std::string& path : {bad, bad + "/sub"}) {
    auto j = Journal::open(path);
    REQUIRE(!j.ok());
    CHECK(j.status().code() == Code::io_error);
    CHECK_MESSAGE(mentions(j.status(), path), j.status().message());
  }
  CHECK(Journal::open("").status().code() == Code::invalid_argument);
}
