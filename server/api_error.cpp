#include "server/api_error.h"

#include <nlohmann/json.hpp>

namespace cleave::server {

std::string error_body(const ApiError& e) {
  nlohmann::json j;
  j["error"]["message"] = e.message;
  j["error"]["type"] = e.type;
  j["error"]["param"] = e.param.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.param);
  j["error"]["code"] = e.code.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.code);
  // Replace, never throw, on bytes that are not UTF-8 (a message may quote input).
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

ApiError from_status(const Status& s) {
  switch (s.code()) {
    case Code::invalid_argument:
    case Code::out_of_range:
      return ApiError::invalid(s.message());
    case Code::busy:
      return ApiError::overloaded(s.message());
    case Code::rejected:
      return ApiError::rejected(s.message());
    case Code::unavailable:
    case Code::timed_out:
      return ApiError::unavailable(s.message());
    default:
      return ApiError::internal(s.to_string());
  }
}

}  // namespace cleave::server
