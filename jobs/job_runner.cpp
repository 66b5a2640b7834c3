#include "jobs/job_runner.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "jobs/batch_output.h"
#include "jobs/fault_point.h"
#include "jobs/result_log.h"
#include "server/openai_response.h"

namespace cleave::jobs {

using Clock = std::chrono::steady_clock;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Retryable where the job is concerned: the process is going away.
bool is_shutdown(const Status& s) { return s.code() == Code::aborted; }

// Capacity that may come back (a node rejoins, the queue drains): the
// request waits and runs again, it does not become an error record.
bool transient(const Status& s) {
  return s.code() == Code::busy || s.code() == Code::unavailable || s.code() == Code::timed_out;
}

}  // namespace

// One input line while it runs: its choices' requests and progress.
struct LineWork {
  uint64_t key = 0;  // index into input.lines: the journal's key
  std::vector<GenerateRequest> requests;
  std::vector<ChoiceProgress> choices;
  std::vector<bool> terminal;
  int32_t remaining = 0;
  int32_t prompt_tokens = 0;
  bool failed = false;
  server::ApiError error;
  bool dirty = false;  // progress since the last snapshot
};

struct Retry {
  std::shared_ptr<LineWork> w;
  int32_t choice = 0;
  Clock::time_point due;
  int32_t attempts = 0;
};

struct ReadyLine {
  uint64_t key = 0;
  std::string text;
  bool ok = true;
};

struct JobRunner::Impl : std::enable_shared_from_this<JobRunner::Impl> {
  JobOptions options;
  server::ServedModel model;
  Frontend* frontend = nullptr;
  BatchInput input;
  std::unique_ptr<Journal> journal;
  std::unique_ptr<ResultLog> output;
  JobMeta meta;
  std::deque<uint64_t> todo;  // keys not started in this run, input order
  std::map<uint64_t, RequestRecord> resumed;  // running records from the journal
  size_t remaining_at_open = 0;
  uint64_t corrupt_at_open = 0;
  double active_at_open = 0;
  uint64_t generated_at_open = 0, imported_at_open = 0, recomputed_at_open = 0;
  Clock::time_point started = Clock::now();

  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<uint64_t, std::shared_ptr<LineWork>> active;  // by key
  std::vector<ReadyLine> ready;
  std::vector<Retry> retries;  // choices refused or failed for want of capacity
  bool stopping = false;
  uint64_t next_id = 1;
  uint64_t generated_this_run = 0;
  double first_token_s = -1;

  bool strip_leading_space(const LineWork& w) const {
    return input.lines[w.key].kind == server::RequestKind::chat &&
           model.tokenizer->model_name() == "llama";
  }

  Status open_job();
  // Builds the line's requests (one per choice); an ApiError makes it an
  // error line at once.
  server::ApiResult<std::shared_ptr<LineWork>> build(uint64_t key);
  Status start(uint64_t key, bool& busy);
  Status submit_choice(const std::shared_ptr<LineWork>& w, int32_t i);
  std::vector<uint64_t> fail_choice(LineWork& w, int32_t i, const Status& why);  // under mu
  void schedule_retry(const std::shared_ptr<LineWork>& w, int32_t i, int32_t attempts);  // under mu
  void run_retries();
  void on_event(const std::shared_ptr<LineWork>& w, int32_t choice, const msg::StreamEvent& e);
  void complete(LineWork& w);  // under mu
  std::string response_body(const LineWork& w) const;
  Status flush_ready(std::vector<ReadyLine> lines);
  Status snapshot();
  void refresh_meta();  // counters into meta, under no lock
};

