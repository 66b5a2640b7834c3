// Sampling: repetition penalty, greedy, top-k / top-p / min-p with
// temperature, and deterministic draws from Philox4x32-10.
#include "model/sampler.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "common/status.h"

namespace cleave {

namespace {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), as in Random123.
struct Philox4x32 {
  uint32_t v[4];
};

inline void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint32_t* c = ctr.v;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += W0;
      k1 += W1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(M0, c[0], &hi0, &lo0);
    mulhilo32(M1, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0;
    const uint32_t n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
  return ctr;
}

}  // namespace

// Key = seed; counter = (position, request), each as two 32-bit words, low
// word first. The first two output words form the result (low word first).
uint64_t counter_rng_u64(uint64_t seed, uint64_t request, uint64_t position) {
  Philox4x32 ctr{{static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                  static_cast<uint32_t>(request), static_cast<uint32_t>(request >> 32)}};
  const Philox4x32 r =
      philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(r.v[1]) << 32) | r.v[0];
}

double counter_rng_uniform(uint64_t seed, uint64_t request, uint64_t position) {
  return static_cast<double>(counter_rng_u64(seed, request, position) >> 11) * 0x1.0p-53;
}

namespace {

struct Cand {
  int32_t id;
  float logit;
};

// Descending logit, then ascending id; NaN counts as -inf.
inline float key_of(float x) {
  return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x;
}
// The first index of the largest value in key_of's order (NaN as -inf, -0
// equal to +0): Before's argmax without the candidates. A server samples
// 32 x 32000 logits a step, so: the max of each block of 64 in four
// independent 4-float lanes (NaN never wins `v > a`; SSE2, the x86-64
// baseline, so no dispatch), then the first block holding it, then its
// first element equal to it. 6x the scalar loop it replaces (37 -> 6 us a
// 32000 row here).
int32_t greedy_argmax(const float* x, int32_t n) {
  typedef float v4sf __attribute__((vector_size(16)));
  constexpr int32_t kBlock = 64;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int32_t nb = n / kBlock;
  std::vector<float> block_max(static_cast<size_t>(nb) + 1);
  float m = ninf;
  for (int32_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    v4sf a[4];
    for (v4sf& v : a) v = v4sf{ninf, ninf, ninf, ninf};
    for (int32_t j = 0; j < kBlock; j += 16)
      for (int k = 0; k < 4; ++k) {
        v4sf v;
        std::memcpy(&v, xb + j + 4 * k, sizeof v);
        a[k] = v > a[k] ? v : a[k];
      }
    const v4sf lo = a[0] > a[1] ? a[0] : a[1], hi = a[2] > a[3] ? a[2] : a[3];
    const v4sf r = lo > hi ? lo : hi;
    float mb = ninf;
    for (int l = 0; l < 4; ++l) mb = r[l] > mb ? r[l] : mb;
    block_max[static_cast<size_t>(b)] = mb;
    m = mb > m ? mb : m;
  }
  for (int32_t i = nb * kBlock; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (m == ninf) {  // only -inf and NaN (both -inf to key_of): the first
    for (int32_t i = 0; i < n; ++i)
      if (!(x[i] > m)) return i;
    return 0;
  }
  int32_t from = nb * kBlock;
  for (int32_t b = 0; b < nb; ++b)
    if (block_max[static_cast<size_t>(b)] == m) {
      from = b * kBlock;
      break;
    }
  for (int32_t i = from; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}

struct Before {
  bool operator()(const Cand& a, const Cand& b) const {
    const float x = key_of(a.logit), y = key_of(b.logit);
    return x > y || (x == y && a.id < b.id);
  }
};

}  // namespace

int32_t sample_token(const float* logits, int32_t n_vocab, const SamplingParams& params,
                     const std::vector<int32_t>& history, uint64_t request, uint64_t position,
                     size_t n_prompt) {
  CLEAVE_CHECK(logits != nullptr && n_vocab > 0);
  const bool penalties = params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f ||
                         (params.repeat_penalty != 1.0f && params.repeat_last_n != 0);
  if (!penalties && (!(params.temperature > 0.0f) || params.top_k == 1)) {
    // Greedy on the logits as they are: the argmax below without copying
    // the row into candidates (ties to the lowest id, as Before orders them).
    return greedy_argmax(logits, n_vocab);
  }
  std::vector<Cand> cands(static_cast<size_t>(n_vocab));
  for (int32_t i = 0; i < n_vocab; ++i) cands[i] = Cand{i, logits[i]};

  // Presence / frequency penalties (OpenAI): over the generated tokens, in
  // the order they were generated (each token's count, then one subtraction).
  if ((params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f) &&
      n_prompt < history.size()) {
    std::unordered_map<int32_t, int32_t> counts;
    for (size_t i = n_prompt; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t >= 0 && t < n_vocab) ++counts[t];
    }
    for (const auto& [t, n] : counts)
      cands[t].logit -= params.presence_penalty + params.frequency_penalty * float(n);
  }

  // Repetition penalty (llama.cpp): each distinct token of the window once.
  if (params.repeat_penalty != 1.0f && params.repeat_last_n != 0 && !history.empty()) {
    const size_t window = params.repeat_last_n < 0
                              ? history.size()
                              : std::min(history.size(), static_cast<size_t>(params.repeat_last_n));
    std::unordered_set<int32_t> seen;
    for (size_t i = history.size() - window; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t < 0 || t >= n_vocab || !seen.insert(t).second) continue;
      float& l = cands[t].logit;
      l = l > 0 ? l / params.repeat_penalty : l * params.repeat_penalty;
    }
  }

