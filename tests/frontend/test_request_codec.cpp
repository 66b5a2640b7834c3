// The one JSONL request / result codec: defaults, every field, typed errors
// naming the field, files with line numbers; and the fold of stream events.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "frontend/request_codec.h"

using namespace cleave;
namespace fs = std::filesystem;

namespace {

GenerateRequest parse_ok(const std::string& line, const RequestContext& ctx = {}) {
  auto r = parse_request_line(line, ctx);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r.value());
}

std::string parse_error(const std::string& line, const RequestContext& ctx = {}) {
  auto r = parse_request_line(line, ctx);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::invalid_argument);
  return r.status().message();
}

fs::path temp_file(const std::string& name, const std::string& text) {
  fs::path p = fs::temp_directory_path() / ("cleave-codec-" + std::to_string(::getpid()) + "-" + name);
  std::ofstream(p) << text;
  return p;
}

}  // namespace

TEST_CASE("request lines: defaults are SamplingParams' with max_tokens 16, the same for every command") {
  const GenerateRequest r = parse_ok(R"({"id": 7, "prompt_ids": [1, 2, 3]})");
  const SamplingParams d;
  CHECK(r.request_id == 7);
  CHECK(r.prompt == std::vector<int32_t>{1, 2, 3});
  CHECK(r.sampling.max_tokens == 16);
  CHECK(r.sampling.temperature == d.temperature);
  CHECK(r.sampling.top_k == d.top_k);
  CHECK(r.sampling.top_p == d.top_p);
  CHECK(r.sampling.min_p == d.min_p);
  CHECK(r.sampling.repeat_penalty == d.repeat_penalty);
  CHECK(r.sampling.repeat_last_n == d.repeat_last_n);
  CHECK(r.sampling.seed == 0);
  CHECK(r.sampling.stop.empty());
  CHECK(r.prefill_chunk == 512);
  CHECK_FALSE(r.ignore_eos);
}

TEST_CASE("request lines: every field is read") {
  const GenerateRequest r = parse_ok(
      R"({"id": 18446744073709551615, "prompt_ids": [0, 2147483647], "max_tokens": 5, "temperature": 0,
          "top_k": 3, "top_p": 0.5, "min_p": 0.25, "repeat_penalty": 1.5, "repeat_last_n": 9,
          "seed": 42, "stop": ["x", "yz"], "ignore_eos": true, "prefill_chunk": 7, "priority": -3,
          "ttft_target_ms": 250, "tpot_target_ms": 12.5, "deadline_ms": 1e6, "max_cost": 0.75})");
  CHECK(r.request_id == UINT64_MAX);
  CHECK(r.prompt == std::vector<int32_t>{0, 2147483647});
  CHECK(r.sampling.max_tokens == 5);
  CHECK(r.sampling.temperature == 0);
  CHECK(r.sampling.top_k == 3);
  CHECK(r.sampling.top_p == 0.5f);
  CHECK(r.sampling.min_p == 0.25f);
  CHECK(r.sampling.repeat_penalty == 1.5f);
  CHECK(r.sampling.repeat_last_n == 9);
  CHECK(r.sampling.seed == 42);
  CHECK(r.sampling.stop == std::vector<std::string>{"x", "yz"});
  CHECK(r.ignore_eos);
  CHECK(r.prefill_chunk == 7);
  CHECK(r.priority == -3);
  CHECK(r.ttft_target_ms == 250);
  CHECK(r.tpot_target_ms == 12.5);
  CHECK(r.deadline_ms == 1e6);
  CHECK(r.max_cost == 0.75);
  CHECK(parse_ok(R"({"id": 1, "prompt_ids": [1], "stop": "one"})").sampling.stop ==
        std::vector<std::string>{"one"});
}

