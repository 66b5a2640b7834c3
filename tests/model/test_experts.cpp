// Attention/FFN disaggregation in the engine: the FFN experts computed by an
// ExpertPool over hosts that each hold some of them give the engine's own
// tokens and logits bit for bit, for any placement (1, 2, 4 hosts, layer
// ranges, replicas, dead hosts, no host at all), on MoE and dense models.
#include <doctest/doctest.h>

#include <algorithm>

#include "model/experts.h"
#include "tests/fenced_backend.h"
#include "tests/model/model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;

namespace {

ModelSpec moe8() {
  ModelSpec s = small_dense();
  s.n_layers = 3;
  s.n_experts = 8;
  s.n_experts_used = 2;
  s.ffn = 96;
  return s;
}

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<float> logits;  // every step's logits of every sequence
};

// Eight sequences prefilled in one batch, then decoded greedily together
// for `steps` steps.
Run run_batch(Engine& e, int steps = 6) {
  const int32_t V = e.config().n_vocab;
  const int n_seqs = 8;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n_seqs; ++i) prompts.push_back(prompt_of(5 + 7 * i, 40 + i));
  std::vector<int32_t> seqs;
  for (int i = 0; i < n_seqs; ++i) {
    auto s = e.open_sequence();
    REQUIRE(s.ok());
    seqs.push_back(*s);
  }
  Run r;
  r.tokens.resize(n_seqs);
  std::vector<float> lg(size_t(n_seqs) * V);
  std::vector<Engine::Item> items;
  for (int i = 0; i < n_seqs; ++i)
    items.push_back({seqs[size_t(i)], prompts[size_t(i)].data(), int32_t(prompts[size_t(i)].size())});
  std::vector<int32_t> next(n_seqs);
  for (int step = 0; step <= steps; ++step) {
    Status st = e.forward(items, lg.data());
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    r.logits.insert(r.logits.end(), lg.begin(), lg.end());
    items.clear();
    for (int i = 0; i < n_seqs; ++i) {
      const float* row = lg.data() + size_t(i) * V;
      next[size_t(i)] = int32_t(std::max_element(row, row + V) - row);
      r.tokens[size_t(i)].push_back(next[size_t(i)]);
      items.push_back({seqs[size_t(i)], &next[size_t(i)], 1});
    }
  }
  for (int32_t s : seqs) e.close_sequence(s);
  return r;
}

std::shared_ptr<ExpertHost> host(const std::string& path, ExpertSet set, int threads = 1) {
  auto h = ExpertHost::create(open_model(path), std::move(set), threads);
  REQUIRE_MESSAGE(h.ok(), h.status().to_string());
  return std::shared_ptr<ExpertHost>(std::move(*h));
}

std::shared_ptr<ExpertPool> pool_of(const std::string& path,
                                    const std::vector<ExpertSet>& sets) {
  auto p = ExpertPool::create(open_model(path), 1);
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  std::shared_ptr<ExpertPool> pool(std::move(*p));
  for (const ExpertSet& s : sets) pool->add_host(host(path, s));
  return pool;
}

// The batch on a fresh engine whose experts the pool computes.
Run run_on(const std::string& path, std::shared_ptr<ExpertPool> pool, int threads = 1, int steps = 6) {
  auto e = make_engine(path, threads, 8);
  e->set_expert_executor(std::move(pool));
  return run_batch(*e, steps);
}

void check_same(const Run& got, const Run& want) {
  CHECK(got.tokens == want.tokens);
  CHECK(same_bits(got.logits, want.logits));
}

}  // namespace

