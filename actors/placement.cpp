#include "actors/placement.h"

#include <algorithm>
#include <cmath>
#include <list>
#include <unordered_map>
#include <unordered_set>

#include "storage/block.h"

namespace cleave {

std::string placement_policy_list() {
  std::string s;
  for (const char* p : kPlacementPolicies) s += (s.empty() ? "" : ", ") + std::string(p);
  return s;
}

PlacementRequest placement_request(const GenerateRequest& r, int32_t block_size) {
  PlacementRequest out;
  const int64_t bs = std::max<int32_t>(block_size, 1);
  const int64_t n = int64_t(r.prompt.size());
  out.load_blocks = (n + int64_t(std::max(r.sampling.max_tokens, 0)) + bs - 1) / bs;
  uint64_t parent = 0;
  std::vector<uint64_t> buf;
  for (int64_t b = 0; (b + 1) * bs <= n; ++b) {
    // parent, the block's tokens, and every image that overlaps it.
    buf.assign(1, parent);
    for (int64_t i = b * bs; i < (b + 1) * bs; ++i) buf.push_back(uint64_t(uint32_t(r.prompt[size_t(i)])));
    for (const PromptImage& im : r.images) {
      if (im.position >= (b + 1) * bs || im.position + im.n_tokens <= b * bs) continue;
      buf.insert(buf.end(), {im.hash.lo, im.hash.hi, uint64_t(im.position), uint64_t(im.n_tokens)});
    }
    parent = checksum_bytes(reinterpret_cast<const uint8_t*>(buf.data()), buf.size() * sizeof(uint64_t));
    out.blocks.push_back(parent);
  }
  return out;
}

namespace {

// Fewest in flight; ties to the lowest stage index.
int32_t least_loaded(const std::vector<Candidate>& cs) {
  const Candidate* best = nullptr;
  for (const Candidate& c : cs)
    if (!best || c.in_flight < best->in_flight || (c.in_flight == best->in_flight && c.stage < best->stage))
      best = &c;
  return best ? best->stage : -1;
}

class LeastLoaded final : public PlacementPolicy {
 public:
  std::string_view name() const override { return "least_loaded"; }
  int32_t pick(const PlacementRequest&, const std::vector<Candidate>& cs) override { return least_loaded(cs); }
};

class RoundRobin final : public PlacementPolicy {
 public:
  std::string_view name() const override { return "round_robin"; }
  // The smallest stage index after the last one chosen, wrapping around.
  int32_t pick(const PlacementRequest&, const std::vector<Candidate>& cs) override {
    const Candidate* next = nullptr;
    const Candidate* lowest = nullptr;
    for (const Candidate& c : cs) {
      if (!lowest || c.stage < lowest->stage) lowest = &c;
      if (c.stage > last_ && (!next || c.stage < next->stage)) next = &c;
    }
    if (!next) next = lowest;
    if (!next) return -1;
    last_ = next->stage;
    return last_;
  }

 private:
  int32_t last_ = -1;
};

class LeastLoadedPrefix final : public PlacementPolicy {
 public:
  std::string_view name() const override { return "least_loaded_prefix"; }
  int32_t pick(const PlacementRequest& r, const std::vector<Candidate>& cs) override {
    constexpr int32_t kAffinitySlack = 4;
    const int32_t best = least_loaded(cs);
    if (best < 0 || r.blocks.empty()) return best;
    auto a = affinity_.find(r.blocks.front());
    if (a == affinity_.end()) return best;
    int32_t best_load = 0;
    for (const Candidate& c : cs)
      if (c.stage == best) best_load = c.in_flight;
    for (const Candidate& c : cs)
      if (c.stage == a->second && c.in_flight <= best_load + kAffinitySlack) return c.stage;
    return best;
  }
  void placed(const PlacementRequest& r, int32_t stage) override {
    if (r.blocks.empty()) return;
    if (affinity_.size() >= kMaxEntries && !affinity_.count(r.blocks.front())) affinity_.clear();
    affinity_[r.blocks.front()] = stage;
  }
  void forget(int32_t stage) override { std::erase_if(affinity_, [&](const auto& kv) { return kv.second == stage; }); }

 private:
  static constexpr size_t kMaxEntries = size_t(1) << 16;
  std::unordered_map<uint64_t, int32_t> affinity_;  // first prompt block -> stage
};

class KvAware final : public PlacementPolicy {
 public:
  explicit KvAware(const PlacementConfig& c) : config_(c) {}
  std::string_view name() const override { return "kv_aware"; }

  int32_t pick(const PlacementRequest& r, const std::vector<Candidate>& cs) override {
    const Candidate* best = nullptr;
    double best_cost = 0;
    for (const Candidate& c : cs) {
      const size_t n = r.blocks.size();
      const size_t held = std::min(n, std::max(held_leading(r, c.stage), size_t(std::max(0, c.pool_local))));
      const size_t anywhere = std::min(n, std::max(held, size_t(std::max(0, c.pool_any))));
      const double cost = config_.prefill_weight * double(n - anywhere) +
                          config_.fetch_weight * double(anywhere - held) +
                          config_.decode_weight * double(c.load_blocks);
      if (!best || cost < best_cost ||
          (cost == best_cost && (c.in_flight < best->in_flight ||
                                 (c.in_flight == best->in_flight && c.stage < best->stage)))) {
        best = &c;
        best_cost = cost;
      }
    }
    return best ? best->stage : -1;
  }