TEST_CASE("request lines: bad input names the field, nothing is truncated or ignored") {
  struct Row {
    const char* line;
    const char* message;
  };
  for (const Row& row : {
           Row{"not json", "not JSON"},
           Row{"[1, 2]", "must be a JSON object"},
           Row{R"({"prompt_ids": [1]})", "needs \"id\""},
           Row{R"({"id": 1})", "exactly one of \"prompt\" and \"prompt_ids\""},
           Row{R"({"id": 1, "prompt": "a", "prompt_ids": [1]})", "exactly one of"},
           Row{R"({"id": 1, "prompt_ids": [1], "temprature": 0})", "unknown field \"temprature\""},
           Row{R"({"id": -1, "prompt_ids": [1]})", "\"id\" must be an unsigned integer"},
           Row{R"({"id": 1.5, "prompt_ids": [1]})", "\"id\" must be an unsigned integer"},
           Row{R"({"id": 1, "prompt_ids": [1, -2]})", "token ids"},
           Row{R"({"id": 1, "prompt_ids": [4294967296]})", "token ids"},
           Row{R"({"id": 1, "prompt_ids": "1 2"})", "\"prompt_ids\" must be a list"},
           Row{R"({"id": 1, "prompt_ids": [1], "max_tokens": 4294967312})", "\"max_tokens\" 4294967312 is above"},
           Row{R"({"id": 1, "prompt_ids": [1], "max_tokens": -1})", "\"max_tokens\" -1 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "max_tokens": 2.5})", "\"max_tokens\" must be an integer"},
           Row{R"({"id": 1, "prompt_ids": [1], "temperature": "hot"})", "\"temperature\" must be a number"},
           Row{R"({"id": 1, "prompt_ids": [1], "temperature": -0.5})", "\"temperature\" -0.5 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "top_p": 1.5})", "\"top_p\" 1.5 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "prefill_chunk": 0})", "\"prefill_chunk\" 0 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "priority": 2147483648})", "\"priority\" 2147483648 is above 2147483647"},
           Row{R"({"id": 1, "prompt_ids": [1], "ttft_target_ms": -5})", "\"ttft_target_ms\" -5 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "tpot_target_ms": "fast"})", "\"tpot_target_ms\" must be a number"},
           Row{R"({"id": 1, "prompt_ids": [1], "deadline_ms": 2e9})", "\"deadline_ms\" 2e+09 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "max_cost": -0.5})", "\"max_cost\" -0.5 is outside"},
           Row{R"({"id": 1, "prompt_ids": [1], "seed": -3})", "\"seed\" must be an unsigned integer"},
           Row{R"({"id": 1, "prompt_ids": [1], "stop": [1]})", "\"stop\" must be a list of strings"},
           Row{R"({"id": 1, "prompt_ids": [1], "ignore_eos": 1})", "\"ignore_eos\" must be true or false"},
           Row{R"({"id": 1, "prompt": "hi"})", "no tokenizer for \"prompt\""},
           Row{R"({"id": 1, "prompt": 3})", "\"prompt\" must be a string"},
           Row{R"({"id": 1, "prompt": "hi", "images": ["a.png"]})", "need a vision encoder (--mmproj)"},
       }) {
    const std::string line = row.line;
    CAPTURE(line);
    const std::string m = parse_error(line);
    CHECK_MESSAGE(m.find(row.message) != std::string::npos, m);
  }
  RequestContext with_images;
  with_images.image_tokens = 4;
  CHECK(parse_error(R"({"id": 1, "prompt_ids": [1], "images": ["a.png"]})", with_images)
            .find("need \"prompt\" text") != std::string::npos);
}

TEST_CASE("request lines: images are read through the context and placed by the prompt builder") {
  // A tokenizer-free check of the image path needs a tokenizer: the error
  // order says images are loaded only once the prompt can be built.
  RequestContext ctx;
  ctx.image_tokens = 4;
  int loads = 0;
  ctx.load_image = [&](const std::string& path) -> Result<RgbImage> {
    ++loads;
    return Status(Code::not_found, "no image '" + path + "'");
  };
  auto r = parse_request_line(R"({"id": 1, "prompt": "x", "images": ["missing.png"]})", ctx);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("no tokenizer") != std::string::npos);
  CHECK(loads == 0);
}