TEST_CASE("experts: any placement over hosts gives the engine's tokens and logits bit for bit") {
  const std::string path = model_path(moe8(), "moe8");
  auto mono_engine = make_engine(path, 2, 8);
  const Run mono = run_batch(*mono_engine);
  struct Case {
    const char* name;
    std::vector<ExpertSet> sets;
  };
  const std::vector<Case> cases = {
      {"1 host, all", {ExpertSet{}}},
      {"2 hosts", {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7})}},
      {"4 hosts", {expert_set({0, 4}), expert_set({1, 5}), expert_set({2, 6}), expert_set({3, 7})}},
      {"layer ranges", {expert_set({}, 0, 0), expert_set({}, 1, 2)}},
      {"replicas", {ExpertSet{}, ExpertSet{}, expert_set({0, 1})}},
      {"uneven, interleaved", {expert_set({7}), expert_set({0, 2, 4, 6}), expert_set({1, 3, 5}), expert_set({7, 6})}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto pool = pool_of(path, c.sets);
    check_same(run_on(path, pool, 2), mono);
    const ExpertPool::Stats st = pool->stats();
    CHECK(st.fallback_rows == 0);
    uint64_t routed = 0, dispatched = 0;
    for (uint64_t r : st.expert_rows) routed += r;
    for (uint64_t r : st.host_rows) dispatched += r;
    // Every (row, chosen expert) of every layer went to a host: prompt rows
    // plus 6 decode rows per sequence, top-2, 3 layers.
    CHECK(routed == uint64_t((8 * 5 + 7 * 28) + 8 * 6) * 2 * 3);
    CHECK(dispatched == routed);
    for (uint64_t r : st.host_rows) CHECK(r > 0);  // every host took work
  }
}

TEST_CASE("experts: replicas share the load, a dead host's experts go to a replica, then to the fallback") {
  const std::string path = model_path(moe8(), "moe8");
  auto mono_engine = make_engine(path, 1, 8);
  const Run mono = run_batch(*mono_engine);

  // Two full replicas: least-loaded picking keeps them within one piece.
  auto pool = pool_of(path, {ExpertSet{}, ExpertSet{}});
  auto e = make_engine(path, 1, 8);
  e->set_expert_executor(pool);
  Run got = run_batch(*e);
  CHECK(same_bits(got.logits, mono.logits));
  ExpertPool::Stats st = pool->stats();
  REQUIRE(st.host_rows.size() == 2);
  const uint64_t a = st.host_rows[0], b = st.host_rows[1];
  CHECK(a > 0);
  CHECK(b > 0);
  // Greedy least-loaded picking keeps the two within the largest piece: one
  // expert's rows of one layer, at most the prefill's 236 rows.
  CHECK((a > b ? a - b : b - a) <= 236);

  // Host 0 dies: host 1 takes everything.
  pool->set_alive(0, false);
  got = run_batch(*e);
  CHECK(same_bits(got.logits, mono.logits));
  ExpertPool::Stats st2 = pool->stats();
  CHECK(st2.host_rows[0] == a);
  CHECK(st2.host_rows[1] > b);
  CHECK(st2.fallback_rows == 0);

  // Both dead: the pool computes every expert itself, same bits.
  pool->set_alive(1, false);
  got = run_batch(*e);
  CHECK(got.tokens == mono.tokens);
  CHECK(same_bits(got.logits, mono.logits));
  ExpertPool::Stats st3 = pool->stats();
  CHECK(st3.host_rows == st2.host_rows);
  CHECK(st3.fallback_rows > 0);

  // Back alive: the hosts take work again.
  pool->set_alive(0, true);
  pool->set_alive(1, true);
  got = run_batch(*e);
  CHECK(same_bits(got.logits, mono.logits));
  CHECK(pool->stats().fallback_rows == st3.fallback_rows);
}

TEST_CASE("experts: an expert with no host is computed by the pool, same bits") {
  const std::string path = model_path(moe8(), "moe8");
  auto mono_engine = make_engine(path, 1, 8);
  const Run mono = run_batch(*mono_engine);
  auto pool = pool_of(path, {expert_set({0, 1, 2}), expert_set({3, 4, 5})});  // 6 and 7: nobody
  check_same(run_on(path, pool), mono);
  const ExpertPool::Stats st = pool->stats();
  uint64_t unplaced = 0;
  for (int32_t l = 0; l < 3; ++l) unplaced += st.expert_rows[size_t(l) * 8 + 6] + st.expert_rows[size_t(l) * 8 + 7];
  CHECK(unplaced > 0);
  CHECK(st.fallback_rows == unplaced);
}

