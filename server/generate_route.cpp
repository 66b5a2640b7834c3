// POST /v1/completions and /v1/chat/completions: one HTTP request becomes n
// runtime requests (one per choice), whose events become one JSON answer
// or an SSE stream. A client that goes away cancels every choice still
// running; a choice that fails ends the whole answer with its error.
#include <chrono>

#include "server/openai_response.h"
#include "server/server_impl.h"

namespace cleave::server {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int32_t code_points(std::string_view s) {
  int32_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

struct Choice {
  uint64_t id = 0;
  std::string text;
  std::vector<LogprobEntry> logprobs;
  std::string finish_reason;
  int32_t tokens = 0, cached = 0, text_chars = 0;
  Clock::time_point last_token;
  bool done = false;
  bool text_started = false;
};

// One HTTP generation request. Events arrive on the front end's threads;
// everything below runs under mu, and the responder keeps our write order.
struct Exchange {
  Server::Impl* srv = nullptr;
  Frontend* frontend = nullptr;  // the named model's: every choice's submit and cancel
  std::shared_ptr<HttpResponder> out;
  RequestKind kind = RequestKind::completion;
  bool stream = false, include_usage = false, has_logprobs = false;
  ResponseMeta meta;
  int32_t prompt_tokens = 0;
  Clock::time_point t0 = Clock::now();
  TokenText token_text;
  // Chat with a SentencePiece vocabulary: the reply starts a text of its
  // own, so the word piece's leading space goes, as SentencePiece's decode
  // of the reply alone would drop it. Completions continue the prompt.
  bool strip_leading_space = false;

  std::string visible(Choice& c, std::string text) {
    if (c.text_started || text.empty()) return text;
    c.text_started = true;
    if (strip_leading_space && text[0] == ' ') text.erase(0, 1);
    return text;
  }

  std::mutex mu;
  std::vector<Choice> choices;
  int32_t remaining = 0;
  bool admitted = false;  // every choice submitted: writes go out directly
  bool ended = false;     // answered (or abandoned): later events only count
  bool cancelling = false;
  bool started = false;   // the SSE status line went out
  std::vector<std::string> early;  // stream events from before admission
  ApiError error;
  bool failed = false;

  void write(std::string data) {
    if (admitted) out->write_event(std::move(data));
    else early.push_back(std::move(data));
  }

  ChoiceOutput output(const Choice& c, int32_t index) const {
    ChoiceOutput o;
    o.index = index;
    o.text = c.text;
    o.finish_reason = c.finish_reason;
    o.has_logprobs = has_logprobs;
    o.logprobs = c.logprobs;
    return o;
  }

  Usage usage() const {
    Usage u;
    u.prompt_tokens = prompt_tokens;
    for (const Choice& c : choices) u.completion_tokens += c.tokens;
    u.cached_tokens = choices.empty() ? 0 : choices[0].cached;
    return u;
  }

  std::string chunk(const ChoiceOutput& o) const {
    return kind == RequestKind::chat ? chat_chunk(meta, o, include_usage, token_text)
                                     : completion_chunk(meta, o, include_usage, token_text);
  }

  // Under mu, once admitted and every choice has ended.
  void finish_all() {
    if (ended) return;
    ended = true;
    if (failed) {
      srv->metrics.on_http(kind == RequestKind::chat ? "/v1/chat/completions" : "/v1/completions",
                           started ? 200 : error.status);
      if (started) {
        out->write_event(sse_error(error));
        out->write_event(sse_done());
        out->end_stream();
      } else {
        out->send_error(error);
      }
      return;
    }
    srv->metrics.on_http(kind == RequestKind::chat ? "/v1/chat/completions" : "/v1/completions", 200);
    if (stream) {
      if (include_usage) out->write_event(usage_chunk(meta, kind, usage()));
      out->write_event(sse_done());
      out->end_stream();
      return;
    }
    std::vector<ChoiceOutput> outs;
    for (size_t i = 0; i < choices.size(); ++i) outs.push_back(output(choices[i], int32_t(i)));
    out->send(200, "application/json",
              kind == RequestKind::chat ? chat_response(meta, outs, usage(), token_text)
                                        : completion_response(meta, outs, usage(), token_text));
  }

