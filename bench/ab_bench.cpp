#include "bench/ab_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <vector>

#include "kernels/backend.h"
#include "kernels/device_testing.h"
#include "kernels/forwarding_backend.h"
#include "model/engine.h"
#include "model/gguf.h"

namespace cleave::bench {

namespace {

// The CPU backend with Backend::matmuls at its default: a group's matmuls
// one after another, each its own region.
class OneByOne final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  void matmuls(const MatmulJob* jobs, int64_t count) override { Backend::matmuls(jobs, count); }
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(q * double(v.size() - 1) + 0.5)];
}

struct Times {
  double prefill = 0, decode = 0;
};

Times run_pass(Engine& e, const std::vector<int32_t>& prompt, int decode, std::vector<float>& logits) {
  Times t;
  auto seq = e.open_sequence();
  if (!seq.ok()) throw std::runtime_error(seq.status().to_string());
  double t0 = now_s();
  Status st = e.forward({{*seq, prompt.data(), int32_t(prompt.size())}}, logits.data());
  t.prefill = now_s() - t0;
  t0 = now_s();
  for (int i = 0; st.ok() && i < decode; ++i) {
    const int32_t tok = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    st = e.forward({{*seq, &tok, 1}}, logits.data());
  }
  t.decode = now_s() - t0;
  e.close_sequence(*seq);
  if (!st.ok()) throw std::runtime_error(st.to_string());
  return t;
}

}  // namespace

nlohmann::json run_ab(const std::string& what, const std::string& model_path, int threads, int prompt_len,
                      int decode, int runs) {
  std::shared_ptr<Backend> variant;
  if (what == "groups") variant = std::make_shared<OneByOne>(make_cpu_backend(threads));
  else if (what == "rows") variant = make_cpu_backend_panel_split(threads);
  else throw std::runtime_error("--ab: unknown change '" + what + "' (groups, rows)");
  auto file = GgufFile::open(model_path);
  if (!file.ok()) throw std::runtime_error(file.status().to_string());
  EngineOptions o;
  o.threads = threads;
  o.context = 256;
  auto with = Engine::create(*file, o);
  auto without = Engine::create(*file, o, variant);
  if (!with.ok()) throw std::runtime_error(with.status().to_string());
  if (!without.ok()) throw std::runtime_error(without.status().to_string());
  Engine* engines[2] = {with->get(), without->get()};
  const int32_t vocab = engines[0]->config().n_vocab;
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
  for (int i = 0; i < prompt_len; ++i) prompt[size_t(i)] = 3 + (i * 7919) % (vocab - 3);
  std::vector<float> logits[2] = {std::vector<float>(size_t(vocab)), std::vector<float>(size_t(vocab))};
  std::vector<double> prefill[2], dec[2], ratio_p, ratio_d;
  for (int r = 0; r < runs; ++r) {
    Times t[2];
    for (int k = 0; k < 2; ++k) {  // which goes first alternates
      const int w = r % 2 ? 1 - k : k;
      t[w] = run_pass(*engines[w], prompt, decode, logits[w]);
    }
    if (logits[0] != logits[1]) throw std::runtime_error("--ab " + what + ": the two engines' logits differ");
    if (r == 0) continue;  // warm-up
    for (int w = 0; w < 2; ++w) prefill[w].push_back(t[w].prefill), dec[w].push_back(t[w].decode);
    ratio_p.push_back(t[1].prefill / t[0].prefill);
    if (decode > 0) ratio_d.push_back(t[1].decode / t[0].decode);
  }
  auto summary = [](const std::vector<double>& g, const std::vector<double>& s, const std::vector<double>& ratio) {
    nlohmann::json j;
    if (ratio.empty()) return j;
    j["default_ms"] = 1e3 * quantile(g, 0.5);
    j["variant_ms"] = 1e3 * quantile(s, 0.5);
    j["speedup_median"] = quantile(ratio, 0.5);
    j["speedup_q1"] = quantile(ratio, 0.25);
    j["speedup_q3"] = quantile(ratio, 0.75);
    j["default_faster"] = std::count_if(ratio.begin(), ratio.end(), [](double x) { return x > 1; });
    j["pairs"] = ratio.size();
    return j;
  };
  return {{"ab", what}, {"threads", threads}, {"prompt", prompt_len}, {"decode", decode},
          {"prefill", summary(prefill[0], prefill[1], ratio_p)}, {"decode_steps", summary(dec[0], dec[1], ratio_d)}};
}

}  // namespace cleave::bench
