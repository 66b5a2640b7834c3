// Pipeline parallelism in the engine (model/layer_stage.h): an Engine that
// holds the first layers and LayerStages that hold the rest give the whole
// model's tokens and logits bit for bit, for any cut, any micro-batch
// count, with cached prefixes (copy-on-write through the stages), and KV
// exported from one cut imports into any other.
#include <doctest/doctest.h>

#include <algorithm>

#include "model/layer_stage.h"
#include "tests/fenced_backend.h"
#include "tests/model/model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

ModelSpec four_layers(int kv_heads, int experts = 0) {
  ModelSpec s = small_dense();
  s.n_layers = 4;
  s.n_kv_heads = kv_heads;
  if (experts) {
    s.n_experts = experts;
    s.n_experts_used = 2;
    s.ffn = 96;
  }
  return s;
}

struct Model {
  std::string name;
  ModelSpec spec;
};
std::vector<Model> models() {
  return {{"pp-dense", four_layers(4)}, {"pp-gqa", four_layers(2)}, {"pp-moe", four_layers(2, 4)}};
}

EngineOptions engine_options(DType kt = DType::F32, DType vt = DType::F32) {
  EngineOptions o;
  o.threads = 2;
  o.max_seqs = 8;
  o.cache_type_k = kt;
  o.cache_type_v = vt;
  return o;
}

using Fences = std::vector<std::shared_ptr<cleave::testing::FencedBackend::Log>>;

// An engine that holds ranges[0] and a threaded link over the rest. With
// fences, the engine and every stage on a fenced backend of their own (a
// device's memory: tests/fenced_backend.h), whose logs go there.
std::unique_ptr<Engine> pipelined(const std::string& path, const std::vector<LayerRange>& ranges,
                                  int micro_batches, DType kt = DType::F32, DType vt = DType::F32,
                                  Fences* fences = nullptr) {
  EngineOptions o = engine_options(kt, vt);
  o.last_layer = ranges[0].last;
  o.pipeline_micro_batches = micro_batches;
  auto fenced = [&]() -> std::shared_ptr<Backend> {
    if (!fences) return nullptr;
    auto f = std::make_shared<cleave::testing::FencedBackend>(make_cpu_backend(1));
    fences->push_back(f->log());
    return f;
  };
  std::unique_ptr<Engine> e;
  if (fences) {
    auto made = Engine::create(open_model(path), o, fenced());
    REQUIRE_MESSAGE(made.ok(), made.status().to_string());
    e = std::move(made.value());
  } else {
    e = make_engine(path, o);
  }
  if (ranges.size() == 1) return e;
  std::vector<std::shared_ptr<LayerStage>> stages;
  for (size_t i = 1; i < ranges.size(); ++i) {
    auto s = LayerStage::create(open_model(path), ranges[i], e->total_blocks(),
                                e->options().block_size, 1, kt, vt, Compute::exact, "cpu", fenced());
    REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    stages.push_back(std::move(*s));
  }
  auto link = ThreadedStageLink::create(std::move(stages));
  REQUIRE_MESSAGE(link.ok(), link.status().to_string());
  REQUIRE(e->set_stage_link(std::move(*link)).ok());
  return e;
}

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<float> logits;  // every step's logits of every sequence
};

