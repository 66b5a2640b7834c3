#include "jobs/batch_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "jobs/batch_input.h"
#include "jobs/batch_service_impl.h"
#include "jobs/job_runner.h"
#include "jobs/job_status.h"

namespace cleave::jobs {
namespace {

using json = nlohmann::json;

bool terminal(JobStatus s) {
  return s == JobStatus::completed || s == JobStatus::failed || s == JobStatus::cancelled;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string derived_file_id(const std::string& batch_id, const char* what) {
  return "file-" + fingerprint_hex(batch_id + "/" + what).substr(0, 24);
}

Status BatchService::Impl::save(const BatchState& b) const {
  json j = {{"id", b.id},
            {"input_file_id", b.input_file_id},
            {"endpoint", b.endpoint},
            {"metadata", b.metadata},
            {"created_at", b.created_at}};
  // What the journal cannot say: a batch that never started (failed at
  // validation, or cancelled while queued).
  if (!b.started && terminal(b.meta.status)) {
    j["status"] = job_status_name(b.meta.status);
    j["error"] = b.meta.error;
    j["failed_at"] = b.meta.failed_at;
    j["cancelled_at"] = b.meta.cancelled_at;
  }
  return write_file_atomic(batch_dir(b.id) + "/batch.json", j.dump());
}

Status BatchService::Impl::load_all() {
  std::error_code ec;
  const std::string root = options.dir + "/batches";
  std::filesystem::create_directories(root, ec);
  if (ec) return Status(Code::io_error, "cannot create " + root + ": " + ec.message());
  std::vector<std::shared_ptr<BatchState>> found;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string path = entry.path().string() + "/batch.json";
    auto text = read_file_bytes(path);
    if (!text.ok()) continue;  // a batch whose creation did not finish
    json j = json::parse(*text, nullptr, false);
    auto b = std::make_shared<BatchState>();
    try {
      b->id = j.at("id").get<std::string>();
      b->input_file_id = j.at("input_file_id").get<std::string>();
      b->endpoint = j.at("endpoint").get<std::string>();
      b->metadata = j.at("metadata");
      b->created_at = j.at("created_at").get<int64_t>();
      b->meta.created_at = b->created_at;
      b->meta.endpoint = b->endpoint;
      if (j.contains("status")) {
        b->meta.status = parse_job_status(j.at("status").get<std::string>()).value_or(JobStatus::failed);
        b->meta.error = j.value("error", "");
        b->meta.failed_at = j.value("failed_at", int64_t(0));
        b->meta.cancelled_at = j.value("cancelled_at", int64_t(0));
      }
    } catch (const json::exception&) {
      return Status(Code::corruption, path + " is damaged");
    }
    b->output_file_id = derived_file_id(b->id, "output");
    b->error_file_id = derived_file_id(b->id, "errors");
    auto journal = Journal::open_read_only(batch_dir(b->id) + "/job/journal");
    if (journal.ok()) {
      auto m = (*journal)->meta();
      if (m.ok()) {
        b->meta = m.value();
        b->started = true;
      }
    }
    found.push_back(std::move(b));
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return a->created_at != b->created_at ? a->created_at < b->created_at : a->id < b->id;
  });
  for (auto& b : found) {
    // A cancel that was under way when the server stopped ends now.
    if (b->meta.status == JobStatus::cancelling) b->cancel = true;
    if (!terminal(b->meta.status)) queue.push_back(b->id);
    batches.emplace(b->id, std::move(b));
  }
  return Status::Ok();
}

std::string BatchService::Impl::object_json(const BatchState& b) const {
  JobMeta m = b.meta;
  m.endpoint = b.endpoint;
  if (m.created_at == 0) m.created_at = b.created_at;
  if (b.cancel && !terminal(m.status)) m.status = JobStatus::cancelling;
  const bool has_output = b.started && (m.status == JobStatus::completed || m.status == JobStatus::cancelled);
  json o = json::parse(batch_object_json(m, b.id, b.input_file_id, has_output ? b.output_file_id : "",
                                         has_output ? b.error_file_id : ""));
  o["metadata"] = b.metadata;
  return o.dump(-1, ' ', false, json::error_handler_t::replace);
}

void BatchService::Impl::run_one(const std::shared_ptr<BatchState>& b) {
  if (b->cancel) {  // cancelled while queued: it never runs
    std::lock_guard<std::mutex> lock(mu);
    if (!b->started) {
      b->meta.status = JobStatus::cancelled;
      b->meta.cancelled_at = unix_now();
      (void)save(*b);
      return;
    }
  }
  JobOptions jo;
  jo.job_dir = batch_dir(b->id) + "/job";
  jo.output_path = batch_dir(b->id) + "/output.jsonl";
  auto input = files.content_path(b->input_file_id);
  jo.input_path = input.ok() ? *input : "";
  jo.endpoint = b->endpoint;
  jo.parse = options.parse;
  jo.max_in_flight = options.max_in_flight;
  jo.settings = options.settings;
  jo.on_progress = [this, b](const JobMeta& m) {
    std::lock_guard<std::mutex> lock(mu);
    b->meta = m;
    b->started = true;
  };
  auto fail = [&](const Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    b->meta.status = JobStatus::failed;
    b->meta.error = st.message();
    b->meta.failed_at = unix_now();
    b->started = false;
    (void)save(*b);
    std::fprintf(stderr, "cleave: batch %s failed: %s\n", b->id.c_str(), st.to_string().c_str());
  };
  if (!input.ok()) return fail(input.status());
  auto runner = JobRunner::open(jo, model);
  if (!runner.ok()) return fail(runner.status());
  {
    std::lock_guard<std::mutex> lock(mu);
    b->meta = (*runner)->meta();
    b->started = true;
  }
  auto done = (*runner)->run(*frontend, &stop, &b->cancel);
  if (!done.ok()) {
    // Stopped with the server: it stays in_progress on disk and continues at the next start.
    if (stop.load()) return;
    // An I/O error (disk full): the job is intact; it continues at the next start.
    std::fprintf(stderr, "cleave: batch %s stopped: %s\n", b->id.c_str(), done.status().to_string().c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(mu);
  b->meta = done.value();
}

void BatchService::Impl::run_worker() {
  for (;;) {
    std::shared_ptr<BatchState> b;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      b = batches.at(queue.front());
      queue.pop_front();
    }
    run_one(b);
  }
}

Result<std::string> BatchService::Impl::file_path(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [bid, b] : batches) {
      if (!b->started) continue;
      if (id == b->output_file_id) return batch_dir(bid) + "/output.jsonl";
      if (id == b->error_file_id) return batch_dir(bid) + "/job/input_errors.jsonl";
    }
  }
  return files.content_path(id);
}

