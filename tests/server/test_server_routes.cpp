// The server over a real mono pipeline: /health while loading and after,
// the served model read from the committed shapes GGUF (its own chat
// template), and a request answered end to end.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "actors/pipeline.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "server/served_model.h"
#include "server/server.h"

using namespace cleave;
using namespace cleave::server;

namespace {

const std::string kShapes = std::string(CLEAVE_SOURCE_DIR) + "/models/shapes/";

// Connects to 127.0.0.1:port and sends one HTTP/1.0 request; the socket.
int send_request(int port, const std::string& method, const std::string& path, const std::string& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const std::string req = method + " " + path + " HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n" +
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  REQUIRE(::send(fd, req.data(), req.size(), 0) == ssize_t(req.size()));
  return fd;
}

// One HTTP/1.0 exchange: (status, body).
std::pair<int, std::string> http(int port, const std::string& method, const std::string& path,
                                 const std::string& body = "") {
  const int fd = send_request(port, method, path, body);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) got.append(buf, size_t(n));
  ::close(fd);
  REQUIRE(got.rfind("HTTP/1.", 0) == 0);
  const int status = std::stoi(got.substr(9, 3));
  const size_t split = got.find("\r\n\r\n");
  return {status, split == std::string::npos ? "" : got.substr(split + 4)};
}

}  // namespace

TEST_CASE("served model: the shapes GGUF carries its own chat template, recognised by its text") {
  ServedModelArgs a;
  a.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  a.mmproj = *GgufFile::open(kShapes + "shapes-mmproj-f32.gguf");
  a.tokenizer = std::move(*Tokenizer::from_gguf(*a.model));
  a.model_path = kShapes + "shapes-lm-f32.gguf";
  auto m = describe_served_model(a);
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  CHECK(m->chat_template == "shapes");
  CHECK(m->name == "shapes-lm-f32");
  CHECK(m->image_tokens == 16);
  CHECK(m->context == 128);
  // --chat-template wins; an unknown one is refused naming the known ones.
  a.chat_template = "chatml";
  CHECK(describe_served_model(a)->chat_template == "chatml");
  a.chat_template = "nope";
  auto bad = describe_served_model(a);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("shapes") != std::string::npos);
  CHECK(bad.status().message().find("llama-3") != std::string::npos);
}

TEST_CASE("server: /health is 503 with an OpenAI error while loading, then 200, a mono pipeline answers") {
  ServeOptions o;
  o.http.port = 0;
  auto srv = Server::start(o);
  REQUIRE_MESSAGE(srv.ok(), srv.status().to_string());
  const int port = (*srv)->port();
  auto [st0, body0] = http(port, "GET", "/health");
  CHECK(st0 == 503);
  auto j0 = nlohmann::json::parse(body0);
  CHECK(j0["error"]["message"] == "Loading model");
  CHECK(http(port, "GET", "/v1/models").first == 503);

  ServedModelArgs a;
  a.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  a.tokenizer = std::move(*Tokenizer::from_gguf(*a.model));
  a.model_path = kShapes + "shapes-lm-f32.gguf";
  a.name = "shapes";
  auto model = describe_served_model(a);
  REQUIRE(model.ok());
  PipelineOptions po;
  auto pipeline = Pipeline::create(a.model, a.tokenizer, po);
  REQUIRE(pipeline.ok());
  (*srv)->ready(std::move(*model), **pipeline);
  auto [st1, body1] = http(port, "GET", "/health");
  CHECK(st1 == 200);
  CHECK(nlohmann::json::parse(body1)["status"] == "ok");
  auto [st2, body2] = http(port, "POST", "/v1/completions",
                           R"({"model":"shapes","prompt":"describe","max_tokens":3,"temperature":0})");
  REQUIRE(st2 == 200);
  auto j2 = nlohmann::json::parse(body2);
  CHECK(j2["usage"]["completion_tokens"] == 3);
  CHECK(j2["choices"][0]["finish_reason"] == "length");
  // /metrics is off unless asked for.
  CHECK(http(port, "GET", "/metrics").first == 404);
  srv->reset();  // the server goes first: no route runs on a pipeline that is gone
}

