// The result log: appends land byte for byte at the returned offsets, open
// cuts an uncommitted tail and refuses a file shorter than its committed
// length, scan finds complete lines and their custom_ids, and a failed append
// (a short write past RLIMIT_FSIZE, a bad descriptor, a full device) is cut
// back, names the path and leaves the log usable.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "jobs/result_log.h"
#include "jobs_test_util.h"

using namespace cleave;
using namespace cleave::jobs;
using namespace jobs_test;

namespace {

std::unique_ptr<ResultLog> open_ok(const std::string& path, uint64_t committed) {
  auto log = ResultLog::open(path, committed);
  REQUIRE_MESSAGE(log.ok(), log.status().to_string());
  return std::move(*log);
}

// The descriptor this process holds on `path` (the log's own), found in /proc.
int fd_of(const std::string& path) {
  const auto want = fs::canonical(path);
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = fs::read_symlink(e.path(), ec);
    if (!ec && target == want) return std::stoi(e.path().filename().string());
  }
  return -1;
}

}  // namespace

TEST_CASE("result log: open creates the file and appends return their ends with the bytes exact") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  auto log = open_ok(path, 0);
  CHECK(fs::exists(path));
  CHECK(log->size() == 0);
  CHECK(log->path() == path);
  auto a = log->append("{\"custom_id\":\"a\"}\n");
  REQUIRE(a.ok());
  CHECK(*a == 18);
  auto b = log->append("line two\nline three\n");
  REQUIRE(b.ok());
  CHECK(*b == 38);
  auto c = log->append("");
  REQUIRE(c.ok());
  CHECK(*c == 38);
  CHECK(log->size() == 38);
  CHECK(read_file(path) == "{\"custom_id\":\"a\"}\nline two\nline three\n");
  log.reset();
  auto again = open_ok(path, 38);  // reopening at the committed end appends after it
  REQUIRE(again->append("4\n").ok());
  CHECK(read_file(path) == "{\"custom_id\":\"a\"}\nline two\nline three\n4\n");
}

TEST_CASE("result log: open cuts a partial or uncommitted tail") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  write_file(path, "one\ntwo\nthree\npart");
  {
    auto log = open_ok(path, 14);  // "part" was never committed
    CHECK(read_file(path) == "one\ntwo\nthree\n");
    CHECK(log->size() == 14);
  }
  {
    auto log = open_ok(path, 4);  // whole lines whose commit never happened go too
    CHECK(read_file(path) == "one\n");
    auto end = log->append("again\n");
    REQUIRE(end.ok());
    CHECK(*end == 10);
    CHECK(read_file(path) == "one\nagain\n");
  }
  auto log = open_ok(path, 10);  // exactly committed: untouched
  CHECK(read_file(path) == "one\nagain\n");
  auto empty = open_ok(path, 0);
  CHECK(read_file(path).empty());
}

TEST_CASE("result log: a file shorter than its committed length is corruption") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  write_file(path, "abc\n");
  auto log = ResultLog::open(path, 1234);
  REQUIRE(!log.ok());
  CHECK(log.status().code() == Code::corruption);
  CHECK(mentions(log.status(), path));
  CHECK(mentions(log.status(), " 4 bytes"));
  CHECK(mentions(log.status(), "1234"));
  CHECK(read_file(path) == "abc\n");  // left as it was

  auto nodir = ResultLog::open(dir.str("missing/out.jsonl"), 0);
  CHECK(nodir.status().code() == Code::io_error);
  CHECK(mentions(nodir.status(), dir.str("missing/out.jsonl")));
  CHECK(mentions(nodir.status(), "No such file"));
}

TEST_CASE("result log: scan finds complete lines with their ends and custom_ids") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  const std::string lines[] = {
      "{\"id\":\"batch_req_1\",\"custom_id\":\"req-1\",\"response\":{}}\n",
      "not json at all\n",
      "{\"custom_id\":5}\n",
      "[\"custom_id\",\"x\"]\n",
      "{\"custom_id\":\"r\xc3\xa9q-\xe4\xb8\x96\"}\n",
      "\n",
      "{\"custom_id\":\"bad\" trailing}\n",
  };
  std::string all;
  std::vector<uint64_t> ends;
  for (const auto& l : lines) {
    all += l;
    ends.push_back(all.size());
  }
  write_file(path, all + "{\"custom_id\":\"partial\"");
  const std::vector<std::string> ids = {"req-1", "", "", "", "r\xc3\xa9q-\xe4\xb8\x96", "", ""};

  auto got = ResultLog::scan(path, all.size() + 22);
  REQUIRE(got.ok());
  REQUIRE(got->size() == 7);  // the partial last line is not a line
  for (size_t i = 0; i < 7; ++i) {
    CAPTURE(i);
    CHECK((*got)[i].end == ends[i]);
    CHECK((*got)[i].custom_id == ids[i]);
  }
  CHECK(ResultLog::scan(path, 1 << 30)->size() == 7);  // past the end: the file's end
  CHECK(ResultLog::scan(path, 0)->empty());
  CHECK(ResultLog::scan(path, ends[1])->size() == 2);      // a line ending at upto counts
  CHECK(ResultLog::scan(path, ends[1] - 1)->size() == 1);  // its '\n' past upto: not
  CHECK(ResultLog::scan(path, ends[2] + 3)->size() == 3);
  auto missing = ResultLog::scan(dir.str("nope"), 10);
  CHECK(missing.status().code() == Code::io_error);
  CHECK(mentions(missing.status(), dir.str("nope")));
}

