// RequestProgress on hand-made logits (finish rules in generate()'s order,
// text held back for stop strings and split UTF-8, replay), validate_request's
// typed errors, and generate() against the single-request loop it had before
// it was built on RequestProgress (tokens, text, logits bit for bit).
#include <doctest/doctest.h>

#include <chrono>
#include <functional>

#include "model/generate.h"
#include "model/request.h"
#include "model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

constexpr int32_t kVocab = 32000;

// Logits whose greedy pick is `token`.
std::vector<float> peak_at(int32_t token) {
  std::vector<float> l(kVocab, 0.f);
  l[size_t(token)] = 10.f;
  return l;
}

GenerateRequest greedy_request(int max_tokens) {
  GenerateRequest r;
  r.prompt = {1, 450};
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  return r;
}

// Drives p with logits peaking at each token in turn; returns the streamed text.
std::string feed(RequestProgress& p, const std::vector<int32_t>& tokens) {
  std::string text;
  for (int32_t t : tokens) {
    if (p.finished()) break;
    CHECK(p.step(peak_at(t).data()) == t);
    text += p.take_text();
  }
  return text;
}

// " The cat sat on the mat. END of story" in the llama SPM vocabulary.
const std::vector<int32_t> kStory = {450, 6635, 3290, 373, 278, 1775, 29889, 11056, 310, 5828};

}  // namespace

TEST_CASE("request: validate_request gives typed errors naming the problem") {
  GenerateRequest r = greedy_request(4);
  CHECK(validate_request(r, 64, kVocab).ok());
  GenerateRequest empty = r;
  empty.prompt.clear();
  CHECK(validate_request(empty, 64, kVocab).code() == Code::invalid_argument);
  GenerateRequest long_prompt = r;
  long_prompt.prompt = prompt_of(65, 1);
  Status st = validate_request(long_prompt, 64, kVocab);
  CHECK(st.code() == Code::out_of_range);
  CHECK(st.message().find("65") != std::string::npos);
  CHECK(st.message().find("64") != std::string::npos);
  GenerateRequest bad_token = r;
  bad_token.prompt = {1, 5, kVocab};
  st = validate_request(bad_token, 64, kVocab);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("32000") != std::string::npos);
  bad_token.prompt = {-3};
  CHECK(validate_request(bad_token, 64, kVocab).message().find("-3") != std::string::npos);
  GenerateRequest chunk = r;
  chunk.prefill_chunk = 0;
  CHECK(validate_request(chunk, 64, kVocab).message().find("chunk") != std::string::npos);
  GenerateRequest negative = r;
  negative.sampling.max_tokens = -1;
  CHECK(validate_request(negative, 64, kVocab).message().find("max tokens") != std::string::npos);
}

TEST_CASE("request: max_tokens, keep_logits and the context limit") {
  GenerateRequest r = greedy_request(3);
  r.keep_logits = true;
  RequestProgress p(r, nullptr, 64, kVocab);
  CHECK_FALSE(p.finished());
  feed(p, {7, 8, 9, 10});
  CHECK(p.generated() == std::vector<int32_t>{7, 8, 9});
  CHECK(p.history() == std::vector<int32_t>{1, 450, 7, 8, 9});
  CHECK(p.finish_reason() == "length");
  CHECK(p.logits().size() == 3 * size_t(kVocab));
  CHECK(p.logits()[2 * size_t(kVocab) + 9] == 10.f);
  CHECK(same_bits(p.last_logits(), peak_at(9)));

  // Context 4: two prompt tokens, two generated, then "context".
  RequestProgress c(greedy_request(10), nullptr, 4, kVocab);
  feed(c, {7, 8, 9});
  CHECK(c.generated() == std::vector<int32_t>{7, 8});
  CHECK(c.finish_reason() == "context");
  // max_tokens reached on the same token as the context: "length" wins.
  RequestProgress both(greedy_request(2), nullptr, 4, kVocab);
  feed(both, {7, 8});
  CHECK(both.finish_reason() == "length");

  RequestProgress none(greedy_request(0), nullptr, 64, kVocab);
  CHECK(none.finished());
  CHECK(none.finish_reason() == "length");
  CHECK(none.logits().empty());
}

TEST_CASE("request: EOS stops unless ignored, and its text is never shown") {
  auto tok = make_tokenizer();
  RequestProgress p(greedy_request(10), tok.get(), 64, kVocab);
  std::string text = feed(p, {450, 6635, 2, 3290});
  CHECK(p.generated() == std::vector<int32_t>{450, 6635, 2});
  CHECK(p.finish_reason() == "stop");
  CHECK(text == " The cat");
  CHECK(p.text() == text);

  GenerateRequest ignore = greedy_request(4);
  ignore.ignore_eos = true;
  RequestProgress q(ignore, tok.get(), 64, kVocab);
  feed(q, {450, 2, 6635, 3290});
  CHECK(q.finish_reason() == "length");
  CHECK(q.n_generated() == 4);
  // Without a tokenizer there is no EOS.
  RequestProgress raw(greedy_request(3), nullptr, 64, kVocab);
  CHECK(feed(raw, {2, 2, 2}).empty());
  CHECK(raw.finish_reason() == "length");
}

