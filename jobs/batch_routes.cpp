// The Batch API's routes (batch_service.h): request checks, answers in
// OpenAI's shapes, and the same error JSON as the rest of the server.
#include <algorithm>
#include <chrono>
#include <filesystem>

#include "jobs/batch_input.h"

#include "jobs/batch_service_impl.h"
#include "jobs/multipart.h"
#include "server/metrics.h"

namespace cleave::jobs {
namespace {

using json = nlohmann::json;
using server::ApiError;

bool valid_batch_id(std::string_view id) {
  if (id.size() != 30 || id.substr(0, 6) != "batch_") return false;
  for (char c : id.substr(6))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// "/v1/batches/ID/cancel" -> {"ID", "cancel"}; parts after the prefix.
std::vector<std::string> split_path(std::string_view target, std::string_view prefix) {
  std::vector<std::string> parts;
  std::string_view rest = target.substr(prefix.size());
  while (!rest.empty()) {
    if (rest.front() == '/') {
      rest.remove_prefix(1);
      continue;
    }
    const size_t slash = rest.find('/');
    parts.emplace_back(rest.substr(0, slash));
    if (slash == std::string_view::npos) break;
    rest.remove_prefix(slash);
  }
  return parts;
}

bool is_json(const std::string* content_type) {
  if (!content_type) return false;
  std::string v = content_type->substr(0, content_type->find(';'));
  while (!v.empty() && v.back() == ' ') v.pop_back();
  for (char& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
  return v == "application/json";
}

ApiError method_not_allowed(const std::string& route, const std::string& allowed, const std::string& got) {
  return ApiError::method_not_allowed(route + " takes " + allowed + ", not " + got.substr(0, 16));
}

}  // namespace

void BatchService::Impl::reply(const std::shared_ptr<server::HttpResponder>& out, const std::string& route,
                               int status, std::string body, std::string type) {
  if (server) server->metrics().on_http(route, status);
  out->send(status, std::move(type), std::move(body));
}

void BatchService::Impl::reply_error(const std::shared_ptr<server::HttpResponder>& out, const std::string& route,
                                     const ApiError& e) {
  if (server) server->metrics().on_http(route, e.status);
  out->send_error(e);
}

void BatchService::Impl::handle(const server::HttpRequest& request, std::shared_ptr<server::HttpResponder> out) {
  const bool files_route = request.target.rfind("/v1/files", 0) == 0;
  const std::string route = files_route ? "/v1/files" : "/v1/batches";
  const auto parts = split_path(request.target, route);
  const std::string& method = request.method;

  if (files_route) {
    if (parts.empty()) {
      if (method != "POST") return reply_error(out, route, method_not_allowed(route, "POST", method));
      const std::string* ct = request.header("content-type");
      auto boundary = multipart_boundary(ct ? *ct : "");
      if (!boundary.ok()) return reply_error(out, route, ApiError::unsupported_media(boundary.status().message()));
      auto form = parse_multipart(request.body, *boundary);
      if (!form.ok()) return reply_error(out, route, ApiError::invalid(form.status().message()));
      const FormPart *file = nullptr, *purpose = nullptr;
      for (const FormPart& p : *form) {
        if (p.name == "file") file = &p;
        else if (p.name == "purpose") purpose = &p;
        else return reply_error(out, route, ApiError::invalid("unknown form field \"" + p.name.substr(0, 64) + "\"", p.name.substr(0, 64)));
      }
      if (!purpose || purpose->data != "batch")
        return reply_error(out, route, ApiError::invalid("\"purpose\" must be \"batch\"", "purpose"));
      if (!file) return reply_error(out, route, ApiError::invalid("the form needs a \"file\" part", "file"));
      // The file must be a batch input we can run: refused now, not at batch time.
      auto in = parse_batch_input(file->data, file->filename.empty() ? "file" : file->filename);
      if (!in.ok()) return reply_error(out, route, ApiError::invalid(in.status().message(), "file"));
      auto f = files.create(file->data, file->filename.empty() ? "file.jsonl" : file->filename, "batch");
      if (!f.ok()) return reply_error(out, route, ApiError::internal(f.status().message()));
      return reply(out, route, 200, f->json());
    }
    if (method != "GET") return reply_error(out, route, method_not_allowed(route + "/{id}", "GET", method));
    if (parts.size() == 1) {
      auto f = file_object(parts[0]);
      if (!f.ok()) return reply_error(out, route, ApiError::not_found("No such File object: " + parts[0].substr(0, 64), "id"));
      return reply(out, route, 200, f->json());
    }
    if (parts.size() == 2 && parts[1] == "content") {
      auto path = file_path(parts[0]);
      if (!path.ok()) return reply_error(out, route, ApiError::not_found("No such File object: " + parts[0].substr(0, 64), "id"));
      auto bytes = read_file_bytes(*path);
      if (!bytes.ok()) return reply_error(out, route, ApiError::internal(bytes.status().message()));
      return reply(out, route, 200, std::move(bytes.value()), "application/octet-stream");
    }
    return reply_error(out, "other", ApiError::not_found("no route " + method + " " + request.target.substr(0, 200)));
  }

  // /v1/batches
  if (parts.empty()) {
    if (method == "GET") {
      json data = json::array();
      std::lock_guard<std::mutex> lock(mu);
      std::vector<std::shared_ptr<BatchState>> all;
      for (const auto& [id, b] : batches) all.push_back(b);
      std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
        return a->created_at != b->created_at ? a->created_at > b->created_at : a->id > b->id;
      });
      for (const auto& b : all) data.push_back(json::parse(object_json(*b)));
      json list = {{"object", "list"}, {"data", data}, {"has_more", false},
                   {"first_id", all.empty() ? json(nullptr) : json(all.front()->id)},
                   {"last_id", all.empty() ? json(nullptr) : json(all.back()->id)}};
      return reply(out, route, 200, list.dump());
    }
    if (method != "POST") return reply_error(out, route, method_not_allowed(route, "GET or POST", method));
    if (!is_json(request.header("content-type")))
      return reply_error(out, route, ApiError::unsupported_media("Content-Type must be application/json"));
    json j = json::parse(request.body, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return reply_error(out, route, ApiError::invalid("the body must be a JSON object"));
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "input_file_id" && it.key() != "endpoint" && it.key() != "completion_window" && it.key() != "metadata")
        return reply_error(out, route, ApiError::invalid("unknown field \"" + it.key().substr(0, 64) + "\"", it.key().substr(0, 64)));
    auto str = [&](const char* k) -> const std::string* {
      auto it = j.find(k);
      return it != j.end() && it->is_string() ? it->get_ptr<const std::string*>() : nullptr;
    };
    const std::string* input = str("input_file_id");
    if (!input) return reply_error(out, route, ApiError::invalid("\"input_file_id\" is required", "input_file_id"));
    if (!files.get(*input).ok())
      return reply_error(out, route, ApiError::not_found("No such File object: " + input->substr(0, 64), "input_file_id"));
    const std::string* endpoint = str("endpoint");
    if (!endpoint || (*endpoint != "/v1/chat/completions" && *endpoint != "/v1/completions"))
      return reply_error(out, route, ApiError::invalid("\"endpoint\" must be \"/v1/chat/completions\" or \"/v1/completions\"", "endpoint"));
    const std::string* window = str("completion_window");
    if (!window || *window != "24h")
      return reply_error(out, route, ApiError::invalid("\"completion_window\" must be \"24h\"", "completion_window"));
    json metadata = j.value("metadata", json(nullptr));
    if (!metadata.is_null()) {
      if (!metadata.is_object() || metadata.size() > 16)
        return reply_error(out, route, ApiError::invalid("\"metadata\" must be an object of at most 16 strings", "metadata"));
      for (auto it = metadata.begin(); it != metadata.end(); ++it)
        if (!it->is_string() || it.key().size() > 64 || it->get<std::string>().size() > 512)
          return reply_error(out, route, ApiError::invalid("\"metadata\" values must be strings (keys up to 64, values up to 512 characters)", "metadata"));
    }
    auto b = std::make_shared<BatchState>();
    b->id = "batch_" + random_hex(24);
    b->input_file_id = *input;
    b->endpoint = *endpoint;
    b->metadata = metadata;
    b->created_at = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    b->meta.created_at = b->created_at;
    b->output_file_id = derived_file_id(b->id, "output");
    b->error_file_id = derived_file_id(b->id, "errors");
    std::error_code ec;
    std::filesystem::create_directories(batch_dir(b->id), ec);
    if (ec) return reply_error(out, route, ApiError::internal("cannot create the batch's directory: " + ec.message()));
    Status st = save(*b);
    if (!st.ok()) return reply_error(out, route, ApiError::internal(st.message()));
    std::string body;
    {
      std::lock_guard<std::mutex> lock(mu);
      batches.emplace(b->id, b);
      queue.push_back(b->id);
      body = object_json(*b);
    }
    cv.notify_all();
    return reply(out, route, 200, std::move(body));
  }
  if (!valid_batch_id(parts[0]) || parts.size() > 2 || (parts.size() == 2 && parts[1] != "cancel"))
    return reply_error(out, route, ApiError::not_found("No such Batch object: " + parts[0].substr(0, 64), "batch_id"));
  std::lock_guard<std::mutex> lock(mu);
  auto it = batches.find(parts[0]);
  if (it == batches.end())
    return reply_error(out, route, ApiError::not_found("No such Batch object: " + parts[0], "batch_id"));
  BatchState& b = *it->second;
  if (parts.size() == 1) {
    if (method != "GET") return reply_error(out, route, method_not_allowed(route + "/{id}", "GET", method));
    return reply(out, route, 200, object_json(b));
  }
  if (method != "POST") return reply_error(out, route, method_not_allowed(route + "/{id}/cancel", "POST", method));
  const JobStatus s = b.meta.status;
  if (s == JobStatus::completed || s == JobStatus::failed || s == JobStatus::cancelled)
    return reply_error(out, route, ApiError::invalid(std::string("Cannot cancel a batch with status ") + job_status_name(s)));
  b.cancel = true;
  if (!b.started) {  // still queued: cancelled at once, it never runs
    std::erase(queue, b.id);
    b.meta.status = JobStatus::cancelled;
    b.meta.cancelled_at = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
    Status st = save(b);
    if (!st.ok()) return reply_error(out, route, ApiError::internal(st.message()));
  }
  cv.notify_all();  // else the worker ends it: cancelling, then cancelled
  return reply(out, route, 200, object_json(b));
}

}  // namespace cleave::jobs
