// JobRunner in one process over a mono pipeline with a durable KV store:
// a job stopped midway, with journal records and KV blocks corrupted on
// disk, resumed: the uninterrupted run's lines, each custom_id once (the
// checksums turn the damage into recomputation); a KV disk cap that drops
// blocks changes nothing in the output; the endpoint rule; cancel.
#include <doctest/doctest.h>
#include <rocksdb/db.h>

#include <atomic>
#include <map>
#include <nlohmann/json.hpp>

#include "actors/pipeline.h"
#include "jobs/job_runner.h"
#include "jobs/journal.h"
#include "model/make_model.h"
#include "server/served_model.h"
#include "tests/jobs/jobs_test_util.h"

using namespace cleave;
using namespace cleave::jobs;
using json = nlohmann::json;
using jobs_test::TempDir;

namespace {

const std::string kVocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

struct Model {
  std::shared_ptr<const GgufFile> file;
  std::shared_ptr<const Tokenizer> tokenizer;
  server::ServedModel served;
};

const Model& model() {
  static TempDir dir("runner_model");
  static Model m = [] {
    ModelSpec s;
    s.dim = 64; s.n_layers = 2; s.n_heads = 4; s.n_kv_heads = 2; s.ffn = 128; s.context = 512;
    s.seed = 5;
    s.name = "runner-test";
    const std::string path = dir.str("m.gguf");
    Status st = write_test_model(s, kVocab, path);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    Model out;
    out.file = std::move(GgufFile::open(path).value());
    out.tokenizer = std::shared_ptr<const Tokenizer>(std::move(Tokenizer::from_gguf(*out.file).value()));
    server::ServedModelArgs a;
    a.model = out.file;
    a.tokenizer = out.tokenizer;
    a.name = "runner-test";
    auto served = server::describe_served_model(a);
    REQUIRE_MESSAGE(served.ok(), served.status().to_string());
    out.served = std::move(served.value());
    return out;
  }();
  return m;
}

std::string write_input(const TempDir& dir, int n) {
  std::string text;
  for (int i = 0; i < n; ++i) {
    json body = {{"prompt", "the quiet hills " + std::to_string(i) + " and old roads near the sea " +
                                std::string(size_t(i % 5) * 6, 'a')},
                 {"max_tokens", 40 + i % 9},
                 {"ignore_eos", true},
                 {"temperature", i % 2 ? 0.9 : 0.0}};
    if (i % 4 == 1) body["seed"] = 1000 + i;
    text += json{{"custom_id", "c" + std::to_string(i)}, {"method", "POST"}, {"url", "/v1/completions"},
                 {"body", body}}.dump() + "\n";
  }
  const std::string path = dir.str("in.jsonl");
  jobs_test::write_file(path, text);
  return path;
}

PipelineOptions pipeline_options(const std::string& kv_dir, size_t disk_bytes = 0) {
  PipelineOptions o;
  o.engine.threads = 1;
  o.engine.max_seqs = 8;
  o.engine.block_size = 16;
  o.kv_dir = kv_dir;
  o.kv_durable = true;
  o.kv_disk_bytes = disk_bytes;
  return o;
}

std::unique_ptr<Pipeline> pipeline(const std::string& kv_dir, size_t disk_bytes = 0) {
  auto p = Pipeline::create(model().file, model().tokenizer, pipeline_options(kv_dir, disk_bytes));
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  return std::move(p.value());
}

JobOptions job_options(const TempDir& dir, const std::string& input, const std::string& name) {
  JobOptions o;
  o.job_dir = dir.str(name + ".job");
  o.input_path = input;
  o.output_path = dir.str(name + ".jsonl");
  o.snapshot_interval_s = 0.01;
  return o;
}

// Runs the job to its end (or until `stop_after` tokens were sampled in this run).
JobMeta run_job(JobOptions o, Frontend& f, uint64_t stop_after = 0, const std::atomic<bool>* cancel = nullptr) {
  std::atomic<bool> stop{false};
  uint64_t first = ~uint64_t(0);
  if (stop_after)
    o.on_progress = [&](const JobMeta& m) {
      if (first == ~uint64_t(0)) first = m.generated_tokens;
      if (m.generated_tokens - first >= stop_after) stop = true;
    };
  auto runner = JobRunner::open(o, model().served);
  REQUIRE_MESSAGE(runner.ok(), runner.status().to_string());
  auto done = (*runner)->run(f, &stop, cancel);
  if (stop_after) {
    CHECK(done.status().code() == Code::aborted);
    return (*runner)->meta();
  }
  REQUIRE_MESSAGE(done.ok(), done.status().to_string());
  return done.value();
}

// custom_id -> response body without "created" and cached_tokens; each id once.
std::map<std::string, json> read_output(const std::string& path) {
  std::map<std::string, json> out;
  std::istringstream in(jobs_test::read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line);
    json& body = j["response"]["body"];
    body.erase("created");
    if (body.contains("usage")) body["usage"]["prompt_tokens_details"].erase("cached_tokens");
    const std::string id = j["custom_id"];
    CHECK_MESSAGE(!out.count(id), id << " is in the output twice");
    out[id] = j;
  }
  return out;
}