namespace {

// A streamed completion read until [DONE] (or, with leave_after > 0, the
// connection closed after that many data lines): (completion tokens of the
// usage chunk, saw [DONE]).
std::pair<int, bool> stream_completion(int port, const std::string& body, int leave_after) {
  const int fd = send_request(port, "POST", "/v1/completions", body);
  std::string got;
  char buf[4096];
  int lines = 0;
  bool done = false;
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) {
    got.append(buf, size_t(n));
    lines = 0;
    for (size_t p = 0; (p = got.find("data: {", p)) != std::string::npos; ++p) ++lines;
    done = got.find("data: [DONE]") != std::string::npos;
    if (done || (leave_after > 0 && lines >= leave_after)) break;
  }
  ::close(fd);
  const size_t u = got.find("\"completion_tokens\":");
  const int tokens = u == std::string::npos ? -1 : std::atoi(got.c_str() + u + 20);
  return {tokens, done};
}

}  // namespace

TEST_CASE("server: concurrent streams over colocated actors, half of them leaving early, all accounted for") {
  ServeOptions o;
  o.http.port = 0;
  o.http.threads = 2;
  o.metrics = true;
  auto srv = Server::start(o);
  REQUIRE(srv.ok());
  ServedModelArgs a;
  a.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  a.tokenizer = std::move(*Tokenizer::from_gguf(*a.model));
  a.model_path = kShapes + "shapes-lm-f32.gguf";
  auto model = describe_served_model(a);
  REQUIRE(model.ok());
  PipelineOptions po;
  po.topology = Topology::colocated;
  po.colocated_actors = 2;
  po.engine.max_seqs = 8;
  auto pipeline = Pipeline::create(a.model, a.tokenizer, po);
  REQUIRE(pipeline.ok());
  (*srv)->ready(std::move(*model), **pipeline);
  const int port = (*srv)->port();

  constexpr int kClients = 24;
  const std::string body =
      R"({"prompt":"describe","max_tokens":60,"temperature":0.7,"seed":3,"ignore_eos":true,"stream":true,"n":2,)"
      R"("stream_options":{"include_usage":true}})";
  std::vector<std::pair<int, bool>> got(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] { got[size_t(i)] = stream_completion(port, body, i % 2 ? 3 : 0); });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kClients; i += 2) {
    CAPTURE(i);
    CHECK(got[size_t(i)].second);                 // stayed: [DONE]
    CHECK(got[size_t(i)].first == 2 * 60);        // the usage chunk: 60 tokens per choice
  }
  // Those that left were cancelled: nothing keeps running, no KV is held.
  uint64_t running = 1, used = 1, cancelled = 0;
  for (int k = 0; k < 200 && (running || used || cancelled < kClients / 2); ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    running = used = 0;
    for (const auto& s : (*pipeline)->stats()) {
      running += s.get("running") + s.get("queue_depth") * (s.actor != "router");
      used += s.get("kv_blocks_used");
      if (s.actor == "router") cancelled = s.get("cancelled");
    }
  }
  CHECK(running == 0);
  CHECK(used == 0);
  // Each client that left had two choices; a choice may have finished before the cancel came.
  CHECK(cancelled >= uint64_t(kClients / 2));
  CHECK(cancelled <= uint64_t(kClients));
  srv->reset();
}