Status JobRunner::Impl::open_job() {
  std::error_code ec;
  std::filesystem::create_directories(options.job_dir, ec);
  if (ec) return Status(Code::io_error, "cannot create the job directory " + options.job_dir + ": " + ec.message());
  auto in = read_batch_input(options.input_path);
  if (!in.ok()) return in.status();
  input = std::move(in.value());
  auto j = Journal::open(options.job_dir + "/journal");
  if (!j.ok()) return j.status();
  journal = std::move(j.value());
  auto m = journal->meta();
  const bool fresh = !m.ok() && m.status().code() == Code::not_found;
  if (!m.ok() && !fresh) return m.status();
  if (fresh) {
    meta.input_fingerprint = input.fingerprint;
    meta.input_path = options.input_path;
    meta.output_path = options.output_path;
    meta.settings = options.settings;
    meta.endpoint = input.endpoint();
    meta.created_at = unix_now();
    meta.total = input.lines.size();
  } else {
    meta = m.value();
    if (meta.input_fingerprint != input.fingerprint)
      return Status(Code::invalid_argument,
                    "job directory " + options.job_dir + " belongs to an input with fingerprint " +
                        meta.input_fingerprint + " (" + meta.input_path + "); " + options.input_path +
                        " has fingerprint " + input.fingerprint + ": use another --job-dir");
    if (meta.output_path != options.output_path)
      return Status(Code::invalid_argument, "job directory " + options.job_dir + " writes its output to " +
                                                meta.output_path + ", not " + options.output_path);
    if (!meta.settings.empty() && !options.settings.empty() && meta.settings != options.settings)
      return Status(Code::invalid_argument,
                    "job directory " + options.job_dir + " was run with " + meta.settings + ", not " +
                        options.settings + ": its remaining lines would differ from an uninterrupted run's; "
                        "continue it with the same model and flags, or use another --job-dir");
    if (meta.settings.empty()) meta.settings = options.settings;  // a journal from before settings were kept
  }
  ++meta.runs;
  auto out = ResultLog::open(options.output_path, meta.output_bytes);
  if (!out.ok()) return out.status();
  output = std::move(out.value());
  // What the output holds is done, whatever the journal's records say.
  auto lines = ResultLog::scan(options.output_path, meta.output_bytes);
  if (!lines.ok()) return lines.status();
  std::unordered_set<std::string> done;
  for (const auto& l : *lines) done.insert(l.custom_id);
  auto records = journal->records();
  if (!records.ok()) return records.status();
  for (uint64_t key = 0; key < input.lines.size(); ++key) {
    if (done.count(input.lines[key].custom_id)) continue;
    auto it = records->find(key);
    if (it != records->end() && it->second.state == RequestState::running) resumed.emplace(key, it->second);
    todo.push_back(key);
  }
  remaining_at_open = todo.size();
  corrupt_at_open = journal->counters().corrupt_records;
  // The errors file is a function of the input: written whole each start.
  const std::string errors = options.job_dir + "/input_errors.jsonl";
  {
    std::ofstream f(errors + ".tmp", std::ios::binary | std::ios::trunc);
    for (const LineError& e : input.errors) f << input_error_line(e.line_no, e.message);
    if (!f) return Status(Code::io_error, "cannot write " + errors + ".tmp");
  }
  std::filesystem::rename(errors + ".tmp", errors, ec);
  if (ec) return Status(Code::io_error, "cannot write " + errors + ": " + ec.message());
  if (meta.status == JobStatus::validating) meta.status = JobStatus::in_progress;
  if (meta.in_progress_at == 0) meta.in_progress_at = unix_now();
  active_at_open = meta.active_seconds;
  generated_at_open = meta.generated_tokens;
  imported_at_open = meta.imported_tokens;
  recomputed_at_open = meta.recomputed_tokens;
  return journal->commit({}, &meta, /*sync=*/true);
}