TEST_CASE("experts: a dense model's FFN is expert 0 and splits by layer the same way") {
  const std::string path = model_path(small_dense(), "dense");
  auto mono_engine = make_engine(path, 1, 8);
  const Run mono = run_batch(*mono_engine);
  auto pool = pool_of(path, {expert_set({0}, 0, 0), expert_set({}, 1, 1)});
  check_same(run_on(path, pool), mono);
  const ExpertPool::Stats st = pool->stats();
  CHECK(st.host_rows[0] == st.host_rows[1]);  // every row through both layers
  CHECK(st.host_rows[0] == uint64_t(8 * 5 + 7 * 28 + 8 * 6));
}

TEST_CASE("experts on devices: an engine and its expert hosts on devices give the CPU engine's bits") {
  // The engine hands each layer's gathered rows down from its device to the
  // executor and takes the results up; each host takes its rows up into its
  // device, computes there (its experts' weights uploaded at start, one it
  // was not given on first use) and sends the results down.
  using cleave::testing::FencedBackend;
  struct Case {
    const char* name;
    ModelSpec spec;
    std::vector<ExpertSet> sets;
  };
  for (const Case& c : {Case{"moe8", moe8(), {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6, 7}), expert_set({6})}},
                        Case{"dense", small_dense(), {expert_set({0}, 0, 0), expert_set({}, 1, 1)}}}) {
    CAPTURE(c.name);
    const std::string path = model_path(c.spec, c.name);
    auto mono_engine = make_engine(path, 1, 8);
    const Run mono = run_batch(*mono_engine);
    std::vector<std::shared_ptr<FencedBackend::Log>> fences;
    auto fenced = [&] {
      auto f = std::make_shared<FencedBackend>(make_cpu_backend(1));
      fences.push_back(f->log());
      return f;
    };
    auto p = ExpertPool::create(open_model(path), 1);
    REQUIRE(p.ok());
    std::shared_ptr<ExpertPool> pool(std::move(*p));
    for (const ExpertSet& set : c.sets) {
      auto h = ExpertHost::create(open_model(path), set, 1, Compute::exact, "cpu", fenced());
      REQUIRE_MESSAGE(h.ok(), h.status().to_string());
      pool->add_host(std::shared_ptr<ExpertHost>(std::move(*h)));
    }
    for (int mb : {1, 2}) {
      CAPTURE(mb);
      EngineOptions o;
      o.threads = 1;
      o.max_seqs = 8;
      o.expert_micro_batches = mb;
      auto e = Engine::create(open_model(path), o, fenced());
      REQUIRE_MESSAGE(e.ok(), e.status().to_string());
      (*e)->set_expert_executor(pool);
      check_same(run_batch(**e), mono);
    }
    CHECK(pool->stats().fallback_rows == 0);
    if (c.spec.n_experts > 0) {
      // A replica taken on later goes up on its first use: a CPU host's bits.
      auto dev = ExpertHost::create(open_model(path), expert_set({0}), 1, Compute::exact, "cpu", fenced());
      REQUIRE(dev.ok());
      REQUIRE((*dev)->add_expert(1, 5).ok());
      auto cpu = host(path, ExpertSet{});
      const int64_t dim = c.spec.dim;
      std::vector<float> x(static_cast<size_t>(3 * dim)), y_cpu(x.size()), y_dev(x.size());
      for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 37 % 101) - 50) / 64.0f;
      const ExpertWork on_cpu{5, 3, x.data(), y_cpu.data()}, on_dev{5, 3, x.data(), y_dev.data()};
      REQUIRE(cpu->compute(1, {&on_cpu, 1}).ok());
      REQUIRE((*dev)->compute(1, {&on_dev, 1}).ok());
      CHECK(same_bits(y_dev, y_cpu));
      CHECK((*dev)->compute(1, {&on_dev, 1}).ok());  // uploaded once, kept
    }
    for (const auto& f : fences) CHECK(f->violations.empty());
  }
}