namespace {

ServedModelArgs shapes_lm() {
  ServedModelArgs a;
  a.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  a.tokenizer = std::move(*Tokenizer::from_gguf(*a.model));
  a.model_path = kShapes + "shapes-lm-f32.gguf";
  return a;
}

// The shapes LM served over HTTP (an ephemeral port, /metrics on) by a
// pipeline of `po`; the server stops before the pipeline goes.
struct ServedShapes {
  ServedModelArgs args = shapes_lm();
  std::unique_ptr<Pipeline> pipeline;
  std::unique_ptr<Server> server;
  int port = 0;
};

std::unique_ptr<ServedShapes> serve_shapes(const PipelineOptions& po) {
  auto s = std::make_unique<ServedShapes>();
  ServeOptions o;
  o.http.port = 0;
  o.metrics = true;
  auto srv = Server::start(o);
  REQUIRE(srv.ok());
  auto pipeline = Pipeline::create(s->args.model, s->args.tokenizer, po);
  REQUIRE(pipeline.ok());
  s->pipeline = std::move(*pipeline);
  s->server = std::move(*srv);
  s->server->ready(*describe_served_model(s->args), *s->pipeline);
  s->port = s->server->port();
  return s;
}

// A greedy 4-token completion of the shapes prompt with `field` added.
std::string shapes_body(const std::string& field) {
  return R"({"prompt":"how many shapes","max_tokens":4,"temperature":0,"ignore_eos":true,)" + field + "}";
}

}  // namespace

TEST_CASE("server: \"priority\" is refused under fcfs and, under the priority policy, runs ahead of a busy stream") {
  ServedModelArgs a;
  a.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  a.tokenizer = std::move(*Tokenizer::from_gguf(*a.model));
  a.model_path = kShapes + "shapes-lm-f32.gguf";
  const std::string high = R"({"prompt":"how many shapes","max_tokens":4,"temperature":0,"ignore_eos":true,"priority":-2})";
  for (Topology topology : {Topology::mono, Topology::colocated}) {  // fcfs
    CAPTURE(int(topology));
    ServeOptions o;
    o.http.port = 0;
    auto srv = Server::start(o);
    REQUIRE(srv.ok());
    PipelineOptions po;
    po.topology = topology;
    auto pipeline = Pipeline::create(a.model, a.tokenizer, po);
    REQUIRE(pipeline.ok());
    (*srv)->ready(*describe_served_model(a), **pipeline);
    auto [status, body] = http((*srv)->port(), "POST", "/v1/completions", high);
    CHECK(status == 400);
    CHECK(body.find("priority -2") != std::string::npos);
    CHECK(body.find("--scheduling-policy priority") != std::string::npos);
    auto [bad, bad_body] = http((*srv)->port(), "POST", "/v1/completions",
                                R"({"prompt":"x","priority":1.5})");
    CHECK(bad == 400);
    CHECK(bad_body.find("priority") != std::string::npos);
    srv->reset();
  }

  ServeOptions o;
  o.http.port = 0;
  o.http.threads = 2;
  auto srv = Server::start(o);
  REQUIRE(srv.ok());
  PipelineOptions po;
  po.topology = Topology::colocated;
  po.engine.max_seqs = 1;  // one sequence at a time: the order is the scheduler's
  po.scheduler.policy = SchedulingPolicy::priority;
  auto pipeline = Pipeline::create(a.model, a.tokenizer, po);
  REQUIRE(pipeline.ok());
  (*srv)->ready(*describe_served_model(a), **pipeline);
  const int port = (*srv)->port();
  // 16 choices of 100 tokens at priority 5 run one after another.
  std::atomic<bool> first_chunk{false};
  std::chrono::steady_clock::time_point low_done;
  std::thread low([&] {
    const int fd = send_request(port, "POST", "/v1/completions",
                                R"({"prompt":"describe","max_tokens":100,"temperature":0,"ignore_eos":true,)"
                                R"("stream":true,"n":16,"priority":5})");
    std::string got;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) {
      got.append(buf, size_t(n));
      if (got.find("data: {") != std::string::npos) first_chunk = true;
      if (got.find("data: [DONE]") != std::string::npos) break;
    }
    ::close(fd);
    low_done = std::chrono::steady_clock::now();
  });
  while (!first_chunk) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto [status, body] = http(port, "POST", "/v1/completions", high);
  const auto high_done = std::chrono::steady_clock::now();
  low.join();
  CHECK(status == 200);
  CHECK(nlohmann::json::parse(body)["usage"]["completion_tokens"] == 4);
  CHECK(high_done < low_done);  // fcfs would run it after all 16 choices
  uint64_t preempted = 0;
  for (const auto& s : (*pipeline)->stats()) preempted += s.get("preempted_for_priority");
  CHECK(preempted == 1);  // the running choice made room, and only once
  srv->reset();
}