// Eight sequences (the second half sharing the first half's prompts' first
// 20 tokens, so they attach cached prefixes and copy a shared block)
// prefilled in one batch, then decoded greedily together.
Run run_batch(Engine& e, int steps = 5) {
  const int32_t V = e.config().n_vocab;
  const int n_seqs = 8;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n_seqs / 2; ++i) prompts.push_back(prompt_of(21 + 9 * i, 40 + i));
  for (int i = 0; i < n_seqs / 2; ++i) {
    std::vector<int32_t> p(prompts[size_t(i)].begin(), prompts[size_t(i)].begin() + 20);
    const auto tail = prompt_of(5 + i, 90 + i);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  Run r;
  r.tokens.resize(n_seqs);
  std::vector<int32_t> seqs;
  std::vector<float> lg(size_t(n_seqs) * V);
  // First half, then the second half with its cached prefix attached.
  for (int half = 0; half < 2; ++half) {
    std::vector<Engine::Item> items;
    std::vector<int32_t> offs;
    for (int i = half * 4; i < half * 4 + 4; ++i) {
      auto s = e.open_sequence();
      REQUIRE(s.ok());
      seqs.push_back(*s);
      const auto& p = prompts[size_t(i)];
      auto hit = e.attach_cached_prefix(*s, p.data(), int32_t(p.size()));
      REQUIRE(hit.ok());
      if (half == 1) CHECK(*hit == 16);
      offs.push_back(*hit);
      items.push_back({*s, p.data() + *hit, int32_t(p.size()) - *hit});
    }
    Status st = e.forward(items, lg.data());
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    r.logits.insert(r.logits.end(), lg.begin(), lg.begin() + 4 * V);
  }
  std::vector<int32_t> next(n_seqs);
  for (int step = 0; step < steps; ++step) {
    std::vector<Engine::Item> items;
    const float* base = r.logits.data() + r.logits.size() - size_t(n_seqs) * V;
    for (int i = 0; i < n_seqs; ++i) {
      const float* row = base + size_t(i) * V;
      next[size_t(i)] = int32_t(std::max_element(row, row + V) - row);
      r.tokens[size_t(i)].push_back(next[size_t(i)]);
      items.push_back({seqs[size_t(i)], &next[size_t(i)], 1});
    }
    Status st = e.forward(items, lg.data());
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    r.logits.insert(r.logits.end(), lg.begin(), lg.end());
  }
  return r;
}

}  // namespace

TEST_CASE("pipeline stages: any cut and any micro-batch count give the whole model's bits") {
  for (const Model& m : models()) {
    const std::string path = model_path(m.spec, m.name);
    auto mono = make_engine(path, engine_options());
    const Run want = run_batch(*mono);
    const std::vector<std::vector<LayerRange>> cuts = {
        {{0, 1}, {2, 3}}, {{0, 0}, {1, 3}}, {{0, 2}, {3, 3}}, {{0, 0}, {1, 1}, {2, 3}},
        {{0, 0}, {1, 1}, {2, 2}, {3, 3}}};
    for (const auto& cut : cuts) {
      for (int mb = 1; mb <= 4; ++mb) {
        CAPTURE(m.name);
        CAPTURE(cut.size());
        CAPTURE(cut[0].last);
        CAPTURE(mb);
        auto e = pipelined(path, cut, mb);
        const Run got = run_batch(*e);
        CHECK(got.tokens == want.tokens);
        CHECK(same_bits(got.logits, want.logits));
      }
    }
  }
}

TEST_CASE("pipeline stages on a device: the first stage and the later ones on devices give the whole model's bits") {
  // Every stage on memory the host cannot touch: the engine sends each
  // micro-batch's hidden states down from its device to the link, the
  // stages take them up into theirs and send theirs (or the logits) down.
  for (const Model& m : models()) {
    const std::string path = model_path(m.spec, m.name);
    auto mono = make_engine(path, engine_options());
    const Run want = run_batch(*mono);
    for (const auto& [cut, mb] : std::vector<std::pair<std::vector<LayerRange>, int>>{
             {{{0, 1}, {2, 3}}, 1}, {{{0, 1}, {2, 3}}, 2}, {{{0, 0}, {1, 1}, {2, 3}}, 3}}) {
      CAPTURE(m.name);
      CAPTURE(cut.size());
      CAPTURE(mb);
      Fences fences;
      auto e = pipelined(path, cut, mb, DType::F32, DType::F32, &fences);
      const Run got = run_batch(*e);
      CHECK(got.tokens == want.tokens);
      CHECK(same_bits(got.logits, want.logits));
      for (const auto& f : fences) CHECK(f->violations.empty());
      // KV out of a device pipeline (its stages' slices read through the
      // link) is the whole model's, and imports into a device pipeline cut
      // elsewhere: decoding goes on with the same bits.
      if (mb != 2) continue;
      const auto P = prompt_of(40, 7);
      const int32_t V = e->config().n_vocab;
      std::vector<float> lg(static_cast<size_t>(V)), want_next(static_cast<size_t>(V));
      auto whole = make_engine(path, engine_options());
      const int32_t sm = *whole->open_sequence();
      REQUIRE(whole->forward({{sm, P.data(), 40}}, lg.data()).ok());
      auto want_records = whole->export_blocks(sm);
      const int32_t t = 11;
      REQUIRE(whole->forward({{sm, &t, 1}}, want_next.data()).ok());
      auto a = pipelined(path, cut, mb, DType::F32, DType::F32, &fences);
      const int32_t sa = *a->open_sequence();
      Status fwd = a->forward({{sa, P.data(), 40}}, lg.data());
      REQUIRE_MESSAGE(fwd.ok(), fwd.to_string());
      auto records = a->export_blocks(sa);
      REQUIRE_MESSAGE(records.ok(), records.status().to_string());
      REQUIRE(records->size() == want_records->size());
      for (size_t i = 0; i < records->size(); ++i) CHECK((*records)[i].bytes == (*want_records)[i].bytes);
      auto b = pipelined(path, {{0, 0}, {1, 2}, {3, 3}}, 1, DType::F32, DType::F32, &fences);
      const int32_t sb = *b->open_sequence();
      REQUIRE(b->import_blocks(sb, P.data(), 40, *records).ok());
      REQUIRE(b->forward({{sb, &t, 1}}, lg.data()).ok());
      CHECK(same_bits(lg, want_next));
      for (const auto& f : fences) CHECK(f->violations.empty());
    }
  }
}