TEST_CASE("request: stop strings are held back, cut and never shown") {
  auto tok = make_tokenizer();
  GenerateRequest r = greedy_request(20);
  r.sampling.stop = {" EN", "mat. END"};
  RequestProgress p(r, tok.get(), 64, kVocab);
  std::vector<std::string> pieces;
  for (int32_t t : kStory) {
    if (p.finished()) break;
    p.step(peak_at(t).data());
    pieces.push_back(p.take_text());
  }
  CHECK(p.finish_reason() == "stop");
  CHECK(p.n_generated() == 8);  // through " END"
  CHECK(p.text() == " The cat sat on the ");
  // " the" could start nothing, but " mat" might start "mat. END": held back.
  REQUIRE(pieces.size() == 8);
  CHECK(pieces[4] == " the");
  CHECK(pieces[5] == " ");
  CHECK(pieces[6].empty());

  // A held-back tail that never completes is flushed when the request ends.
  GenerateRequest tail = greedy_request(6);
  tail.sampling.stop = {"mat. END"};
  RequestProgress q(tail, tok.get(), 64, kVocab);
  CHECK(feed(q, kStory) == " The cat sat on the mat");
  CHECK(q.finish_reason() == "length");
}

TEST_CASE("request: a character split over byte tokens is shown once complete") {
  auto tok = make_tokenizer();
  RequestProgress p(greedy_request(4), tok.get(), 64, kVocab);
  // U+2603 (snowman) as three byte-fallback tokens, then " c".
  std::vector<std::string> pieces;
  for (int32_t t : {229, 155, 134, 274}) {
    p.step(peak_at(t).data());
    pieces.push_back(p.take_text());
  }
  CHECK(pieces == std::vector<std::string>{"", "", "\xE2\x98\x83", " c"});
  // Cut off mid-character: each held byte comes out as U+FFFD at the end.
  RequestProgress cut(greedy_request(2), tok.get(), 64, kVocab);
  CHECK(feed(cut, {229, 155}) == "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_CASE("request: replay re-creates the state of a run that sampled the same tokens") {
  auto tok = make_tokenizer();
  GenerateRequest r = greedy_request(12);
  r.sampling.stop = {"of story"};
  RequestProgress sampled(r, tok.get(), 64, kVocab);
  const std::string streamed = feed(sampled, {450, 6635, 3290, 373});

  RequestProgress replayed(r, tok.get(), 64, kVocab);
  REQUIRE(replayed.replay(sampled.generated()).ok());
  CHECK(replayed.history() == sampled.history());
  CHECK(replayed.take_text() == streamed);
  CHECK_FALSE(replayed.finished());
  // Both go on identically, through the stop string.
  const std::vector<int32_t> rest = {278, 1775, 29889, 11056, 310, 5828, 7};
  CHECK(feed(replayed, rest) == feed(sampled, rest));
  CHECK(replayed.generated() == sampled.generated());
  CHECK(replayed.finish_reason() == "stop");
  CHECK(replayed.text() == sampled.text());

  // Errors leave the request as it was.
  RequestProgress fresh(r, tok.get(), 64, kVocab);
  Status st = fresh.replay({450, kVocab});
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("32000") != std::string::npos);
  CHECK(fresh.n_generated() == 0);
  st = fresh.replay({450, 2, 6635});  // EOS ends it before the last token
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("stop") != std::string::npos);
  CHECK(fresh.history() == r.prompt);
  REQUIRE(fresh.replay({450, 2}).ok());  // ending on the last one is fine
  CHECK(fresh.finish_reason() == "stop");
  CHECK(fresh.replay({450}).code() == Code::invalid_argument);  // after tokens exist
  RequestProgress limit(greedy_request(2), tok.get(), 64, kVocab);
  CHECK(limit.replay({450, 6635, 3290}).message().find("length") != std::string::npos);
}

// ---- generate() against the loop it replaced ----