  // Greedy: argmax, ties to the lowest id.
  auto argmax = [&] {
    const Cand* best = &cands[0];
    for (const Cand& c : cands) {
      if (Before{}(c, *best)) best = &c;
    }
    return best->id;
  };
  if (!(params.temperature > 0.0f)) return argmax();
  if (params.top_k == 1) return argmax();

  // top_k: keep the k best, sorted (partial sort: O(V log k)).
  size_t n = cands.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < n) {
    n = static_cast<size_t>(params.top_k);
    std::partial_sort(cands.begin(), cands.begin() + n, cands.end(), Before{});
    cands.resize(n);
  } else {
    std::sort(cands.begin(), cands.end(), Before{});
  }
  const float lmax = key_of(cands[0].logit);
  if (!std::isfinite(lmax)) return cands[0].id;  // all -inf / NaN, or +inf present

  // Softmax with temperature (double, in sorted order: deterministic).
  std::vector<double> p(n);
  double sum = 0;
  const double inv_t = 1.0 / static_cast<double>(params.temperature);
  for (size_t i = 0; i < n; ++i) {
    const float l = key_of(cands[i].logit);
    p[i] = std::isfinite(l) ? std::exp((static_cast<double>(l) - lmax) * inv_t) : 0.0;
    sum += p[i];
  }
  for (size_t i = 0; i < n; ++i) p[i] /= sum;

  // top_p: the smallest prefix whose mass reaches top_p (at least one).
  if (params.top_p < 1.0f) {
    double cum = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += p[i];
      if (cum >= static_cast<double>(params.top_p)) {
        keep = i + 1;
        break;
      }
    }
    n = std::max<size_t>(1, keep);
  }
  // min_p: keep p >= min_p * p_max (p is sorted, so a prefix).
  if (params.min_p > 0.0f) {
    const double thr = static_cast<double>(params.min_p) * p[0];
    size_t keep = 1;
    while (keep < n && p[keep] >= thr) ++keep;
    n = keep;
  }

  // Renormalise and draw by inverse CDF.
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += p[i];
  const double u = counter_rng_uniform(params.seed, request, position) * total;
  double cum = 0;
  for (size_t i = 0; i < n; ++i) {
    cum += p[i];
    if (u < cum) return cands[i].id;
  }
  // Rounding: u landed past the last cumulative sum; take the last token
  // that has any probability.
  for (size_t i = n; i-- > 0;) {
    if (p[i] > 0) return cands[i].id;
  }
  return cands[0].id;
}

LogprobEntry token_logprobs(const float* logits, int32_t n_vocab, int32_t chosen, int32_t top) {
  CLEAVE_CHECK(logits != nullptr && n_vocab > 0 && chosen >= 0 && chosen < n_vocab);
  double mx = -std::numeric_limits<double>::infinity();
  for (int32_t i = 0; i < n_vocab; ++i) mx = std::max(mx, double(key_of(logits[i])));
  double sum = 0;
  if (std::isfinite(mx))
    for (int32_t i = 0; i < n_vocab; ++i) sum += std::exp(double(key_of(logits[i])) - mx);
  const double lse = std::isfinite(mx) ? mx + std::log(sum) : 0;
  auto lp = [&](int32_t i) {
    const double l = double(key_of(logits[i]));
    return std::isfinite(l) && std::isfinite(mx) ? float(l - lse)
                                                 : -std::numeric_limits<float>::infinity();
  };
  LogprobEntry out;
  out.chosen = {chosen, lp(chosen)};
  if (top > 0) {
    std::vector<Cand> cands(static_cast<size_t>(n_vocab));
    for (int32_t i = 0; i < n_vocab; ++i) cands[i] = Cand{i, logits[i]};
    const size_t k = std::min<size_t>(size_t(top), cands.size());
    std::partial_sort(cands.begin(), cands.begin() + k, cands.end(), Before{});
    for (size_t i = 0; i < k; ++i) out.top.push_back({cands[i].id, lp(cands[i].id)});
  }
  return out;
}

std::string StopMatcher::push(const std::string& text) {
  if (stopped_) return "";
  held_ += text;
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    const size_t pos = held_.find(s);
    if (pos < best) best = pos;
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that could still start a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    const size_t max_len = std::min(s.size() - (s.empty() ? 0 : 1), held_.size());
    for (size_t len = max_len; len > hold; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return "";
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace cleave