namespace {

// Computes each started layer only at finish(), logging the calls, so a
// test sees how many layers were in flight at once.
class DeferredExecutor final : public ExpertExecutor {
 public:
  explicit DeferredExecutor(std::shared_ptr<ExpertPool> pool) : pool_(std::move(pool)) {}
  void run(int32_t layer, std::span<const ExpertWork> work) override { finish(start(layer, work)); }
  uint64_t start(int32_t layer, std::span<const ExpertWork> work) override {
    started_.push_back({++next_, layer, std::vector<ExpertWork>(work.begin(), work.end())});
    max_in_flight = std::max(max_in_flight, started_.size());
    ++starts;
    return next_;
  }
  void finish(uint64_t ticket) override {
    while (!started_.empty() && started_.front().ticket <= ticket) {
      pool_->run(started_.front().layer, started_.front().work);
      started_.erase(started_.begin());
    }
  }
  size_t max_in_flight = 0, starts = 0;

 private:
  struct Started {
    uint64_t ticket;
    int32_t layer;
    std::vector<ExpertWork> work;
  };
  std::shared_ptr<ExpertPool> pool_;
  std::vector<Started> started_;
  uint64_t next_ = 0;
};

}  // namespace

TEST_CASE("experts: micro-batch ping-pong keeps m layers in flight and the engine's bits for any m") {
  for (const char* kind : {"moe8", "dense"}) {
    CAPTURE(kind);
    const std::string path = std::string(kind) == "moe8" ? model_path(moe8(), "moe8") : model_path(small_dense(), "dense");
    auto mono_engine = make_engine(path, 1, 8);
    const Run mono = run_batch(*mono_engine);
    for (int32_t m : {1, 2, 3, 8, 64}) {
      CAPTURE(m);
      EngineOptions o;
      o.max_seqs = 8;
      o.expert_micro_batches = m;
      // The pool's own start/finish (hosts on their threads)...
      auto e = make_engine(path, o);
      auto pool = pool_of(path, {expert_set({}, 0, 0), ExpertSet{}});
      e->set_expert_executor(pool);
      check_same(run_batch(*e), mono);
      CHECK(pool->stats().fallback_rows == 0);
      // ...and an executor that computes nothing before finish(): the
      // engine must keep every group's buffers until then. The prefill
      // (236 rows) has m groups in flight; decode steps have 8 rows.
      auto e2 = make_engine(path, o);
      auto deferred = std::make_shared<DeferredExecutor>(pool_of(path, {ExpertSet{}}));
      e2->set_expert_executor(deferred);
      check_same(run_batch(*e2), mono);
      CHECK(deferred->max_in_flight == size_t(m));
      // Per layer, min(m, rows) groups: the prefill, then 6 decode steps.
      const int32_t layers = e2->config().n_layers;
      CHECK(deferred->starts == size_t(layers * (std::min(m, 236) + 6 * std::min(m, 8))));
    }
  }
  EngineOptions bad;
  bad.expert_micro_batches = 0;
  auto e = Engine::create(open_model(model_path(moe8(), "moe8")), bad);
  REQUIRE(!e.ok());
  CHECK(e.status().message().find("expert_micro_batches = 0") != std::string::npos);
}

TEST_CASE("experts: sets are validated and coverage names the first expert without a host") {
  const std::string path = model_path(moe8(), "moe8");
  auto file = open_model(path);
  auto model = LlamaModel::load(file);
  REQUIRE(model.ok());
  const LlamaConfig& c = (*model)->config();
  CHECK(expert_set({8}).validate(c).message().find("expert 8 is not one of the model's 8 experts") !=
        std::string::npos);
  CHECK(expert_set({-1}).validate(c).code() == Code::invalid_argument);
  CHECK(expert_set({2, 2}).validate(c).message().find("expert 2 is listed twice") != std::string::npos);
  CHECK(expert_set({}, 2, 1).validate(c).code() == Code::invalid_argument);
  CHECK(expert_set({}, 0, 3).validate(c).message().find("3 layers") != std::string::npos);
  CHECK(expert_set({0, 7}, 0, 2).validate(c).ok());

  std::vector<ExpertSet> sets = {expert_set({0, 1, 2, 3}), expert_set({4, 5, 6}, 0, 1), expert_set({4, 5, 6, 7}, 2, 2)};
  Status cover = check_expert_coverage(c, sets);
  CHECK(cover.code() == Code::not_found);
  CHECK(cover.message() == "expert 7 of layer 0 has no host");
  sets.push_back(expert_set({7}, 0, 1));
  CHECK(check_expert_coverage(c, sets).ok());

  // A host refuses work for an expert it does not hold, naming it.
  auto h = host(path, expert_set({1}));
  std::vector<float> x(64), y(64);
  const ExpertWork w{3, 1, x.data(), y.data()};
  Status st = h->compute(0, std::span<const ExpertWork>(&w, 1));
  CHECK(st.code() == Code::invalid_argument);
  CHECK(st.message().find("expert 3 of layer 0 is not held here") != std::string::npos);
  CHECK(ExpertHost::create(file, expert_set({9}), 1).status().code() == Code::invalid_argument);
}