TEST_CASE("pipeline stages: KV exported from one cut imports into another and decoding goes on") {
  const std::string path = model_path(four_layers(2), "pp-gqa");
  const int32_t V = 32000;
  const auto P = prompt_of(40, 7);
  // (exporter cut, importer cut): 2 stages -> whole, whole -> 3 stages, 2 -> 3 cut elsewhere.
  const std::vector<std::pair<std::vector<LayerRange>, std::vector<LayerRange>>> pairs = {
      {{{0, 1}, {2, 3}}, {{0, 3}}},
      {{{0, 3}}, {{0, 0}, {1, 2}, {3, 3}}},
      {{{0, 2}, {3, 3}}, {{0, 0}, {1, 1}, {2, 3}}}};
  auto mono = make_engine(path, engine_options());
  const int32_t sm = *mono->open_sequence();
  std::vector<float> want(V), got(V);
  Engine::Item item{sm, P.data(), int32_t(P.size())};
  REQUIRE(mono->forward({item}, want.data()).ok());
  std::vector<std::vector<float>> want_steps;
  std::vector<int32_t> want_tokens;
  for (int i = 0; i < 12; ++i) {  // crosses into block 3
    const int32_t t = int32_t(std::max_element(want.begin(), want.end()) - want.begin());
    want_tokens.push_back(t);
    REQUIRE(mono->forward({{sm, &want_tokens.back(), 1}}, want.data()).ok());
    want_steps.push_back(want);
  }
  for (const auto& [from, to] : pairs) {
    CAPTURE(from.size());
    CAPTURE(to.size());
    auto a = pipelined(path, from, 2);
    auto b = pipelined(path, to, 3);
    const int32_t sa = *a->open_sequence();
    REQUIRE(a->forward({{sa, P.data(), int32_t(P.size())}}, got.data()).ok());
    auto records = a->export_blocks(sa);
    REQUIRE_MESSAGE(records.ok(), records.status().to_string());
    REQUIRE(records->size() == 3);
    // The records are the whole model's: byte for byte the mono engine's
    // (the full blocks: a partial block's unused slots hold whatever the
    // memory held).
    auto mono_records = make_engine(path, engine_options());
    const int32_t s2 = *mono_records->open_sequence();
    REQUIRE(mono_records->forward({{s2, P.data(), int32_t(P.size())}}, got.data()).ok());
    auto want_records = mono_records->export_blocks(s2);
    REQUIRE(want_records.ok());
    for (size_t i = 0; i < 2; ++i) CHECK((*records)[i].bytes == (*want_records)[i].bytes);
    const int32_t sb = *b->open_sequence();
    Status st = b->import_blocks(sb, P.data(), int32_t(P.size()), *records);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    for (size_t i = 0; i < want_tokens.size(); ++i) {
      REQUIRE(b->forward({{sb, &want_tokens[i], 1}}, got.data()).ok());
      CHECK(same_bits(got, want_steps[i]));
    }
  }
}