TEST_CASE("server: a TTFT, TPOT or deadline goal that cannot be met is refused at once with 429") {
  auto body_with = shapes_body;
  // mono predicts in the pipeline's own loop, colocated and pd in the router.
  for (Topology topology : {Topology::mono, Topology::colocated, Topology::pd}) {
    CAPTURE(int(topology));
    PipelineOptions po;
    po.topology = topology;
    auto served = serve_shapes(po);
    auto& pipeline = served->pipeline;
    const int port = served->port;
    // Cold: nothing measured yet, so nothing is predicted and the goal is not checked.
    auto [cold, cold_body] = http(port, "POST", "/v1/completions", body_with(R"("ttft_target_ms":0.001)"));
    CHECK(cold == 200);
    // Now a prefill and the token gaps are measured: no request of these
    // lengths makes its first token in 1 us, or a token per 1 us.
    auto [t, t_body] = http(port, "POST", "/v1/completions", body_with(R"("ttft_target_ms":0.001)"));
    CHECK(t == 429);
    CHECK(t_body.find("slo_unattainable") != std::string::npos);
    CHECK(t_body.find("ttft_target_ms 0.001: predicted TTFT") != std::string::npos);
    auto [p, p_body] = http(port, "POST", "/v1/completions", body_with(R"("tpot_target_ms":0.001)"));
    CHECK(p == 429);
    CHECK(p_body.find("tpot_target_ms 0.001") != std::string::npos);
    auto [d, d_body] = http(port, "POST", "/v1/chat/completions",
                            R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"deadline_ms":0.002})");
    CHECK(d == 429);
    CHECK(d_body.find("deadline_ms 0.002") != std::string::npos);
    // Goals that can be met: served.
    auto [ok, ok_body] = http(port, "POST", "/v1/completions",
                              body_with(R"("ttft_target_ms":600000,"tpot_target_ms":60000,"deadline_ms":1e9)"));
    CHECK(ok == 200);
    CHECK(nlohmann::json::parse(ok_body)["usage"]["completion_tokens"] == 4);
    // Bad goals are the client's error.
    for (const char* bad : {R"("ttft_target_ms":-1)", R"("tpot_target_ms":"soon")", R"("deadline_ms":2e9)"}) {
      CAPTURE(bad);
      auto [b, b_body] = http(port, "POST", "/v1/completions", body_with(bad));
      CHECK(b == 400);
    }
    uint64_t rejected = 0;
    for (const auto& s : pipeline->stats()) rejected += s.get("rejected_slo");
    CHECK(rejected == 3);
    auto [m, metrics] = http(port, "GET", "/metrics");
    CHECK(metrics.find("cleave_requests_rejected_slo_total 3") != std::string::npos);
    served.reset();
  }
}