server::ApiResult<std::shared_ptr<LineWork>> JobRunner::Impl::build(uint64_t key) {
  const BatchLine& line = input.lines[key];
  if (!line.valid) return line.error;
  if (!options.endpoint.empty() && line.url != options.endpoint)
    return server::ApiError::invalid("the line's url \"" + line.url + "\" is not the batch's endpoint \"" +
                                         options.endpoint + "\"",
                                     "url");
  auto parsed = line.kind == server::RequestKind::chat ? server::parse_chat_request(line.body, options.parse)
                                                       : server::parse_completion_request(line.body, options.parse);
  if (!parsed.ok()) return parsed.error();
  if (parsed->stream)
    return server::ApiError::invalid("\"stream\" is not supported in a batch", "stream");
  if (!parsed->model.empty() && parsed->model != model.name)
    return server::ApiError{404, "The model `" + parsed->model.substr(0, 200) + "` does not exist.",
                            "not_found_error", "model", "model_not_found"};
  const int32_t n = parsed->n;
  server::PromptContext ctx;
  ctx.tokenizer = model.tokenizer.get();
  ctx.chat_template = model.chat_template;
  ctx.special_tokens = model.special_tokens;
  ctx.image_tokens = model.image_tokens;
  ctx.context = model.context;
  ctx.default_seed = line_hash(input.fingerprint, line.custom_id);
  auto built = server::build_generate_request(std::move(parsed.value()), ctx);
  if (!built.ok()) return built.error();
  auto w = std::make_shared<LineWork>();
  w->key = key;
  w->prompt_tokens = int32_t(built->prompt.size());
  w->choices.resize(size_t(n));
  w->terminal.assign(size_t(n), false);
  for (int32_t i = 0; i < n; ++i) {
    GenerateRequest r = built.value();
    r.prefill_chunk = model.prefill_chunk;
    r.rng_stream = uint64_t(i);
    w->requests.push_back(std::move(r));
  }
  return w;
}

// Submits choice i of the line: resumed after its tokens so far when it has
// some (an earlier run's, or this run's before a retry).
Status JobRunner::Impl::submit_choice(const std::shared_ptr<LineWork>& w, int32_t i) {
  GenerateRequest r;
  std::vector<int32_t> generated;
  {
    std::lock_guard<std::mutex> lock(mu);
    w->requests[size_t(i)].request_id = next_id++;
    r = w->requests[size_t(i)];
    generated = w->choices[size_t(i)].tokens;
  }
  // The callbacks keep the state alive: the front end may outlive the runner.
  auto cb = [self = shared_from_this(), w, i](const msg::StreamEvent& e) { self->on_event(w, i, e); };
  const size_t replayed = generated.size();
  Status st = generated.empty() ? frontend->submit(std::move(r), cb)
                                : frontend->resume(std::move(r), std::move(generated), cb);
  if (st.ok() && replayed > 0) {
    meta.resumed_tokens += replayed;
    ++meta.resumed_requests;
  }
  return st;
}

// Ends choice i of the line with `why` (under mu); returns the sibling
// requests to cancel.
std::vector<uint64_t> JobRunner::Impl::fail_choice(LineWork& w, int32_t i, const Status& why) {
  std::vector<uint64_t> cancel;
  if (!w.failed) {
    w.failed = true;
    w.error = server::from_status(why);
    for (size_t k = 0; k < w.choices.size(); ++k)
      if (!w.terminal[k] && int32_t(k) != i) cancel.push_back(w.requests[k].request_id);
  }
  w.terminal[size_t(i)] = true;
  w.dirty = true;
  if (--w.remaining == 0) complete(w);
  return cancel;
}

void JobRunner::Impl::schedule_retry(const std::shared_ptr<LineWork>& w, int32_t i, int32_t attempts) {
  const double delay = std::min(5.0, 0.2 * double(1 << std::min(attempts, 5)));
  retries.push_back({w, i, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(delay)),
                     attempts + 1});
}

// Submits (or resumes) the line's choices. busy: the front end is full (the
// choices it refused wait for a retry): fill no more lines for now.
Status JobRunner::Impl::start(uint64_t key, bool& busy) {
  busy = false;
  auto built = build(key);
  if (!built.ok()) {
    std::lock_guard<std::mutex> lock(mu);
    ready.push_back({key, error_line(input.fingerprint, input.lines[key].custom_id, built.error()), false});
    return Status::Ok();
  }
  std::shared_ptr<LineWork> w = std::move(built.value());
  const int32_t n = int32_t(w->choices.size());
  if (auto it = resumed.find(key); it != resumed.end() && int32_t(it->second.choices.size()) == n)
    w->choices = it->second.choices;
  std::vector<int32_t> submit;  // choices that still run
  for (int32_t i = 0; i < n; ++i) {
    if (w->choices[size_t(i)].finish_reason.empty()) submit.push_back(i);
    else w->terminal[size_t(i)] = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    w->remaining = int32_t(submit.size());
    CLEAVE_CHECK(active.emplace(key, w).second);  // one LineWork per line, or it would be written twice
    if (w->remaining == 0) {
      complete(*w);
      return Status::Ok();
    }
  }
  for (int32_t i : submit) {
    Status st = submit_choice(w, i);
    if (st.ok()) continue;
    std::vector<uint64_t> cancel;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (w->failed) break;  // a sibling failed meanwhile
      if (transient(st)) {
        schedule_retry(w, i, 0);
        busy = true;
        continue;
      }
      cancel = fail_choice(*w, i, st);
    }
    for (uint64_t id : cancel) (void)frontend->cancel(id);
  }
  return Status::Ok();
}