TEST_CASE("pipeline stages: cuts are checked, naming the gap, the overlap or the range past the model") {
  auto msg = [](const std::vector<LayerRange>& r) { return check_cover(r, 12).message(); };
  CHECK(check_cover({{0, 5}, {6, 11}}, 12).ok());
  CHECK(msg({{0, 5}, {7, 11}}) == "layers [6, 6] are held by no stage (a gap before [7, 11])");
  CHECK(msg({{0, 5}, {5, 11}}) == "layers [5, 11] overlap [5, 5] of the stage before");
  CHECK(msg({{0, 5}, {6, 12}}) == "layers [6, 12] go past the model's layers [0, 11]");
  CHECK(msg({{0, 5}, {6, 10}}) == "layers [11, 11] are held by no stage (a gap at the end)");
  CHECK(msg({{1, 11}}) == "layers [0, 0] are held by no stage (a gap before [1, 11])");
  CHECK(msg({{0, 5}, {7, 6}}) == "layers [7, 6] are an empty range");
  auto cut = even_cut(12, 5);
  REQUIRE(cut.ok());
  CHECK(check_cover(*cut, 12).ok());
  CHECK((*cut)[0] == LayerRange{0, 2});
  CHECK((*cut)[4] == LayerRange{10, 11});
  CHECK(even_cut(4, 5).status().code() == Code::invalid_argument);
  CHECK(even_cut(4, 0).status().code() == Code::invalid_argument);
}

TEST_CASE("pipeline stages: bad links, batches and options are refused with the reason") {
  const std::string path = model_path(four_layers(2), "pp-gqa");
  EngineOptions o = engine_options();
  o.last_layer = 1;
  auto e = make_engine(path, o);
  const int32_t s = *e->open_sequence();
  const auto P = prompt_of(8, 1);
  std::vector<float> lg(32000);
  // No link: the engine does not hold every layer.
  Status st = e->forward({{s, P.data(), 8}}, lg.data());
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("no stage link") != std::string::npos);
  // A link that does not start after layer 1.
  auto wrong = LayerStage::create(open_model(path), {3, 3}, e->total_blocks(), 16, 1);
  REQUIRE(wrong.ok());
  std::shared_ptr<LayerStage> wrong_stage = std::move(*wrong);
  auto link = ThreadedStageLink::create({wrong_stage});
  REQUIRE(link.ok());
  CHECK(e->set_stage_link(std::move(*link)).code() == Code::invalid_argument);
  // Stages that do not follow each other or do not reach the end.
  auto s2 = LayerStage::create(open_model(path), {2, 2}, e->total_blocks(), 16, 1);
  REQUIRE(s2.ok());
  std::shared_ptr<LayerStage> mid = std::move(*s2);
  CHECK(ThreadedStageLink::create({mid}).status().code() == Code::invalid_argument);
  CHECK(LayerStage::create(open_model(path), {0, 3}, 8, 16, 1).status().code() ==
        Code::invalid_argument);
  CHECK(LayerStage::create(open_model(path), {2, 4}, 8, 16, 1).status().code() ==
        Code::invalid_argument);
  o.last_layer = 4;
  CHECK(Engine::create(open_model(path), o).status().code() == Code::invalid_argument);
  o.last_layer = 1;
  o.pipeline_micro_batches = 65;
  CHECK(Engine::create(open_model(path), o).status().code() == Code::invalid_argument);
  // A batch that names a block past the stage's pool or a position its
  // table does not reach: a typed error, nothing computed.
  StageBatchData b;
  b.positions = {0};
  b.row_table = {0};
  b.tables = {{wrong_stage->kv_blocks()}};
  b.x.assign(64, 0.f);
  std::vector<float> out;
  st = wrong_stage->run(b, out);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("block id") != std::string::npos);
  b.tables = {{0}};
  b.positions = {16};
  CHECK(wrong_stage->run(b, out).code() == Code::invalid_argument);
  b.positions = {0};
  b.x.resize(10);
  CHECK(wrong_stage->run(b, out).code() == Code::invalid_argument);
  CHECK(wrong_stage->stats().batches == 0);
}

namespace {
// A link whose stages are gone after `ok_calls` micro-batches.
class DyingLink final : public StageLink {
 public:
  DyingLink(std::unique_ptr<StageLink> inner, int ok_calls) : inner_(std::move(inner)), left_(ok_calls) {}
  int32_t first_layer() const override { return inner_->first_layer(); }
  Result<uint64_t> start(const StageRows& rows) override {
    if (left_-- <= 0) return Status(Code::unavailable, "stage 2 is gone");
    return inner_->start(rows);
  }
  Status finish(uint64_t t, float* logits) override { return inner_->finish(t, logits); }
  Status copy_block(int32_t a, int32_t b) override { return inner_->copy_block(a, b); }
  Status read_blocks(std::span<const int32_t> ids, uint8_t* out) override {
    return inner_->read_blocks(ids, out);
  }
  Status write_blocks(std::span<const int32_t> ids, const uint8_t* in) override {
    return inner_->write_blocks(ids, in);
  }