TEST_CASE("server: a max_cost under the cheapest prediction is refused with 429, and only cost_aware takes one") {
  auto body_with = shapes_body;
  struct Case {
    Topology topology;
    const char* policy;  // "" : the default router (or none: mono)
  };
  for (const Case& c : {Case{Topology::mono, ""}, Case{Topology::colocated, ""}, Case{Topology::pd, ""},
                        Case{Topology::colocated, "cost_aware"}, Case{Topology::pd, "cost_aware"}}) {
    CAPTURE(int(c.topology));
    CAPTURE(c.policy);
    PipelineOptions po;
    po.topology = c.topology;
    if (*c.policy) po.placement.policy = c.policy;
    auto served = serve_shapes(po);
    const int port = served->port;
    if (!*c.policy) {
      // No router, or one that does not read costs: the budget is refused, named.
      auto [b, b_body] = http(port, "POST", "/v1/completions", body_with(R"("max_cost":5)"));
      CHECK(b == 400);
      CHECK(b_body.find("max_cost: a cost budget needs router policy 'cost_aware'") != std::string::npos);
      auto [ok, ok_body] = http(port, "POST", "/v1/completions", body_with(R"("max_cost":0)"));
      CHECK(ok == 200);  // 0 is no budget
      continue;
    }
    // Cold: nothing measured, nothing predicted: admitted.
    auto [cold, cold_body] = http(port, "POST", "/v1/completions", body_with(R"("max_cost":1e-9)"));
    CHECK(cold == 200);
    // Measured now: no stage prefills and decodes this in a nanosecond.
    auto [t, t_body] = http(port, "POST", "/v1/completions", body_with(R"("max_cost":1e-9)"));
    CHECK(t == 429);
    CHECK(t_body.find("slo_unattainable") != std::string::npos);
    CHECK(t_body.find("cannot meet its max_cost 1e-09: the cheapest prediction is") != std::string::npos);
    CHECK(t_body.find("+ decode of 3 tokens") != std::string::npos);
    // A budget of a cost-hour: served, with the tokens asked for.
    auto [ok, ok_body] = http(port, "POST", "/v1/chat/completions",
                              R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"ignore_eos":true,"max_cost":3600})");
    CHECK(ok == 200);
    CHECK(nlohmann::json::parse(ok_body)["usage"]["completion_tokens"] == 4);
    for (const char* bad : {R"("max_cost":-1)", R"("max_cost":"cheap")", R"("max_cost":2e9)"}) {
      CAPTURE(bad);
      auto [b, b_body] = http(port, "POST", "/v1/completions", body_with(bad));
      CHECK(b == 400);
      CHECK(b_body.find("max_cost") != std::string::npos);
    }
    uint64_t rejected = 0, rejected_slo = 0;
    for (const auto& s : served->pipeline->stats())
      rejected += s.get("rejected_cost"), rejected_slo += s.get("rejected_slo");
    CHECK(rejected == 1);
    CHECK(rejected_slo == 0);
    auto [m, metrics] = http(port, "GET", "/metrics");
    CHECK(metrics.find("cleave_requests_rejected_cost_total 1") != std::string::npos);
  }
}

namespace {

// A front end that records what reached it: each request is answered at
// once with one token (its label, so a response shows who ran it) and
// "length", or with hold, kept until end_held() (cancel only records).
// The submit after refuse_after admitted ones is refused busy.
class RecordingFrontend : public Frontend {
 public:
  explicit RecordingFrontend(std::string label) : label_(std::move(label)) {}
  std::atomic<bool> hold{false};
  std::atomic<size_t> refuse_after{SIZE_MAX};