TEST_CASE("result log: scan across its 64 KiB reads") {
  TempDir dir("log");
  const std::string path = dir.str("big.jsonl");
  std::string all;
  std::vector<uint64_t> ends;
  for (int i = 0; i < 4000; ++i) {  // ~0.5 MiB of lines of varying length
    all += "{\"custom_id\":\"req-" + std::to_string(i) + "\",\"pad\":\"" +
           std::string(size_t(i * 37 % 211), 'x') + "\"}\n";
    ends.push_back(all.size());
  }
  all += "{\"custom_id\":\"huge\",\"pad\":\"" + std::string(200000, 'y') + "\"}\n";
  ends.push_back(all.size());
  write_file(path, all);
  auto got = ResultLog::scan(path, all.size());
  REQUIRE(got.ok());
  REQUIRE(got->size() == ends.size());
  bool all_good = true;
  for (size_t i = 0; i < 4000; ++i)
    all_good =
        all_good && (*got)[i].end == ends[i] && (*got)[i].custom_id == "req-" + std::to_string(i);
  CHECK(all_good);
  CHECK(got->back().custom_id == "huge");
  CHECK(got->back().end == all.size());
}

TEST_CASE("result log: a write error names the path and a later append works") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  auto log = open_ok(path, 0);
  REQUIRE(log->append("first\n").ok());
  const int fd = fd_of(path);
  REQUIRE(fd >= 0);
  const int saved = ::dup(fd);
  REQUIRE(saved >= 0);

  struct Broken {
    const char* device;
    int flags;
    const char* says;
  };
  // /dev/null read-only: the descriptor can no longer write; /dev/full: ENOSPC.
  for (const Broken& b : {Broken{"/dev/null", O_RDONLY, "Bad file descriptor"},
                          Broken{"/dev/full", O_WRONLY, "disk full"}}) {
    CAPTURE(b.device);
    const int dev = ::open(b.device, b.flags);
    REQUIRE(dev >= 0);
    REQUIRE(::dup2(dev, fd) == fd);
    ::close(dev);
    auto bad = log->append("second\n");
    REQUIRE(!bad.ok());
    CHECK(bad.status().code() == Code::io_error);
    CHECK(mentions(bad.status(), path));
    CHECK_MESSAGE(mentions(bad.status(), b.says), bad.status().message());
    CHECK(log->size() == 6);
  }
  REQUIRE(::dup2(saved, fd) == fd);
  ::close(saved);
  auto good = log->append("second\n");
  REQUIRE(good.ok());
  CHECK(*good == 13);
  CHECK(read_file(path) == "first\nsecond\n");
}

// Appends across RLIMIT_FSIZE: the write stops part way (EFBIG) and the file
// must be cut back to where it was.
TEST_CASE("result log: child appends past its file size limit" * doctest::skip()) {
  if (child_pipe_fd() < 0) return;
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &lim) == 0);
  lim.rlim_cur = 100;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
  const std::string path = std::getenv("CLEAVE_TEST_LOG");
  auto log = open_ok(path, 0);
  REQUIRE(log->append(std::string(39, 'a') + "\n").ok());
  auto over = log->append(std::string(199, 'b') + "\n");
  struct stat st {};
  ::stat(path.c_str(), &st);
  child_say(std::string(over.ok() ? "ok" : code_name(over.status().code())) + "|" +
            over.status().message() + "|" + std::to_string(st.st_size) + "|" +
            std::to_string(log->size()) + "|");
  auto next = log->append(std::string(29, 'c') + "\n");
  child_say(next.ok() ? std::to_string(*next) : next.status().to_string());
}

TEST_CASE("result log: a short write is cut back to the previous end") {
  TempDir dir("log");
  const std::string path = dir.str("out.jsonl");
  const auto r = run_child("result log: child appends past its file size limit",
                           {{"CLEAVE_TEST_LOG", path.c_str()}});
  CHECK_MESSAGE(r.exited_ok(), r.output);
  const std::string prefix = "io_error|result log '" + path + "': ";
  CHECK_MESSAGE(r.said.rfind(prefix, 0) == 0, r.said);
  CHECK_MESSAGE(r.said.find("File too large|40|40|70") != std::string::npos, r.said);
  CHECK(read_file(path) == std::string(39, 'a') + "\n" + std::string(29, 'c') + "\n");
}