uint64_t stat(Frontend& f, const std::string& name) {
  uint64_t n = 0;
  for (const msg::Stats& s : f.stats()) n += s.get(name);
  return n;
}

// Flips a byte in every `every`-th KV block the job's store holds on disk.
int corrupt_kv(const std::string& kv_dir, int every) {
  rocksdb::DBOptions o;
  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"meta", {}}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  REQUIRE(rocksdb::DB::Open(o, kv_dir, families, &handles, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  std::vector<std::pair<std::string, std::string>> changed;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), handles[1]));
  int i = 0;
  for (it->SeekToFirst(); it->Valid(); it->Next(), ++i) {
    if (i % every) continue;
    std::string v = it->value().ToString();
    v[v.size() / 2] ^= 0x40;
    changed.emplace_back(it->key().ToString(), v);
  }
  it.reset();
  for (auto& [k, v] : changed) REQUIRE(db->Put(rocksdb::WriteOptions(), handles[1], k, v).ok());
  for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
  return int(changed.size());
}

}  // namespace

TEST_CASE("job runner: stopped, journal and KV records corrupted on disk, resumed: the uninterrupted lines") {
  TempDir dir("runner_corrupt");
  const std::string input = write_input(dir, 24);
  {
    auto p = pipeline(dir.str("ref.kv"));
    const JobMeta m = run_job(job_options(dir, input, "ref"), *p);
    CHECK(m.status == JobStatus::completed);
    CHECK(m.completed == 24);
  }
  const auto ref = read_output(dir.str("ref.jsonl"));
  REQUIRE(ref.size() == 24);

  JobOptions o = job_options(dir, input, "out");
  {
    auto p = pipeline(dir.str("out.kv"));
    run_job(o, *p, /*stop_after=*/300);
  }
  int running = 0, corrupted = 0;
  {
    auto j = Journal::open(o.job_dir + "/journal", /*create=*/false);
    REQUIRE(j.ok());
    auto records = (*j)->records();
    REQUIRE(records.ok());
    for (const auto& [index, r] : *records) {
      if (r.state != RequestState::running) continue;
      if (running++ % 2 == 0) {
        REQUIRE((*j)->corrupt_for_testing(index, 7).ok());
        ++corrupted;
      }
    }
  }
  REQUIRE_MESSAGE(running >= 2, "the stop left too few requests running: " << running);
  const int bad_blocks = corrupt_kv(dir.str("out.kv"), 2);
  REQUIRE(bad_blocks > 0);
  {
    auto p = pipeline(dir.str("out.kv"));
    auto runner = JobRunner::open(o, model().served);
    REQUIRE(runner.ok());
    CHECK((*runner)->corrupt_records() == uint64_t(corrupted));
    auto done = (*runner)->run(*p);
    REQUIRE_MESSAGE(done.ok(), done.status().to_string());
    CHECK(done->status == JobStatus::completed);
    CHECK(done->resumed_requests > 0);
    MESSAGE("corrupted ", corrupted, " of ", running, " running records and ", bad_blocks,
            " KV blocks; the store caught ", stat(*p, "kv_store_corrupt"));
    CHECK(stat(*p, "kv_store_corrupt") > 0);
  }
  CHECK(read_output(dir.str("out.jsonl")) == ref);
}