  // Returns the ids to cancel (outside the lock) when this event failed the
  // answer; `terminal` turns true on the choice's last event.
  std::vector<uint64_t> on_event(int32_t index, const msg::StreamEvent& e, bool& terminal) {
    std::lock_guard<std::mutex> lock(mu);
    Choice& c = choices[size_t(index)];
    if (c.done) return {};
    switch (e.kind) {
      case msg::StreamEvent::Kind::token: {
        if (c.tokens == 0) {
          const double ttft = seconds_since(t0);
          srv->metrics.on_first_token(ttft, std::max(0.0, ttft - e.stage_seconds));
          c.cached = e.cached_tokens;
        } else {
          srv->metrics.on_token(seconds_since(c.last_token));
        }
        c.last_token = Clock::now();
        ++c.tokens;
        const std::string text = visible(c, e.text);
        c.text += text;
        if (e.has_logprobs) c.logprobs.push_back(e.logprobs);
        if (stream && !ended && (!text.empty() || e.has_logprobs)) {
          ChoiceOutput o;
          o.index = index;
          o.text = text;
          o.has_logprobs = has_logprobs;
          if (e.has_logprobs) o.logprobs = {e.logprobs};
          o.text_offset = c.text_chars;
          write(chunk(o));
        }
        c.text_chars += code_points(text);
        return {};
      }
      case msg::StreamEvent::Kind::finished: {
        c.done = true;
        const std::string text = visible(c, e.text);
        c.text += text;
        c.finish_reason = e.finish_reason;
        srv->metrics.on_finish(e.finish_reason, seconds_since(t0), prompt_tokens, c.tokens, c.cached);
        if (stream && !ended) {
          ChoiceOutput o;
          o.index = index;
          o.text = text;
          o.finish_reason = e.finish_reason;
          o.has_logprobs = has_logprobs;
          o.text_offset = c.text_chars;
          write(chunk(o));
        }
        break;
      }
      case msg::StreamEvent::Kind::failed: {
        c.done = true;
        const bool abort = cancelling || e.error.code() == Code::aborted;
        srv->metrics.on_finish(abort ? "abort" : "error", seconds_since(t0), prompt_tokens, c.tokens,
                               c.cached);
        if (!ended && !cancelling && !failed) {
          failed = true;
          error = from_status(e.error);
        }
        break;
      }
    }
    terminal = true;
    --remaining;
    std::vector<uint64_t> cancel;
    if (failed && !cancelling) {
      cancelling = true;  // the other choices are of no use now
      for (const Choice& o : choices)
        if (!o.done) cancel.push_back(o.id);
    }
    if (remaining == 0 && admitted) finish_all();
    return cancel;
  }
};

}  // namespace

void Server::Impl::generate(RequestKind kind, const HttpRequest& request, std::shared_ptr<HttpResponder> out) {
  const std::string_view route = kind == RequestKind::chat ? "/v1/chat/completions" : "/v1/completions";
  auto parsed = kind == RequestKind::chat ? parse_chat_request(request.body, options.parse)
                                          : parse_completion_request(request.body, options.parse);
  if (!parsed.ok()) return reply_error(out, route, parsed.error());
  const ServedEntry* entry = find_model(parsed->model);
  if (!entry) return reply_error(out, route, unknown_model(parsed->model));
  const ServedModel& model = entry->model;
  Frontend* frontend = entry->frontend;
  const int32_t n = parsed->n;
  auto ex = std::make_shared<Exchange>();
  ex->srv = this;
  ex->frontend = frontend;
  ex->out = out;
  ex->kind = kind;
  ex->stream = parsed->stream;
  ex->include_usage = parsed->include_usage;
  ex->has_logprobs = parsed->logprobs >= 0;
  ex->token_text = [tok = model.tokenizer](int32_t t) { return tok->token_bytes(t); };
  ex->strip_leading_space = kind == RequestKind::chat && model.tokenizer->model_name() == "llama";

  PromptContext ctx;
  ctx.tokenizer = model.tokenizer.get();
  ctx.chat_template = model.chat_template;
  ctx.special_tokens = model.special_tokens;
  ctx.image_tokens = model.image_tokens;
  ctx.context = model.context;
  ctx.default_seed = random_seed();  // a request that gives no seed samples afresh
  auto built = build_generate_request(std::move(parsed.value()), ctx);
  if (!built.ok()) return reply_error(out, route, built.error());
  GenerateRequest base = std::move(built.value());
  base.prefill_chunk = model.prefill_chunk;
  ex->prompt_tokens = int32_t(base.prompt.size());
  ex->meta.id = response_id(kind, next_response.fetch_add(1));
  ex->meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  ex->meta.model = model.name;
  ex->choices.resize(size_t(n));
  ex->remaining = n;
  for (auto& c : ex->choices) c.id = next_request_id.fetch_add(1);

  // The client going away cancels whatever still runs.
  std::weak_ptr<Exchange> weak = ex;
  out->on_close([this, weak, frontend] {
    auto ex = weak.lock();
    if (!ex) return;
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(ex->mu);
      if (ex->ended || ex->cancelling) return;
      ex->cancelling = true;
      ex->ended = true;
      for (const Choice& c : ex->choices)
        if (!c.done) ids.push_back(c.id);
    }
    if (!ids.empty()) metrics.on_cancel();
    for (uint64_t id : ids) (void)frontend->cancel(id);
  });

