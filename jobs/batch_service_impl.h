// Private to jobs/: the Batch API's state, shared by the worker
// (batch_service.cpp) and the routes (batch_routes.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "jobs/batch_service.h"
#include "jobs/file_store.h"
#include "jobs/journal.h"
#include "server/http_server.h"

namespace cleave::jobs {

// A batch's output and errors files: ids of the file form, from the batch id.
std::string derived_file_id(const std::string& batch_id, const char* what);

struct BatchState {
  std::string id, input_file_id, endpoint;
  nlohmann::json metadata;  // null or an object of strings
  int64_t created_at = 0;
  JobMeta meta;              // the job's, as last seen (status validating before it starts)
  bool started = false;      // a JobRunner opened it (meta is the journal's)
  std::atomic<bool> cancel{false};
  std::string output_file_id, error_file_id;  // derived from the id
};

struct BatchService::Impl {
  BatchServiceOptions options;
  FileStore files;
  server::Server* server = nullptr;
  server::ServedModel model;
  Frontend* frontend = nullptr;

  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::shared_ptr<BatchState>> batches;  // by id
  std::deque<std::string> queue;                               // to run, in creation order
  bool stopping = false;
  std::atomic<bool> stop{false};
  std::thread worker;

  std::string batch_dir(const std::string& id) const { return options.dir + "/batches/" + id; }
  // batch.json: what POST /v1/batches was given, plus a failure or an early cancel.
  Status save(const BatchState& b) const;
  Status load_all();
  void run_worker();
  void run_one(const std::shared_ptr<BatchState>& b);
  std::string object_json(const BatchState& b) const;  // under mu
  // The path behind a file id: an uploaded file, or a batch's output / errors.
  Result<std::string> file_path(const std::string& id);
  Result<FileObject> file_object(const std::string& id);

  // The routes (batch_routes.cpp).
  void handle(const server::HttpRequest& request, std::shared_ptr<server::HttpResponder> out);
  void reply(const std::shared_ptr<server::HttpResponder>& out, const std::string& route, int status,
             std::string body, std::string type = "application/json");
  void reply_error(const std::shared_ptr<server::HttpResponder>& out, const std::string& route,
                   const server::ApiError& e);
};

}  // namespace cleave::jobs