// The retries that are due: submitted again (resumed after their tokens).
void JobRunner::Impl::run_retries() {
  std::vector<Retry> due;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    for (auto it = retries.begin(); it != retries.end();) {
      if (it->due <= now) {
        due.push_back(std::move(*it));
        it = retries.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Retry& r : due) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping || r.w->failed || r.w->terminal[size_t(r.choice)]) continue;
    }
    Status st = submit_choice(r.w, r.choice);
    if (st.ok()) continue;
    std::vector<uint64_t> cancel;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (transient(st)) schedule_retry(r.w, r.choice, r.attempts);
      else cancel = fail_choice(*r.w, r.choice, st);
    }
    for (uint64_t id : cancel) (void)frontend->cancel(id);
  }
}

void JobRunner::Impl::on_event(const std::shared_ptr<LineWork>& w, int32_t i, const msg::StreamEvent& e) {
  std::vector<uint64_t> cancel;
  {
    std::lock_guard<std::mutex> lock(mu);
    ChoiceProgress& c = w->choices[size_t(i)];
    if (w->terminal[size_t(i)]) return;
    auto visible = [&](std::string text) {
      if (c.text.empty() && !text.empty() && strip_leading_space(*w) && text[0] == ' ') text.erase(0, 1);
      return text;
    };
    switch (e.kind) {
      case msg::StreamEvent::Kind::token:
        if (e.index != int32_t(c.tokens.size())) return;  // not the next one: ignore
        if (c.tokens.empty()) c.cached_tokens = e.cached_tokens;
        c.tokens.push_back(e.token);
        c.text += visible(e.text);
        if (e.has_logprobs) c.logprobs.push_back(e.logprobs);
        if (generated_this_run++ == 0)
          first_token_s = std::chrono::duration<double>(Clock::now() - started).count();
        w->dirty = true;
        return;
      case msg::StreamEvent::Kind::finished:
        c.text += visible(e.text);
        c.finish_reason = e.finish_reason.empty() ? "stop" : e.finish_reason;
        break;
      case msg::StreamEvent::Kind::failed:
        if (stopping && is_shutdown(e.error)) return;  // stays running: the next start resumes it
        if (transient(e.error) && !w->failed) {
          // No stage of the kind right now (a node died): the choice goes on
          // after its tokens once one is back.
          schedule_retry(w, i, 0);
          return;
        }
        cancel = fail_choice(*w, i, e.error);
        break;
    }
    if (e.kind == msg::StreamEvent::Kind::finished) {
      w->terminal[size_t(i)] = true;
      w->dirty = true;
      if (--w->remaining == 0) complete(*w);
    }
  }
  for (uint64_t id : cancel) (void)frontend->cancel(id);
}

std::string JobRunner::Impl::response_body(const LineWork& w) const {
  server::ResponseMeta rm;
  const BatchLine& line = input.lines[w.key];
  rm.id = server::response_id(line.kind, line_hash(input.fingerprint, line.custom_id));
  rm.created = unix_now();
  rm.model = model.name;
  const bool has_logprobs = w.requests.front().logprobs >= 0;
  std::vector<server::ChoiceOutput> outs;
  server::Usage usage;
  usage.prompt_tokens = w.prompt_tokens;
  for (size_t i = 0; i < w.choices.size(); ++i) {
    const ChoiceProgress& c = w.choices[i];
    server::ChoiceOutput o;
    o.index = int32_t(i);
    o.text = c.text;
    o.finish_reason = c.finish_reason;
    o.has_logprobs = has_logprobs;
    o.logprobs = c.logprobs;
    outs.push_back(std::move(o));
    usage.completion_tokens += int32_t(c.tokens.size());
  }
  usage.cached_tokens = w.choices.front().cached_tokens;
  auto token_text = [tok = model.tokenizer](int32_t t) { return tok->token_bytes(t); };
  return line.kind == server::RequestKind::chat ? server::chat_response(rm, outs, usage, token_text)
                                                : server::completion_response(rm, outs, usage, token_text);
}

