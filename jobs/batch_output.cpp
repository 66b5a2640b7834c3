#include "jobs/batch_output.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "storage/block.h"

namespace cleave::jobs {
namespace {

using json = nlohmann::json;

std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

uint64_t line_hash(const std::string& fingerprint, const std::string& custom_id) {
  std::string key = fingerprint;
  key.push_back('\0');
  key += custom_id;
  return checksum_bytes(reinterpret_cast<const uint8_t*>(key.data()), key.size());
}

std::string output_line(const std::string& fingerprint, const std::string& custom_id, int status_code,
                        const std::string& body_json) {
  const std::string h = hex16(line_hash(fingerprint, custom_id));
  json body = json::parse(body_json, nullptr, /*allow_exceptions=*/false);
  json line = {{"id", "batch_req_" + h},
               {"custom_id", custom_id},
               {"response", {{"status_code", status_code}, {"request_id", "req_" + h}, {"body", body}}},
               {"error", nullptr}};
  return line.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string error_line(const std::string& fingerprint, const std::string& custom_id,
                       const server::ApiError& error) {
  return output_line(fingerprint, custom_id, error.status, server::error_body(error));
}

std::string input_error_line(int64_t line_no, const std::string& message) {
  json e = {{"line", line_no},
            {"error", {{"message", message}, {"type", "invalid_request_error"}, {"code", "invalid_batch_line"}}}};
  return e.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace cleave::jobs
