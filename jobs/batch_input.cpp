#include "jobs/batch_input.h"

#include <xxhash.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

namespace cleave::jobs {
namespace {

using json = nlohmann::json;

constexpr const char* kChatUrl = "/v1/chat/completions";
constexpr const char* kCompletionUrl = "/v1/completions";

// The line's own problems (custom_id readable): an error record.
void refuse_line(BatchLine& line, std::string message, std::string param) {
  line.valid = false;
  line.error = server::ApiError::invalid(std::move(message), std::move(param));
}

void check_fields(const json& j, BatchLine& line) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k != "custom_id" && k != "method" && k != "url" && k != "body")
      return refuse_line(line, "unknown field \"" + k.substr(0, 64) + "\" in the batch line", k.substr(0, 64));
  }
  auto method = j.find("method");
  if (method == j.end() || !method->is_string() || method->get<std::string>() != "POST")
    return refuse_line(line, "\"method\" must be \"POST\"", "method");
  auto url = j.find("url");
  if (url == j.end() || !url->is_string())
    return refuse_line(line, "\"url\" must be \"/v1/chat/completions\" or \"/v1/completions\"", "url");
  line.url = url->get<std::string>();
  if (line.url == kChatUrl) line.kind = server::RequestKind::chat;
  else if (line.url == kCompletionUrl) line.kind = server::RequestKind::completion;
  else
    return refuse_line(line, "\"url\" must be \"/v1/chat/completions\" or \"/v1/completions\", got \"" +
                                 line.url.substr(0, 64) + "\"",
                       "url");
  auto body = j.find("body");
  if (body == j.end() || !body->is_object())
    return refuse_line(line, "\"body\" must be an object (the request's JSON body)", "body");
  line.body = body->dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

std::string fingerprint_hex(std::string_view bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

std::string BatchInput::endpoint() const {
  bool chat = false, completion = false;
  for (const BatchLine& l : lines) {
    if (!l.valid) continue;
    (l.kind == server::RequestKind::chat ? chat : completion) = true;
  }
  if (chat && completion) return "mixed";
  return completion ? kCompletionUrl : kChatUrl;
}

Result<BatchInput> parse_batch_input(std::string_view bytes, const std::string& name,
                                     const BatchInputLimits& limits) {
  if (bytes.size() > limits.max_file_bytes)
    return Status(Code::invalid_argument, name + ": " + std::to_string(bytes.size()) +
                                              " bytes, above the limit of " +
                                              std::to_string(limits.max_file_bytes));
  BatchInput in;
  in.fingerprint = fingerprint_hex(bytes);
  std::unordered_map<std::string, int64_t> seen;
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < bytes.size()) {
    size_t end = bytes.find('\n', pos);
    if (end == std::string_view::npos) end = bytes.size();
    std::string_view text = bytes.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    if (text.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string where = name + ":" + std::to_string(line_no);
    if (text.size() > limits.max_line_bytes)
      return Status(Code::invalid_argument, where + ": the line has " + std::to_string(text.size()) +
                                                " bytes, above the limit of " +
                                                std::to_string(limits.max_line_bytes));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      in.errors.push_back({line_no, "the line is not a JSON object"});
      continue;
    }
    auto id = j.find("custom_id");
    if (id == j.end() || !id->is_string() || id->get<std::string>().empty()) {
      in.errors.push_back({line_no, "the line has no \"custom_id\" string"});
      continue;
    }
    BatchLine line;
    line.line_no = line_no;
    line.custom_id = id->get<std::string>();
    if (line.custom_id.size() > limits.max_custom_id_bytes || !server::is_valid_utf8(line.custom_id)) {
      in.errors.push_back({line_no, "\"custom_id\" must be UTF-8 of at most " +
                                        std::to_string(limits.max_custom_id_bytes) + " bytes"});
      continue;
    }
    auto [it, fresh] = seen.emplace(line.custom_id, line_no);
    if (!fresh)
      return Status(Code::invalid_argument, where + ": custom_id \"" + line.custom_id.substr(0, 64) +
                                                "\" was already used on line " +
                                                std::to_string(it->second) + " (custom_ids must be unique)");
    check_fields(j, line);
    in.lines.push_back(std::move(line));
  }
  return in;
}

Result<BatchInput> read_batch_input(const std::string& path, const BatchInputLimits& limits) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return Status(Code::io_error, "cannot open the batch input " + path);
  const auto size = f.tellg();
  if (size < 0) return Status(Code::io_error, "cannot read the batch input " + path);
  if (size_t(size) > limits.max_file_bytes)
    return Status(Code::invalid_argument, path + ": " + std::to_string(size_t(size)) +
                                              " bytes, above the limit of " +
                                              std::to_string(limits.max_file_bytes));
  std::string bytes(size_t(size), '\0');
  f.seekg(0);
  if (!f.read(bytes.data(), std::streamsize(bytes.size())))
    return Status(Code::io_error, "cannot read the batch input " + path);
  return parse_batch_input(bytes, path, limits);
}

}  // namespace cleave::jobs