 private:
  std::unique_ptr<StageLink> inner_;
  int left_;
};
}  // namespace

TEST_CASE("pipeline stages: a failed link breaks the engine: every later call is unavailable") {
  const std::string path = model_path(four_layers(2), "pp-gqa");
  EngineOptions o = engine_options();
  o.last_layer = 1;
  o.pipeline_micro_batches = 2;
  auto e = make_engine(path, o);
  auto stage = LayerStage::create(open_model(path), {2, 3}, e->total_blocks(), 16, 1);
  REQUIRE(stage.ok());
  auto link = ThreadedStageLink::create({std::shared_ptr<LayerStage>(std::move(*stage))});
  REQUIRE(link.ok());
  REQUIRE(e->set_stage_link(std::make_shared<DyingLink>(std::move(*link), 3)).ok());
  const int32_t s = *e->open_sequence();
  const auto P = prompt_of(20, 3);
  std::vector<float> lg(32000);
  REQUIRE(e->forward({{s, P.data(), 20}}, lg.data()).ok());  // 2 micro-batches
  CHECK(!e->pipeline_broken());
  Status st = e->forward({{s, P.data(), 2}}, lg.data());      // the second one fails
  CHECK(st.code() == Code::unavailable);
  CHECK(st.message().find("stage 2 is gone") != std::string::npos);
  CHECK(e->pipeline_broken());
  CHECK(e->forward({{s, P.data(), 1}}, lg.data()).code() == Code::unavailable);
  CHECK(e->export_blocks(s).status().code() == Code::unavailable);
}

TEST_CASE("pipeline stages: F16 KV through the stages gives the whole engine's bits and records") {
  // head_dim 16 here: F16 (and F16 K with F32 V); Q8_0 needs 32.
  const std::string path = model_path(four_layers(2), "pp-gqa");
  for (auto [kt, vt] : {std::pair{DType::F16, DType::F16}, std::pair{DType::F16, DType::F32}}) {
    const std::string types = std::string(dtype_name(kt)) + "/" + dtype_name(vt);
    CAPTURE(types);
    auto whole = make_engine(path, engine_options(kt, vt));
    const Run want = run_batch(*whole);
    auto f32 = make_engine(path, engine_options());
    CHECK_FALSE(same_bits(run_batch(*f32).logits, want.logits));  // the type is in the numbers
    for (const std::vector<LayerRange>& cut : {std::vector<LayerRange>{{0, 1}, {2, 3}},
                                              std::vector<LayerRange>{{0, 0}, {1, 1}, {2, 3}}}) {
      auto e = pipelined(path, cut, 2, kt, vt);
      const Run got = run_batch(*e);
      CHECK(got.tokens == want.tokens);
      CHECK(same_bits(got.logits, want.logits));
      // Exported records gather every stage's slice: the whole engine's bytes
      // (fresh engines: run_batch holds every sequence slot).
      auto ep = pipelined(path, cut, 1, kt, vt);
      auto ew = make_engine(path, engine_options(kt, vt));
      const auto P = prompt_of(40, 7);
      std::vector<float> lg(32000);
      auto sa = ep->open_sequence(), sw = ew->open_sequence();
      REQUIRE(sa.ok());
      REQUIRE(sw.ok());
      REQUIRE(ep->forward({{*sa, P.data(), int32_t(P.size())}}, lg.data()).ok());
      REQUIRE(ew->forward({{*sw, P.data(), int32_t(P.size())}}, lg.data()).ok());
      auto a = ep->export_blocks(*sa), b = ew->export_blocks(*sw);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      REQUIRE(a->size() == 3);
      CHECK((*a)[0].header.layout == whole->kv_layout());
      for (size_t i = 0; i < 2; ++i) CHECK((*a)[i].bytes == (*b)[i].bytes);
    }
  }
  // A stage refuses a type its head_dim cannot hold, naming it.
  auto q8 = LayerStage::create(open_model(path), {2, 3}, 64, 16, 1, DType::Q8_0, DType::F32);
  REQUIRE_FALSE(q8.ok());
  CHECK(q8.status().message().find("stage: cache type k q8_0 needs head_dim a multiple of 32") != std::string::npos);
}