Result<FileObject> BatchService::Impl::file_object(const std::string& id) {
  std::string path, name;
  int64_t created = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [bid, b] : batches) {
      if (!b->started) continue;
      if (id == b->output_file_id) path = batch_dir(bid) + "/output.jsonl", name = bid + "_output.jsonl";
      else if (id == b->error_file_id) path = batch_dir(bid) + "/job/input_errors.jsonl", name = bid + "_errors.jsonl";
      else continue;
      created = b->meta.completed_at ? b->meta.completed_at : b->created_at;
    }
  }
  if (path.empty()) return files.get(id);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  FileObject f;
  f.id = id;
  f.filename = name;
  f.purpose = "batch_output";
  f.bytes = ec ? 0 : uint64_t(size);
  f.created_at = created;
  return f;
}

Result<std::unique_ptr<BatchService>> BatchService::open(BatchServiceOptions options) {
  if (options.dir.empty()) return Status(Code::invalid_argument, "the Batch API needs a directory (--batch-dir)");
  auto impl = std::make_shared<Impl>();
  auto files = FileStore::open(options.dir + "/files");
  if (!files.ok()) return files.status();
  impl->files = std::move(files.value());
  impl->options = std::move(options);
  Status st = impl->load_all();
  if (!st.ok()) return st;
  return std::unique_ptr<BatchService>(new BatchService(std::move(impl)));
}

BatchService::BatchService(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

BatchService::~BatchService() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->stop = true;
  impl_->cv.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
}

void BatchService::attach(server::Server& server) {
  impl_->server = &server;
  std::shared_ptr<Impl> impl = impl_;
  auto handler = [impl](const server::HttpRequest& r, std::shared_ptr<server::HttpResponder> out) {
    impl->handle(r, std::move(out));
  };
  server.add_routes("/v1/files", handler);
  server.add_routes("/v1/batches", handler);
}

void BatchService::start(server::ServedModel model, Frontend& frontend) {
  impl_->model = std::move(model);
  impl_->frontend = &frontend;
  Impl* raw = impl_.get();
  impl_->worker = std::thread([raw] { raw->run_worker(); });
}

}  // namespace cleave::jobs