  Status submit(GenerateRequest request, EventCallback on_event) override {
    const uint64_t id = request.request_id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (submitted_.size() == refuse_after) return Status(Code::busy, "full");
      submitted_.push_back(std::move(request));
      if (hold) {
        held_.emplace_back(id, std::move(on_event));
        return Status::Ok();
      }
    }
    msg::StreamEvent t;
    t.request_id = id;
    t.token = 0;
    t.text = label_;
    on_event(t);
    msg::StreamEvent f;
    f.kind = msg::StreamEvent::Kind::finished;
    f.request_id = id;
    f.index = 1;
    f.finish_reason = "length";
    on_event(f);
    return Status::Ok();
  }
  Status cancel(uint64_t request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_.push_back(request_id);
    cv_.notify_all();
    return Status::Ok();
  }
  Status resume(GenerateRequest, std::vector<int32_t>, EventCallback) override {
    return Status(Code::unsupported, "fake");
  }
  std::vector<msg::Stats> stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_calls_;
    return {msg::Stats{label_, {{"submitted", submitted_.size()}}}};
  }

  // Fails the held request `id` with `error`.
  void fail_held(uint64_t id, Status error) {
    EventCallback cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = held_.begin(); it != held_.end(); ++it)
        if (it->first == id) {
          cb = std::move(it->second);
          held_.erase(it);
          break;
        }
    }
    REQUIRE(cb);
    msg::StreamEvent e;
    e.kind = msg::StreamEvent::Kind::failed;
    e.request_id = id;
    e.error = std::move(error);
    cb(e);
  }
  // Ends every held request as a cancel would (failed, aborted).
  void end_held() {
    std::vector<std::pair<uint64_t, EventCallback>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.swap(held_);
    }
    for (auto& [id, cb] : held) {
      msg::StreamEvent e;
      e.kind = msg::StreamEvent::Kind::failed;
      e.request_id = id;
      e.error = Status(Code::aborted, "cancelled");
      cb(e);
    }
  }
  // Waits up to `wait` for at least n cancels; the ids cancelled.
  std::vector<uint64_t> cancelled(size_t n = 0, std::chrono::milliseconds wait = {}) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, wait, [&] { return cancelled_.size() >= n; });
    return cancelled_;
  }
  std::vector<GenerateRequest> submitted() {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }
  int stats_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_calls_;
  }

 private:
  const std::string label_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<GenerateRequest> submitted_;
  std::vector<std::pair<uint64_t, EventCallback>> held_;
  std::vector<uint64_t> cancelled_;
  int stats_calls_ = 0;
};

}  // namespace

