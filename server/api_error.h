// An OpenAI-style API error: the HTTP status and the body
// {"error":{"message","type","param","code"}}. Every layer of the server
// (transport, request parsing, routes) reports failures as one of these, so
// a client always gets the same shape, never a 5xx for bad input.
#pragma once

#include <string>

#include "common/status.h"

namespace cleave::server {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";  // OpenAI's: invalid_request_error,
                                               // authentication_error, not_found_error, ...
  std::string param;  // the request field at fault; empty: null
  std::string code;   // e.g. "context_length_exceeded", "invalid_api_key"; empty: null

  static ApiError invalid(std::string message, std::string param = {}, std::string code = {}) {
    return {400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
  }
  static ApiError unauthorized(std::string message) {
    return {401, std::move(message), "authentication_error", {}, "invalid_api_key"};
  }
  static ApiError not_found(std::string message, std::string param = {}) {
    return {404, std::move(message), "not_found_error", std::move(param), {}};
  }
  static ApiError method_not_allowed(std::string message) {
    return {405, std::move(message), "invalid_request_error", {}, "method_not_allowed"};
  }
  static ApiError too_large(std::string message) {
    return {413, std::move(message), "invalid_request_error", {}, "request_too_large"};
  }
  static ApiError unsupported_media(std::string message) {
    return {415, std::move(message), "invalid_request_error", {}, "unsupported_media_type"};
  }
  static ApiError overloaded(std::string message) {  // admission full: 503 + Retry-After
    return {503, std::move(message), "server_overloaded", {}, "server_busy"};
  }
  static ApiError rejected(std::string message) {  // its goals cannot be met: 429, no retry hint
    return {429, std::move(message), "rate_limit_error", {}, "slo_unattainable"};
  }
  static ApiError unavailable(std::string message) {  // loading, no live stage
    return {503, std::move(message), "service_unavailable", {}, "service_unavailable"};
  }
  static ApiError internal(std::string message) {  // an engine fault, never bad input
    return {500, std::move(message), "internal_error", {}, {}};
  }
};

// {"error":{"message":...,"type":...,"param":...|null,"code":...|null}}
std::string error_body(const ApiError& e);

// A Status from the front end / engine as the client should see it:
// invalid_argument / out_of_range -> 400, busy -> 503 overloaded, rejected
// (a deadline or TTFT / TPOT target that cannot be met) -> 429,
// unavailable -> 503, timed_out -> 504-free 503, everything else -> 500
// (an engine or transport fault: never the answer to bad input).
ApiError from_status(const Status& s);

}  // namespace cleave::server
