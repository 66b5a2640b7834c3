// OpenAI batch output lines:
//   {"id": "batch_req_<16 hex>", "custom_id": ID,
//    "response": {"status_code": N, "request_id": "req_<16 hex>", "body": {...}},
//    "error": null}
// The body is the completion / chat object for status 200, else OpenAI's
// {"error": {...}}. Ids are derived from (input fingerprint, custom_id), so
// a line written again after a kill has the same ids.
#pragma once

#include <cstdint>
#include <string>

#include "server/api_error.h"

namespace cleave::jobs {

// XXH3-64 over fingerprint, a 0 byte, custom_id.
uint64_t line_hash(const std::string& fingerprint, const std::string& custom_id);

// One output line (ends in '\n'). `body_json` is the JSON text of the body.
std::string output_line(const std::string& fingerprint, const std::string& custom_id, int status_code,
                        const std::string& body_json);
std::string error_line(const std::string& fingerprint, const std::string& custom_id,
                       const server::ApiError& error);

// One entry of the input errors file (ends in '\n').
std::string input_error_line(int64_t line_no, const std::string& message);

}  // namespace cleave::jobs