  void placed(const PlacementRequest& r, int32_t stage) override {
    for (uint64_t b : r.blocks) {
      auto it = index_.find(b);
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second.pos);
        it->second.stages.insert(stage);
        continue;
      }
      if (index_.size() >= config_.max_blocks && !lru_.empty()) {
        index_.erase(lru_.back());
        lru_.pop_back();
      }
      lru_.push_front(b);
      index_.emplace(b, Entry{{stage}, lru_.begin()});
    }
  }

  void forget(int32_t stage) override {
    for (auto it = index_.begin(); it != index_.end();) {
      it->second.stages.erase(stage);
      if (it->second.stages.empty()) {
        lru_.erase(it->second.pos);
        it = index_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  struct Entry {
    std::unordered_set<int32_t> stages;
    std::list<uint64_t>::iterator pos;
  };
  // The leading run of the request's blocks that `stage` holds.
  size_t held_leading(const PlacementRequest& r, int32_t stage) const {
    size_t n = 0;
    for (uint64_t b : r.blocks) {
      auto it = index_.find(b);
      if (it == index_.end() || !it->second.stages.count(stage)) break;
      ++n;
    }
    return n;
  }
  PlacementConfig config_;
  std::unordered_map<uint64_t, Entry> index_;
  std::list<uint64_t> lru_;  // most recent first
};

class CostAware final : public PlacementPolicy {
 public:
  std::string_view name() const override { return "cost_aware"; }
  int32_t pick(const PlacementRequest& r, const std::vector<Candidate>& cs) override {
    // Within the budget first; among those, lower is better: seconds x
    // cost among the feasible, else seconds; over the budget: its cost.
    const Candidate* best = nullptr;
    double best_key = 0;
    bool best_feasible = false, best_in_budget = false;
    auto better = [&](const Candidate& c, double key, bool feasible, bool in_budget) {
      if (!best) return true;
      if (in_budget != best_in_budget) return in_budget;
      if (feasible != best_feasible) return feasible;
      if (key != best_key) return key < best_key;
      if (c.in_flight != best->in_flight) return c.in_flight < best->in_flight;
      return c.stage < best->stage;
    };
    bool predicted = false;
    for (const Candidate& c : cs) predicted |= c.predicted_s >= 0;
    for (const Candidate& c : cs) {
      double key = 0;
      bool feasible = true;
      const bool in_budget = r.max_cost <= 0 || c.predicted_cost < 0 || c.predicted_cost <= r.max_cost;
      if (!predicted) {
        key = double(c.in_flight + 1) * c.cost;
      } else if (c.predicted_s < 0) {
        continue;
      } else if (!in_budget) {
        feasible = false;
        key = c.predicted_cost;
      } else {
        feasible = r.limit_s <= 0 || c.predicted_s <= r.limit_s;
        key = feasible ? c.predicted_s * c.cost : c.predicted_s;
      }
      if (better(c, key, feasible, in_budget)) {
        best = &c;
        best_key = key;
        best_feasible = feasible;
        best_in_budget = in_budget;
      }
    }
    return best ? best->stage : -1;
  }
};

}  // namespace

Result<std::unique_ptr<PlacementPolicy>> make_placement_policy(const PlacementConfig& c) {
  for (double w : {c.prefill_weight, c.decode_weight, c.fetch_weight})
    if (!std::isfinite(w) || w < 0)
      return Status(Code::invalid_argument, "router weights must be finite and >= 0, got " + std::to_string(w));
  const bool weighted =
      c.prefill_weight != 1.0 || c.decode_weight != 1.0 || c.fetch_weight != kDefaultFetchWeight;
  if (weighted && c.policy != "kv_aware")
    return Status(Code::invalid_argument, "router policy '" + c.policy +
                                              "' takes no prefill_weight / decode_weight / fetch_weight (only kv_aware does)");
  if (c.max_blocks < 1) return Status(Code::invalid_argument, "router max_blocks must be at least 1");
  if (c.policy == "least_loaded") return std::unique_ptr<PlacementPolicy>(new LeastLoaded());
  if (c.policy == "round_robin") return std::unique_ptr<PlacementPolicy>(new RoundRobin());
  if (c.policy == "least_loaded_prefix") return std::unique_ptr<PlacementPolicy>(new LeastLoadedPrefix());
  if (c.policy == "kv_aware") return std::unique_ptr<PlacementPolicy>(new KvAware(c));
  if (c.policy == "cost_aware") return std::unique_ptr<PlacementPolicy>(new CostAware());
  return Status(Code::invalid_argument,
                "unknown router policy '" + c.policy + "' (expected one of " + placement_policy_list() + ")");
}

}  // namespace cleave