void JobRunner::Impl::complete(LineWork& w) {
  const std::string& id = input.lines[w.key].custom_id;
  if (w.failed) ready.push_back({w.key, error_line(input.fingerprint, id, w.error), false});
  else ready.push_back({w.key, output_line(input.fingerprint, id, 200, response_body(w)), true});
  active.erase(w.key);
  cv.notify_all();
}

void JobRunner::Impl::refresh_meta() {
  const double now = std::chrono::duration<double>(Clock::now() - started).count();
  meta.active_seconds = active_at_open + now;
  uint64_t imported = 0, recomputed = 0;
  for (const msg::Stats& s : frontend->stats()) {
    imported += s.get("imported_tokens");
    recomputed += s.get("recomputed_tokens");
  }
  meta.imported_tokens = imported_at_open + imported;
  meta.recomputed_tokens = recomputed_at_open + recomputed;
  std::lock_guard<std::mutex> lock(mu);
  meta.generated_tokens = generated_at_open + generated_this_run;
}

// The append protocol (result_log.h): write + fdatasync, then the journal.
Status JobRunner::Impl::flush_ready(std::vector<ReadyLine> lines) {
  if (lines.empty()) return Status::Ok();
  std::string bytes;
  for (const ReadyLine& l : lines) bytes += l.text;
  fault_point("result.before_write");
  auto end = output->append(bytes);
  if (!end.ok()) return end.status();
  fault_point("result.after_sync");
  std::vector<std::pair<uint64_t, RequestRecord>> records;
  uint64_t offset = *end - bytes.size();
  for (const ReadyLine& l : lines) {
    offset += l.text.size();
    RequestRecord r;
    r.state = RequestState::done;
    r.output_end = offset;
    r.ok = l.ok;
    records.emplace_back(l.key, std::move(r));
    ++(l.ok ? meta.completed : meta.failed);
  }
  meta.output_bytes = *end;
  refresh_meta();
  Status st = journal->commit(records, &meta, /*sync=*/true);
  if (!st.ok()) return st;
  fault_point("result.after_commit");
  if (options.on_progress) options.on_progress(meta);
  return Status::Ok();
}

// Each running choice's tokens so far (not fsync'd: a crash of the process
// keeps them, a power cut may cost recomputation, never wrong tokens).
Status JobRunner::Impl::snapshot() {
  std::vector<std::pair<uint64_t, RequestRecord>> records;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [key, w] : active) {
      if (!w->dirty) continue;
      w->dirty = false;
      RequestRecord r;
      r.state = RequestState::running;
      r.choices = w->choices;
      records.emplace_back(key, std::move(r));
    }
  }
  refresh_meta();
  Status st = journal->commit(records, &meta, /*sync=*/false);
  if (st.ok() && options.on_progress) options.on_progress(meta);
  return st;
}

Result<std::unique_ptr<JobRunner>> JobRunner::open(JobOptions options, server::ServedModel model) {
  if (options.job_dir.empty()) return Status(Code::invalid_argument, "a job needs a job directory");
  if (options.max_in_flight < 1)
    return Status(Code::invalid_argument, "max_in_flight must be at least 1, got " +
                                              std::to_string(options.max_in_flight));
  auto impl = std::make_shared<Impl>();
  impl->options = std::move(options);
  impl->model = std::move(model);
  Status st = impl->open_job();
  if (!st.ok()) return st;
  return std::unique_ptr<JobRunner>(new JobRunner(std::move(impl)));
}

JobRunner::JobRunner(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

JobRunner::~JobRunner() {
  if (!impl_) return;
  // Requests still in the front end end with it; their callbacks must find
  // nothing to do.
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stopping = true;
}

JobMeta JobRunner::meta() const { return impl_->meta; }
std::string JobRunner::errors_path() const { return impl_->options.job_dir + "/input_errors.jsonl"; }
size_t JobRunner::remaining_at_open() const { return impl_->remaining_at_open; }
uint64_t JobRunner::corrupt_records() const { return impl_->corrupt_at_open; }
double JobRunner::first_token_seconds() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->first_token_s;
}

