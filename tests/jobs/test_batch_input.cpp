// The OpenAI batch input reader: what becomes a line, an error record, an
// errors-file entry, or a refusal of the whole file.
#include <doctest/doctest.h>

#include "jobs/batch_input.h"
#include "jobs/batch_output.h"

using namespace cleave;
using namespace cleave::jobs;

namespace {

const char* kChat =
    R"({"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","content":"hi"}]}})";
const char* kCompletion = R"({"custom_id":"b","method":"POST","url":"/v1/completions","body":{"prompt":"x"}})";

}  // namespace

TEST_CASE("batch input: valid lines keep their order, kind, body and line numbers") {
  const std::string text = std::string(kChat) + "\n\n   \n" + kCompletion + "\r\n";
  auto in = parse_batch_input(text, "in.jsonl");
  REQUIRE(in.ok());
  REQUIRE(in->lines.size() == 2);
  CHECK(in->errors.empty());
  CHECK(in->lines[0].custom_id == "a");
  CHECK(in->lines[0].line_no == 1);
  CHECK(in->lines[0].kind == server::RequestKind::chat);
  CHECK(in->lines[0].valid);
  CHECK(in->lines[0].body.find("\"messages\"") != std::string::npos);
  CHECK(in->lines[1].custom_id == "b");
  CHECK(in->lines[1].line_no == 4);  // blank lines count in the numbering
  CHECK(in->lines[1].kind == server::RequestKind::completion);
  CHECK(in->endpoint() == "mixed");
  CHECK(in->fingerprint == fingerprint_hex(text));
  CHECK(in->fingerprint.size() == 32);
  CHECK(fingerprint_hex(text + " ") != in->fingerprint);
}

TEST_CASE("batch input: a line with a custom_id but wrong fields is an error record naming the field") {
  struct Case {
    const char* line;
    const char* param;
  };
  const Case cases[] = {
      {R"({"custom_id":"c","method":"GET","url":"/v1/completions","body":{}})", "method"},
      {R"({"custom_id":"c","url":"/v1/completions","body":{}})", "method"},
      {R"({"custom_id":"c","method":"POST","url":"/v1/embeddings","body":{}})", "url"},
      {R"({"custom_id":"c","method":"POST","url":7,"body":{}})", "url"},
      {R"({"custom_id":"c","method":"POST","url":"/v1/completions","body":[1]})", "body"},
      {R"({"custom_id":"c","method":"POST","url":"/v1/completions"})", "body"},
      {R"({"custom_id":"c","method":"POST","url":"/v1/completions","body":{},"extra":1})", "extra"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.line);
    auto in = parse_batch_input(c.line, "in.jsonl");
    REQUIRE(in.ok());
    REQUIRE(in->lines.size() == 1);
    CHECK_FALSE(in->lines[0].valid);
    CHECK(in->lines[0].error.status == 400);
    CHECK(in->lines[0].error.param == c.param);
    // Its output line carries the error, under its custom_id.
    const std::string out = error_line(in->fingerprint, "c", in->lines[0].error);
    CHECK(out.find("\"custom_id\":\"c\"") != std::string::npos);
    CHECK(out.find("\"status_code\":400") != std::string::npos);
    CHECK(out.back() == '\n');
  }
}

TEST_CASE("batch input: lines without a readable custom_id go to the errors list with their numbers") {
  const std::string text = std::string("{not json\n") + kChat + "\n" + R"({"method":"POST"})" + "\n" +
                           R"({"custom_id":5})" + "\n" + R"({"custom_id":""})" + "\n[1,2]\n";
  auto in = parse_batch_input(text, "in.jsonl");
  REQUIRE(in.ok());
  CHECK(in->lines.size() == 1);
  REQUIRE(in->errors.size() == 5);
  CHECK(in->errors[0].line_no == 1);
  CHECK(in->errors[1].line_no == 3);
  CHECK(in->errors[2].line_no == 4);
  CHECK(in->errors[3].line_no == 5);
  CHECK(in->errors[4].line_no == 6);
  CHECK(input_error_line(3, "no id").find("\"line\":3") != std::string::npos);
}

TEST_CASE("batch input: duplicate custom_ids refuse the whole file, naming both lines") {
  const std::string text = std::string(kChat) + "\n" + kCompletion + "\n" + kChat + "\n";
  auto in = parse_batch_input(text, "in.jsonl");
  REQUIRE_FALSE(in.ok());
  CHECK(in.status().code() == Code::invalid_argument);
  CHECK(in.status().message().find("in.jsonl:3") != std::string::npos);
  CHECK(in.status().message().find("line 1") != std::string::npos);
}

TEST_CASE("batch input: limits on the file, a line and a custom_id") {
  BatchInputLimits small;
  small.max_file_bytes = 10;
  CHECK(parse_batch_input(kChat, "in", small).status().code() == Code::invalid_argument);
  small = {};
  small.max_line_bytes = 20;
  auto in = parse_batch_input(kChat, "in", small);
  REQUIRE_FALSE(in.ok());
  CHECK(in.status().message().find("in:1") != std::string::npos);
  small = {};
  small.max_custom_id_bytes = 4;
  in = parse_batch_input(R"({"custom_id":"abcdefgh","method":"POST","url":"/v1/completions","body":{}})", "in", small);
  REQUIRE(in.ok());
  CHECK(in->lines.empty());
  CHECK(in->errors.size() == 1);
  CHECK(read_batch_input("/nonexistent/in.jsonl").status().code() == Code::io_error);
}

TEST_CASE("batch output: ids are a function of the input fingerprint and custom_id") {
  const std::string a = output_line("f1", "x", 200, "{\"ok\":1}");
  CHECK(a == output_line("f1", "x", 200, "{\"ok\":1}"));
  CHECK(line_hash("f1", "x") != line_hash("f2", "x"));
  CHECK(line_hash("f1", "x") != line_hash("f1", "y"));
  CHECK(line_hash("f1x", "") != line_hash("f1", "x"));  // the separator counts
  CHECK(a.find("\"body\":{\"ok\":1}") != std::string::npos);
}