TEST_CASE("server: several models, each through its own front end, chosen by \"model\"") {
  ServeOptions o;
  o.http.port = 0;
  o.metrics = true;
  auto srv = Server::start(o);
  REQUIRE(srv.ok());
  // "a": the shapes model (its own template, which refuses system
  // messages); "b": GPT-2's vocabulary, chatml, another context and chunk;
  // "c": a's front end again.
  ServedModelArgs args;
  args.model = *GgufFile::open(kShapes + "shapes-lm-f32.gguf");
  args.tokenizer = std::move(*Tokenizer::from_gguf(*args.model));
  args.model_path = kShapes + "shapes-lm-f32.gguf";
  args.name = "a";
  auto a = describe_served_model(args);
  REQUIRE(a.ok());
  a->prefill_chunk = 32;
  auto gpt2 = GgufFile::open(std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-gpt-2.gguf");
  REQUIRE(gpt2.ok());
  std::shared_ptr<const Tokenizer> tok_b = std::move(*Tokenizer::from_gguf(**gpt2));
  ServedModel b;
  b.name = "b";
  b.context = 1000;
  b.n_vocab = tok_b->n_vocab();
  b.tokenizer = tok_b;
  b.chat_template = "chatml";
  b.prefill_chunk = 64;
  ServedModel c = *a;
  c.name = "c";
  const std::shared_ptr<const Tokenizer> tok_a = a->tokenizer;
  const int32_t context_a = a->context;
  RecordingFrontend fa("fake-a"), fb("fake-b");
  (*srv)->ready({{std::move(*a), &fa}, {std::move(b), &fb}, {std::move(c), &fa}});
  const int port = (*srv)->port();
  const std::string prompt = "how many shapes";
  REQUIRE(tok_a->encode(prompt, true) != tok_b->encode(prompt, true));  // the tokenizers tell apart

  // Each name reaches its own front end, with its tokenizer, context and chunk.
  auto [st_b, body_b] = http(port, "POST", "/v1/completions", R"({"model":"b","prompt":")" + prompt + "\"}");
  REQUIRE(st_b == 200);
  auto jb = nlohmann::json::parse(body_b);
  CHECK(jb["model"] == "b");
  CHECK(jb["choices"][0]["text"] == "fake-b");
  CHECK(fa.submitted().empty());
  REQUIRE(fb.submitted().size() == 1);
  const GenerateRequest rb = fb.submitted()[0];
  CHECK(rb.prompt == tok_b->encode(prompt, true));
  CHECK(rb.prefill_chunk == 64);
  CHECK(rb.sampling.max_tokens == 16);  // completions' default
  // No model: the first entry.
  auto [st_d, body_d] = http(port, "POST", "/v1/completions", R"({"prompt":")" + prompt + "\"}");
  REQUIRE(st_d == 200);
  auto jd = nlohmann::json::parse(body_d);
  CHECK(jd["model"] == "a");
  CHECK(jd["choices"][0]["text"] == "fake-a");
  REQUIRE(fa.submitted().size() == 1);
  CHECK(fa.submitted()[0].prompt == tok_a->encode(prompt, true));
  CHECK(fa.submitted()[0].prefill_chunk == 32);
  CHECK(fb.submitted().size() == 1);
  // "c" shares a's front end but answers as itself.
  auto [st_c, body_c] = http(port, "POST", "/v1/completions", R"({"model":"c","prompt":"x"})");
  REQUIRE(st_c == 200);
  CHECK(nlohmann::json::parse(body_c)["model"] == "c");
  CHECK(fa.submitted().size() == 2);
  // Chat: b's template takes a system message (a's refuses it), and the
  // default max_tokens fills b's context, not a's.
  const std::string chat =
      R"({"model":"b","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]})";
  auto [st_chat, body_chat] = http(port, "POST", "/v1/chat/completions", chat);
  REQUIRE_MESSAGE(st_chat == 200, body_chat);
  CHECK(nlohmann::json::parse(body_chat)["model"] == "b");
  REQUIRE(fb.submitted().size() == 2);
  const GenerateRequest chat_b = fb.submitted()[1];
  CHECK(chat_b.sampling.max_tokens == 1000 - int32_t(chat_b.prompt.size()));
  CHECK(chat_b.sampling.max_tokens > context_a);
  CHECK(http(port, "POST", "/v1/chat/completions",
             R"({"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]})")
            .first == 400);
  // An unknown name: 404 model_not_found on both routes, nothing submitted.
  for (const auto& [route, body] : std::vector<std::pair<std::string, std::string>>{
           {"/v1/completions", R"({"model":"nope","prompt":"x"})"},
           {"/v1/chat/completions", R"({"model":"nope","messages":[{"role":"user","content":"x"}]})"}}) {
    CAPTURE(route);
    auto [st, got] = http(port, "POST", route, body);
    CHECK(st == 404);
    auto j = nlohmann::json::parse(got);
    CHECK(j["error"]["code"] == "model_not_found");
    CHECK(j["error"]["message"] == "The model `nope` does not exist.");
  }
  CHECK(fa.submitted().size() == 2);
  CHECK(fb.submitted().size() == 2);

  // /v1/models: every entry, in order, with its own context.
  auto [st_m, body_m] = http(port, "GET", "/v1/models");
  REQUIRE(st_m == 200);
  auto jm = nlohmann::json::parse(body_m);
  REQUIRE(jm["data"].size() == 3);
  CHECK(jm["data"][0]["id"] == "a");
  CHECK(jm["data"][1]["id"] == "b");
  CHECK(jm["data"][2]["id"] == "c");
  CHECK(jm["data"][0]["max_model_len"] == context_a);
  CHECK(jm["data"][1]["max_model_len"] == 1000);

  // /tokenize and /detokenize: "model" picks the tokenizer; none: a's.
  auto tokens_of = [&](const std::string& body) {
    auto [st, got] = http(port, "POST", "/tokenize", body);
    REQUIRE_MESSAGE(st == 200, got);
    return nlohmann::json::parse(got)["tokens"].get<std::vector<int32_t>>();
  };
  const std::string content = R"("content":"hello world","add_special":true)";
  CHECK(tokens_of("{" + content + R"(,"model":"b"})") == tok_b->encode("hello world", true));
  CHECK(tokens_of("{" + content + "}") == tok_a->encode("hello world", true));
  CHECK(tokens_of("{" + content + R"(,"model":"a"})") == tok_a->encode("hello world", true));
  auto [st_t, body_t] = http(port, "POST", "/tokenize", "{" + content + R"(,"model":"nope"})");
  CHECK(st_t == 404);
  CHECK(nlohmann::json::parse(body_t)["error"]["code"] == "model_not_found");
  CHECK(http(port, "POST", "/tokenize", "{" + content + R"(,"model":5})").first == 400);
  // An id only b's vocabulary has: b decodes it, a refuses it.
  const int32_t big = tok_b->n_vocab() - 1;
  REQUIRE(big >= tok_a->n_vocab());
  const std::string ids = R"("tokens":[)" + std::to_string(big) + "]";
  auto [st_db, body_db] = http(port, "POST", "/detokenize", "{" + ids + R"(,"model":"b"})");
  REQUIRE_MESSAGE(st_db == 200, body_db);
  CHECK(nlohmann::json::parse(body_db)["content"] == tok_b->decode({big}));
  CHECK(http(port, "POST", "/detokenize", "{" + ids + "}").first == 400);
  auto [st_dn, body_dn] = http(port, "POST", "/detokenize", "{" + ids + R"(,"model":"nope"})");
  CHECK(st_dn == 404);
  CHECK(nlohmann::json::parse(body_dn)["error"]["code"] == "model_not_found");

  // /metrics: both front ends' stats, a's asked once though two entries share it.
  auto [st_x, metrics] = http(port, "GET", "/metrics");
  REQUIRE(st_x == 200);
  CHECK(metrics.find(R"(cleave_actor_stat{actor="fake-a",name="submitted"} 2)") != std::string::npos);
  CHECK(metrics.find(R"(cleave_actor_stat{actor="fake-b",name="submitted"} 2)") != std::string::npos);
  CHECK(fa.stats_calls() == 1);
  CHECK(fb.stats_calls() == 1);

  // Cancels go to the front end that took the request. A choice of b's
  // that fails cancels its sibling there.
  fb.hold = true;
  auto wait_submitted = [&](size_t n) {
    for (int k = 0; k < 500 && fb.submitted().size() < n; ++k)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    REQUIRE(fb.submitted().size() == n);
  };
  const int two = send_request(port, "POST", "/v1/completions", R"({"model":"b","prompt":"x","n":2})");
  wait_submitted(4);
  const uint64_t first = fb.submitted()[2].request_id, second = fb.submitted()[3].request_id;
  fb.fail_held(first, Status(Code::invalid_argument, "bad"));
  CHECK(fb.cancelled(1, std::chrono::seconds(5)) == std::vector<uint64_t>{second});
  fb.end_held();
  std::string answer;
  char buf[4096];
  for (ssize_t n; (n = ::recv(two, buf, sizeof buf, 0)) > 0;) answer.append(buf, size_t(n));
  ::close(two);
  CHECK(answer.substr(0, 12) == "HTTP/1.0 400");  // the failed choice's error
  // A choice b refuses at admission cancels the ones b took before it.
  fb.refuse_after = 5;
  auto [busy, busy_body] = http(port, "POST", "/v1/completions", R"({"model":"b","prompt":"x","n":2})");
  CHECK(busy == 503);
  REQUIRE(fb.submitted().size() == 5);
  const uint64_t admitted = fb.submitted()[4].request_id;
  CHECK(fb.cancelled() == std::vector<uint64_t>{second, admitted});
  fb.end_held();
  fb.refuse_after = SIZE_MAX;
  // A request b still runs when the server goes: cancelled when its
  // connection closes, then by the destructor (fb ends it only on end_held()).
  const int fd = send_request(port, "POST", "/v1/completions", R"({"model":"b","prompt":"x"})");
  wait_submitted(6);
  const uint64_t held_id = fb.submitted()[5].request_id;
  std::thread ender([&] {
    fb.cancelled(4, std::chrono::seconds(5));
    fb.end_held();
  });
  srv->reset();
  ender.join();
  ::close(fd);
  CHECK(fa.cancelled().empty());
  CHECK(fb.cancelled() == std::vector<uint64_t>{second, admitted, held_id, held_id});
}