Result<JobMeta> JobRunner::run(Frontend& frontend, const std::atomic<bool>* stop,
                               const std::atomic<bool>* cancel) {
  Impl& m = *impl_;
  if (!m.journal) return Status(Code::invalid_argument, "a job runs once per JobRunner::open");
  m.frontend = &frontend;
  // The journal and the output close when run() returns, even while late
  // callbacks keep the state alive: the job can be opened again at once.
  struct Close {
    Impl& m;
    ~Close() {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stopping = true;
      m.journal.reset();
      m.output.reset();
    }
  } close{m};
  if (m.meta.status == JobStatus::completed || m.meta.status == JobStatus::cancelled) return m.meta;
  const auto interval = std::chrono::duration<double>(m.options.snapshot_interval_s);
  auto stop_all = [&](Status why) -> Status {
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stopping = true;
      for (auto& [key, w] : m.active)
        for (size_t i = 0; i < w->requests.size(); ++i)
          if (!w->terminal[i]) ids.push_back(w->requests[i].request_id);
    }
    for (uint64_t id : ids) (void)m.frontend->cancel(id);
    // Lines that finished meanwhile still go out (unless writing is what failed).
    std::vector<ReadyLine> lines;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      lines.swap(m.ready);
    }
    if (why.code() != Code::io_error) {
      Status st = m.flush_ready(std::move(lines));
      if (!st.ok() && why.ok()) why = st;
    }
    (void)m.snapshot();
    return why;
  };
  auto next_snapshot = Clock::now() + interval;
  for (;;) {
    if (stop && stop->load()) return stop_all(Status(Code::aborted, "the job was stopped; run it again to continue"));
    if (cancel && cancel->load()) {
      m.meta.status = JobStatus::cancelling;
      m.meta.cancelling_at = unix_now();
      Status st = stop_all(Status::Ok());
      if (!st.ok()) return st;
      m.meta.status = JobStatus::cancelled;
      m.meta.cancelled_at = unix_now();
      m.refresh_meta();
      st = m.journal->commit({}, &m.meta, /*sync=*/true);
      if (!st.ok()) return st;
      if (m.options.on_progress) m.options.on_progress(m.meta);
      return m.meta;
    }
    m.run_retries();
    // Fill the window.
    for (;;) {
      size_t in_flight;
      {
        std::lock_guard<std::mutex> lock(m.mu);
        in_flight = m.active.size();
      }
      if (m.todo.empty() || in_flight >= size_t(m.options.max_in_flight)) break;
      bool busy = false;
      const uint64_t key = m.todo.front();
      m.todo.pop_front();  // started: it is active now (choices the front end refused wait for a retry)
      Status st = m.start(key, busy);
      if (!st.ok()) return stop_all(st);
      if (busy) break;
    }
    std::vector<ReadyLine> lines;
    bool finished = false;
    {
      std::unique_lock<std::mutex> lock(m.mu);
      m.cv.wait_until(lock, next_snapshot, [&] { return !m.ready.empty(); });
      lines.swap(m.ready);
      finished = m.todo.empty() && m.active.empty();
    }
    Status st = m.flush_ready(std::move(lines));
    if (!st.ok()) return stop_all(st);
    if (Clock::now() >= next_snapshot) {
      st = m.snapshot();
      if (!st.ok()) return stop_all(st);
      next_snapshot = Clock::now() + interval;
    }
    if (finished) break;
  }
  m.refresh_meta();
  m.meta.status = JobStatus::completed;
  m.meta.completed_at = unix_now();
  Status st = m.journal->commit({}, &m.meta, /*sync=*/true);
  if (!st.ok()) return st;
  // The output holds every line now: the request records are not needed.
  std::vector<uint64_t> keys;
  for (uint64_t k = 0; k < m.input.lines.size(); ++k) keys.push_back(k);
  (void)m.journal->erase(keys, /*sync=*/false);
  if (m.options.on_progress) m.options.on_progress(m.meta);
  return m.meta;
}

}  // namespace cleave::jobs