TEST_CASE("job runner: a KV disk cap drops the oldest blocks and changes no line") {
  TempDir dir("runner_cap");
  const std::string input = write_input(dir, 16);
  {
    auto p = pipeline(dir.str("ref.kv"));
    run_job(job_options(dir, input, "ref"), *p);
  }
  JobOptions o = job_options(dir, input, "out");
  constexpr size_t kCap = size_t(96) << 10;  // a dozen 8 KiB blocks
  {
    auto p = pipeline(dir.str("out.kv"), kCap);
    run_job(o, *p, /*stop_after=*/200);
  }
  auto p = pipeline(dir.str("out.kv"), kCap);
  const JobMeta m = run_job(o, *p);
  CHECK(m.status == JobStatus::completed);
  CHECK(stat(*p, "kv_store_drops") > 0);
  CHECK(stat(*p, "kv_store_bytes") <= kCap);
  CHECK(read_output(dir.str("out.jsonl")) == read_output(dir.str("ref.jsonl")));
}

TEST_CASE("job runner: lines whose url is not the batch's endpoint get an error record, cancel ends the job") {
  TempDir dir("runner_endpoint");
  const std::string input = write_input(dir, 12);
  auto p = pipeline(dir.str("kv"));
  JobOptions o = job_options(dir, input, "chat");
  o.endpoint = "/v1/chat/completions";
  run_job(o, *p);
  for (const auto& [id, line] : read_output(o.output_path)) {
    CHECK(line["response"]["status_code"] == 400);
    CHECK(line["response"]["body"]["error"]["param"] == "url");
  }
  // Cancelled once it has made progress: status cancelled, fewer lines than
  // the input, and a second run does nothing more.
  JobOptions c = job_options(dir, input, "cancel");
  std::atomic<bool> cancel{false};
  c.on_progress = [&](const JobMeta& m) {
    if (m.generated_tokens > 0) cancel = true;
  };
  auto runner = JobRunner::open(c, model().served);
  REQUIRE(runner.ok());
  auto done = (*runner)->run(*p, nullptr, &cancel);
  REQUIRE(done.ok());
  CHECK(done->status == JobStatus::cancelled);
  CHECK(done->cancelling_at > 0);
  CHECK(done->cancelled_at > 0);
  const size_t lines = read_output(c.output_path).size();
  CHECK(lines < 12);
  CHECK(lines == done->completed + done->failed);
  runner = Status(Code::aborted, "closed");  // releases the journal first
  runner = JobRunner::open(job_options(dir, input, "cancel"), model().served);
  REQUIRE(runner.ok());
  auto again = (*runner)->run(*p);
  REQUIRE(again.ok());
  CHECK(again->status == JobStatus::cancelled);
  CHECK(read_output(c.output_path).size() == lines);
}

TEST_CASE("job runner: a job directory first run under other settings is refused naming both, and the same settings continue") {
  TempDir dir("runner_settings");
  const std::string input = write_input(dir, 4);
  JobOptions o = job_options(dir, input, "out");
  o.settings = "model 00aa, KV f32 K / f32 V in blocks of 16, compute exact, device cpu";
  {
    auto first = JobRunner::open(o, model().served);
    REQUIRE_MESSAGE(first.ok(), first.status().to_string());
    CHECK((*first)->meta().settings == o.settings);
  }
  JobOptions other = o;
  other.settings = "model 00aa, KV f32 K / f32 V in blocks of 64, compute exact, device cpu";
  auto refused = JobRunner::open(other, model().served);
  REQUIRE(!refused.ok());
  CHECK(refused.status().code() == Code::invalid_argument);
  CHECK(jobs_test::mentions(refused.status(), "was run with " + o.settings + ", not " + other.settings));
  auto same = JobRunner::open(o, model().served);
  REQUIRE_MESSAGE(same.ok(), same.status().to_string());
  CHECK((*same)->meta().runs == 2);  // the refused open counted no run
  same = Status(Code::aborted, "closed");
  // A journal from before settings were kept (none recorded) takes the run's.
  JobOptions old = job_options(dir, input, "old");
  {
    auto r = JobRunner::open(old, model().served);
    REQUIRE(r.ok());
    CHECK((*r)->meta().settings.empty());
  }
  old.settings = other.settings;
  auto adopted = JobRunner::open(old, model().served);
  REQUIRE_MESSAGE(adopted.ok(), adopted.status().to_string());
  CHECK((*adopted)->meta().settings == other.settings);
}