namespace {

// generate()'s decoding loop as it was before RequestProgress existed,
// kept verbatim as the reference.
GenerateResult legacy_generate(Engine& engine, const Tokenizer* tokenizer,
                               const GenerateRequest& req, std::string& on_text_total) {
  const int32_t n_vocab = engine.config().n_vocab;
  auto seq = engine.open_sequence();
  REQUIRE(seq.ok());
  GenerateResult out;
  std::vector<float> logits(n_vocab);
  std::vector<int32_t> history = req.prompt;
  for (size_t at = 0; at < req.prompt.size(); at += req.prefill_chunk) {
    int32_t len = int32_t(std::min<size_t>(req.prefill_chunk, req.prompt.size() - at));
    REQUIRE(engine.forward({{*seq, req.prompt.data() + at, len}}, logits.data()).ok());
  }
  out.prefill_tokens = int32_t(req.prompt.size());
  StopMatcher stops(req.sampling.stop);
  std::unique_ptr<StreamDecoder> stream;
  if (tokenizer) stream = std::make_unique<StreamDecoder>(*tokenizer, false);
  auto emit = [&](const std::string& piece) {
    std::string safe = stops.push(piece);
    out.text += safe;
    on_text_total += safe;
  };
  out.finish_reason = "length";
  for (int32_t step = 0; step < req.sampling.max_tokens; ++step) {
    if (req.keep_logits) out.logits.insert(out.logits.end(), logits.begin(), logits.end());
    const uint64_t position = history.size();
    int32_t tok = sample_token(logits.data(), n_vocab, req.sampling, history, req.request_id,
                               position);
    out.tokens.push_back(tok);
    history.push_back(tok);
    if (!req.ignore_eos && tokenizer && tokenizer->is_eog(tok)) {
      out.finish_reason = "stop";
      break;
    }
    if (stream) emit(stream->push(tok));
    if (stops.stopped()) {
      out.finish_reason = "stop";
      break;
    }
    if (step + 1 == req.sampling.max_tokens) break;
    if (int64_t(history.size()) >= engine.context()) {
      out.finish_reason = "context";
      break;
    }
    REQUIRE(engine.forward({{*seq, &tok, 1}}, logits.data()).ok());
    ++out.decode_tokens;
  }
  if (stream && !stops.stopped()) {
    emit(stream->flush());
    std::string rest = stops.flush();
    out.text += rest;
    on_text_total += rest;
  }
  engine.close_sequence(*seq);
  return out;
}

void check_same(Engine& engine, const Tokenizer* tok, const GenerateRequest& r) {
  std::string legacy_streamed, streamed;
  GenerateResult want = legacy_generate(engine, tok, r, legacy_streamed);
  auto got = generate(engine, tok, r, [&](const std::string& s) {
    CHECK_FALSE(s.empty());
    streamed += s;
  });
  REQUIRE_MESSAGE(got.ok(), got.status().to_string());
  CHECK(got->tokens == want.tokens);
  CHECK(got->text == want.text);
  CHECK(streamed == legacy_streamed);
  CHECK(got->finish_reason == want.finish_reason);
  CHECK(same_bits(got->logits, want.logits));
  CHECK(got->prefill_tokens == want.prefill_tokens);
  CHECK(got->decode_tokens == want.decode_tokens);
}

}  // namespace

TEST_CASE("request: generate() gives what the loop before RequestProgress gave") {
  auto tok = make_tokenizer();
  EngineOptions o;
  o.threads = 2;
  o.context = 48;  // small, so some runs end on "context"
  auto engine = make_engine(model_path(small_dense(), "dense"), o);
  int cases = 0;
  std::map<std::string, int> reasons;
  for (int prompt_len : {1, 9, 40}) {
    for (int sampler = 0; sampler < 4; ++sampler) {
      for (int max_tokens : {0, 1, 14}) {
        GenerateRequest r;
        r.prompt = prompt_of(prompt_len, sampler + 7);
        r.request_id = uint64_t(100 + sampler);
        r.prefill_chunk = sampler % 2 ? 4 : 512;
        r.keep_logits = true;
        r.ignore_eos = sampler == 3;
        r.sampling.max_tokens = max_tokens;
        r.sampling.seed = uint64_t(prompt_len);
        if (sampler == 0) r.sampling.temperature = 0;
        if (sampler == 2) {
          r.sampling.temperature = 1.3f;
          r.sampling.top_k = 0;
          r.sampling.top_p = 0.7f;
          r.sampling.repeat_penalty = 1.3f;
        }
        CAPTURE(prompt_len);
        CAPTURE(sampler);
        CAPTURE(max_tokens);
        check_same(*engine, tok.get(), r);
        // Again with stop strings cut from that text, and one that never matches.
        std::string seen;
        GenerateResult plain = legacy_generate(*engine, tok.get(), r, seen);
        ++reasons[plain.finish_reason];
        if (plain.text.size() >= 6) {
          r.sampling.stop = {plain.text.substr(plain.text.size() / 2, 3), "\x01never"};
          check_same(*engine, tok.get(), r);
          GenerateResult cut = legacy_generate(*engine, tok.get(), r, seen);
          ++reasons["stop string " + cut.finish_reason];
        }
        // Without a tokenizer: no text, no EOS.
        check_same(*engine, nullptr, r);
        cases += 3;
      }
    }
  }
  MESSAGE("cases: " << cases);
  // Each finish rule was exercised.
  CHECK(reasons["length"] > 0);
  CHECK(reasons["context"] > 0);
  CHECK(reasons["stop string stop"] > 0);
}