  for (int32_t i = 0; i < n; ++i) {
    {
      // The client left while we were submitting: the rest need not run.
      std::lock_guard<std::mutex> lock(ex->mu);
      if (ex->cancelling) {
        for (int32_t k = i; k < n; ++k) ex->choices[size_t(k)].done = true;
        ex->remaining -= n - i;
        return;
      }
    }
    metrics.on_request_start();
    GenerateRequest r = base;
    r.request_id = ex->choices[size_t(i)].id;
    r.rng_stream = uint64_t(i);
    track(r.request_id, frontend);
    Status st = frontend->submit(std::move(r), [ex, i, this](const msg::StreamEvent& e) {
      bool terminal = false;
      for (uint64_t id : ex->on_event(i, e, terminal)) (void)ex->frontend->cancel(id);
      // Last: once no request is tracked, the server may be gone.
      if (terminal) untrack(ex->choices[size_t(i)].id);
    });
    if (st.ok()) continue;
    // Not admitted: this choice never gets an event; undo the ones that were.
    untrack(ex->choices[size_t(i)].id);
    metrics.on_finish("error", 0, ex->prompt_tokens, 0, 0);
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(ex->mu);
      ex->ended = true;
      ex->cancelling = true;
      ex->choices[size_t(i)].done = true;
      for (int32_t k = i + 1; k < n; ++k) ex->choices[size_t(k)].done = true;
      ex->remaining -= n - i;
      for (int32_t k = 0; k < i; ++k)
        if (!ex->choices[size_t(k)].done) ids.push_back(ex->choices[size_t(k)].id);
    }
    for (uint64_t id : ids) (void)frontend->cancel(id);
    if (st.code() == Code::busy)
      return reply_error(out, route, ApiError::overloaded("server busy: " + st.message()),
                         {{"Retry-After", "1"}});
    return reply_error(out, route, from_status(st),
                       st.code() == Code::unavailable ? HttpHeaders{{"Retry-After", "1"}} : HttpHeaders{});
  }

  std::lock_guard<std::mutex> lock(ex->mu);
  if (ex->ended) return;  // the client left meanwhile
  if (ex->stream && !ex->failed) {
    out->start_stream(200);
    ex->started = true;
    if (kind == RequestKind::chat)
      for (int32_t i = 0; i < n; ++i) out->write_event(chat_role_chunk(ex->meta, i, ex->include_usage));
    for (std::string& e : ex->early) out->write_event(std::move(e));
    ex->early.clear();
  }
  ex->admitted = true;
  if (ex->remaining == 0) ex->finish_all();
}

}  // namespace cleave::server