TEST_CASE("experts: the --experts spelling") {
  auto sets = parse_expert_sets("0-3;4,6-7@1;all@0-2;all");
  REQUIRE_MESSAGE(sets.ok(), sets.status().to_string());
  REQUIRE(sets->size() == 4);
  CHECK((*sets)[0].experts == std::vector<int32_t>{0, 1, 2, 3});
  CHECK((*sets)[0].first_layer == 0);
  CHECK((*sets)[0].last_layer == -1);
  CHECK((*sets)[1].experts == std::vector<int32_t>{4, 6, 7});
  CHECK((*sets)[1].first_layer == 1);
  CHECK((*sets)[1].last_layer == 1);
  CHECK((*sets)[2].experts.empty());
  CHECK((*sets)[2].last_layer == 2);
  CHECK((*sets)[3].experts.empty());
  CHECK((*sets)[3].last_layer == -1);
  // "L-": from L to the last layer; spec() spells a set so that it reads back the same.
  auto open_end = parse_expert_sets("all@2-");
  REQUIRE(open_end.ok());
  CHECK((*open_end)[0].first_layer == 2);
  CHECK((*open_end)[0].last_layer == -1);
  for (const ExpertSet& s : {expert_set({}), expert_set({0, 5, 2}, 1, 3), expert_set({7}, 2, -1),
                             expert_set({}, 0, 0)}) {
    auto back = parse_expert_sets(s.spec());
    REQUIRE_MESSAGE(back.ok(), s.spec());
    REQUIRE(back->size() == 1);
    CHECK((*back)[0].experts == s.experts);
    CHECK((*back)[0].first_layer == s.first_layer);
    CHECK((*back)[0].last_layer == s.last_layer);
  }
  CHECK(expert_set({0, 5}, 1, 3).spec() == "0,5@1-3");
  for (const char* bad : {"", "0-3;", "x", "3-1", "0,,1", "all@", "all@2-1", "1@a", "-1", "0-999999", "2-@1"}) {
    CAPTURE(bad);
    auto r = parse_expert_sets(bad);
    CHECK(r.status().code() == Code::invalid_argument);
    CHECK(r.status().message().rfind("--experts", 0) == 0);
  }
  // Against a model: ids past its experts, and coverage, through the pool.
  const std::string path = model_path(moe8(), "moe8");
  auto pool = ExpertPool::create(open_model(path), *parse_expert_sets("0-3;4-6"), 1);
  CHECK(pool.status().message() == "expert 7 of layer 0 has no host");
  pool = ExpertPool::create(open_model(path), *parse_expert_sets("0-8"), 1);
  CHECK(pool.status().message().find("expert 8 is not one of the model's 8 experts") != std::string::npos);
  CHECK(ExpertPool::create(open_model(path), *parse_expert_sets("all@0-1;all@2"), 1).ok());
}