TEST_CASE("request files: line numbers, blank lines, duplicate ids, empty files") {
  const auto good = temp_file("good.jsonl", "{\"id\": 1, \"prompt_ids\": [1]}\n\n  \n{\"id\": 2, \"prompt_ids\": [2]}\n");
  auto rs = read_request_file(good.string(), {});
  REQUIRE_MESSAGE(rs.ok(), rs.status().to_string());
  REQUIRE(rs->size() == 2);
  CHECK((*rs)[1].request_id == 2);
  const auto dup = temp_file("dup.jsonl", "{\"id\": 1, \"prompt_ids\": [1]}\n{\"id\": 1, \"prompt_ids\": [2]}\n");
  auto d = read_request_file(dup.string(), {});
  REQUIRE_FALSE(d.ok());
  CHECK(d.status().message() == dup.string() + ":2: request id 1 appears twice");
  const auto bad = temp_file("bad.jsonl", "{\"id\": 1, \"prompt_ids\": [1]}\n\n{\"id\": 2, \"prompt_ids\": [1], \"n\": 3}\n");
  auto b = read_request_file(bad.string(), {});
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().message() == bad.string() + ":3: unknown field \"n\"");
  const auto empty = temp_file("empty.jsonl", "\n \n");
  CHECK(read_request_file(empty.string(), {}).status().code() == Code::invalid_argument);
  CHECK(read_request_file("/nonexistent/requests.jsonl", {}).status().code() == Code::io_error);
  for (const auto& p : {good, dup, bad, empty}) fs::remove(p);
}

TEST_CASE("fold_event and result_line: tokens, logits hashes, stages, encoder, exactly one end") {
  Completion c;
  msg::StreamEvent t0;
  t0.kind = msg::StreamEvent::Kind::token;
  t0.token = 5;
  t0.text = "he";
  t0.logits_hash = 0xabcdef;
  t0.origin = "prefill/0";
  t0.stage_seconds = 0.5;
  t0.encode_origin = "vision_encoder/1";
  t0.encode_seconds = 0.25;
  CHECK_FALSE(fold_event(c, t0, 1.0));
  msg::StreamEvent t1 = t0;
  t1.token = 6;
  t1.text = "llo";
  t1.logits_hash = 1;
  t1.origin = "decode/0";
  t1.encode_origin.clear();
  CHECK_FALSE(fold_event(c, t1, 2.0));
  msg::StreamEvent end;
  end.kind = msg::StreamEvent::Kind::finished;
  end.finish_reason = "length";
  end.origin = "decode/0";
  CHECK(fold_event(c, end, 3.0));
  CHECK(c.done);
  CHECK(c.tokens == std::vector<int32_t>{5, 6});
  CHECK(c.logits_hashes == std::vector<uint64_t>{0xabcdef, 1});
  CHECK(c.text == "hello");
  CHECK(c.ttft_seconds == 1.0);
  CHECK(c.total_seconds == 3.0);
  const auto j = nlohmann::json::parse(result_line(9, c));
  CHECK(j["id"] == 9);
  CHECK(j["tokens"] == std::vector<int>{5, 6});
  CHECK(j["logits_hash"] == std::vector<std::string>{"0000000000abcdef", "0000000000000001"});
  CHECK(j["finish_reason"] == "length");
  CHECK_FALSE(j.contains("error"));
  CHECK(j["stages"]["prefill/0"]["tokens"] == 1);
  CHECK(j["stages"]["decode/0"]["tokens"] == 1);
  CHECK(j["encoder"] == "vision_encoder/1");
  CHECK(j["encode_ms"] == 250.0);
  Completion f;
  msg::StreamEvent failed;
  failed.kind = msg::StreamEvent::Kind::failed;
  failed.error = Status(Code::unavailable, "no live decode actor");
  CHECK(fold_event(f, failed, 1));
  const auto jf = nlohmann::json::parse(result_line(1, f));
  CHECK(jf["error"] == f.error.to_string());
  CHECK_FALSE(jf.contains("finish_reason"));
}