TEST_CASE("experts: the replication policy on tables") {
  CHECK(load_spread({}) == 0);
  CHECK(load_spread({5, 5}) == 0);
  CHECK(load_spread({3, 1}) == doctest::Approx(0.5));
  // One layer of 4 experts: host 0 holds 0 and 1, host 1 holds 2 and 3.
  auto holds = [](int32_t h, int32_t, int32_t e) { return h == 0 ? e < 2 : e >= 2; };
  ReplicationPolicy p;
  auto move = p.pick(holds, {120, 20}, {100, 20, 10, 10}, 1, 4);
  REQUIRE(move.has_value());  // expert 0's 100 rows close the gap of 100
  CHECK(move->host == 1);
  CHECK(move->layer == 0);
  CHECK(move->expert == 0);
  CHECK_FALSE(p.pick(holds, {60, 40}, {50, 10, 20, 20}, 1, 4).has_value());  // spread 0.2: fine
  p.max_spread = 0.1;
  move = p.pick(holds, {60, 40}, {50, 10, 20, 20}, 1, 4);
  REQUIRE(move.has_value());  // 50 rows would widen the gap of 20: expert 1 (10) narrows it
  CHECK(move->expert == 1);
  CHECK_FALSE(p.pick(holds, {60, 40}, {50, 0, 20, 20}, 1, 4).has_value());  // nothing that helps
  // Layers count: expert 1 of layer 1 is the hot one.
  auto two_layers = [](int32_t h, int32_t, int32_t e) { return h == 0 ? e < 2 : e >= 2; };
  move = p.pick(two_layers, {200, 20}, {10, 10, 10, 10, 10, 170, 10, 0}, 2, 4);
  REQUIRE(move.has_value());
  CHECK(move->layer == 1);
  CHECK(move->expert == 1);
}

TEST_CASE("experts: a skewed router, balanced by replication, never changes a token") {
  ModelSpec skewed = moe8();
  skewed.router_skew = 4;
  const std::string path = model_path(skewed, "moe8-skewed");
  const std::string flat = model_path(moe8(), "moe8");
  auto mono_engine = make_engine(path, 1, 8);
  const Run mono = run_batch(*mono_engine, 12);
  const std::vector<ExpertSet> pairs = {expert_set({0, 1}), expert_set({2, 3}), expert_set({4, 5}),
                                        expert_set({6, 7})};

  // The skew: experts 0 and 1 take far more rows than 6 and 7; the flat model's don't.
  auto share_of = [](const ExpertPool::Stats& st, std::vector<int32_t> experts) {
    uint64_t part = 0, all = 0;
    for (size_t i = 0; i < st.expert_rows.size(); ++i) {
      all += st.expert_rows[i];
      if (std::find(experts.begin(), experts.end(), int32_t(i % 8)) != experts.end()) part += st.expert_rows[i];
    }
    return double(part) / double(all);
  };
  auto flat_pool = pool_of(flat, pairs);
  run_on(flat, flat_pool);
  auto plain = pool_of(path, pairs);
  check_same(run_on(path, plain, 1, 12), mono);
  const ExpertPool::Stats before = plain->stats();
  const ExpertPool::Stats flat_stats = flat_pool->stats();
  CHECK(share_of(before, {0, 1}) > 2.5 * share_of(before, {6, 7}));        // 37 % against 12 % here
  CHECK(share_of(flat_stats, {0, 1}) < 1.5 * share_of(flat_stats, {6, 7}));  // 28 % against 23 %
  CHECK(share_of(before, {0, 1}) > share_of(flat_stats, {0, 1}) + 0.05);
  const double spread_before = load_spread(before.host_rows);

  auto balanced = pool_of(path, pairs);
  ReplicationPolicy policy;
  policy.max_spread = 0.1;
  balanced->set_replication(policy, 3);
  auto e = make_engine(path, 1, 8);
  e->set_expert_executor(balanced);
  check_same(run_batch(*e, 12), mono);
  check_same(run_batch(*e, 12), mono);  // a second batch on the replicas
  const ExpertPool::Stats after = balanced->stats();
  CHECK(after.replicas_added > 0);
  CHECK(after.fallback_rows == 0);
  MESSAGE("host rows spread: " << spread_before << " without replication, " << load_spread(after.host_rows)
                               << " with " << after.replicas_added << " replicas");
  CHECK(load_spread(after.host_rows) < spread_before);
}
