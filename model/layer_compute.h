// The decoder layers' arithmetic over rows whose KV lives in a PagedKv:
// attention (writing each row's K and V, then attending to its sequence's
// blocks), the FFN (dense, or MoE routed, gathered and combined in a fixed
// order), optionally handed to an ExpertExecutor in micro-batches, and the
// output head. The Engine runs it over its own layers; a pipeline stage
// (model/layer_stage.h) runs it over the range it holds. Every row's bits
// depend only on that row and the KV before it, so which layers run where,
// and in which groups of rows, never changes a result.
//
// The activations live in the backend's memory (BackendBuffer): on a
// device backend every op runs there and the host touches no activation;
// an MoE layer downloads its rows' expert ids (n x k) to plan the gather
// and uploads the plan. The expert executor reads and writes rows on the
// host, so it needs a backend whose memory is the host's (the engine
// refuses it on a device).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/backend_buffer.h"
#include "model/experts.h"
#include "model/llama.h"

namespace cleave {

// Scratch that grows on demand and is reused across calls.
template <class T>
T* grow_scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Layers [first, last] of a model (inclusive, as topology scripts write them).
struct LayerRange {
  int32_t first = 0, last = -1;
  int32_t count() const { return last - first + 1; }
  bool contains(int32_t layer) const { return layer >= first && layer <= last; }
  bool operator==(const LayerRange& o) const { return first == o.first && last == o.last; }
  std::string to_string() const {  // "[0, 5]"
    return "[" + std::to_string(first) + ", " + std::to_string(last) + "]";
  }
};
// The whole model's range.
inline LayerRange all_layers(const LlamaConfig& c) { return {0, c.n_layers - 1}; }
// Ranges that cut n_layers into `stages` contiguous pieces, as even as
// they go (the first ones one layer longer). invalid_argument when stages
// is not in [1, n_layers].
Result<std::vector<LayerRange>> even_cut(int32_t n_layers, int32_t stages);
// Ranges that must cover [0, n_layers) in order: invalid_argument naming a
// gap, an overlap or a range past the model's layers (or an empty one).
Status check_cover(const std::vector<LayerRange>& ranges, int32_t n_layers);

class LayerCompute {
 public:
  LayerCompute(const LlamaModel& model, Backend& backend);

  // Rows x (n x dim, in place) through layers [layers.first, layers.last].
  // kv holds layers from kv_first on (layer l is kv layer l - kv_first);
  // rows[i] / pos[i] are row i's block table and position. With an expert
  // executor the FFN of each layer goes to it in `micro_batches` groups of
  // rows (attention on one group overlaps the experts of the one before).
  void run(const PagedKv& kv, int32_t kv_first, LayerRange layers, int64_t n, const int32_t* pos,
           const AttnRow* rows, float* x, ExpertExecutor* experts, int32_t micro_batches);
  // Scratch for a run() of n rows (one micro-batch) and logits() of m, in
  // the backend's memory, allocated now: out_of_memory naming the bytes when
  // the backend has no room (then run() would abort), so a caller can refuse
  // a batch before it changes anything.
  Status reserve(int64_t n, int64_t m);
  // logits (m x n_vocab) of rows x[which[i]]: the final norm and the output
  // head. x and out in the backend's memory, which (m row indices) on the host.
  void logits(const float* x, const int32_t* which, int64_t m, float* out);

 private:
  // One micro-batch's FFN of the current layer, from ffn_start() (routed,
  // gathered, started on the executor) to ffn_finish() (combined into x).
  struct FfnGroup {
    int64_t r0 = 0, n = 0;  // its rows of the run() call
    bool started = false;
    uint64_t ticket = 0;
    int64_t gathered = 0;   // rows in gather_x (n * experts used)
    // MoE, in the backend's memory: the router's logits, each row's experts
    // and weights (gating order), the rows gathered per expert and their
    // outputs, and where expert j's output of row r sits in gather_y.
    std::unique_ptr<BackendBuffer<float>> router_logits, expert_w, gather_x, gather_y;
    std::unique_ptr<BackendBuffer<int32_t>> expert_ids, gather_src, gather_at;
    const int32_t* at = nullptr;  // gather_at's data, or the host array on the host
    std::vector<int32_t> ids_host, src_host, at_host;  // the host's copies (plans the gather)
    std::vector<ExpertWork> work;
    // On a device with an executor (which takes host rows): the work's rows
    // downloaded, its results, and where they go back up to.
    std::vector<float> x_host, y_host;
    float* y_dev = nullptr;
  };
  // The group's work handed to an executor from a device: x_count floats at
  // x (device) come down, the work points into the host copies, and
  // ffn_finish takes the results up to y.
  void work_to_host(FfnGroup& g, const float* x, float* y, int64_t count);
  struct Call {  // one run()'s arguments
    const PagedKv* kv;
    int32_t kv_first;
    const int32_t* pos;
    const AttnRow* rows;
    float* x;
    ExpertExecutor* experts;
  };
  void attend(const Call& c, const LlamaLayer& l, int32_t layer, int64_t r0, int64_t n);
  void ffn_start(const Call& c, const LlamaLayer& l, int32_t layer, FfnGroup& g);
  void ffn_finish(const Call& c, FfnGroup& g);
  template <class T>
  BackendBuffer<T>* ensure(std::unique_ptr<BackendBuffer<T>>& b) {
    if (!b) b = std::make_unique<BackendBuffer<T>>(be_);
    return b.get();
  }
  template <class T>
  T* grow(std::unique_ptr<BackendBuffer<T>>& b, int64_t n) {
    return ensure(b)->grow(size_t(n));
  }

  const LlamaModel& model_;
  Backend& be_;
  const bool host_;  // be_'s memory is the host's
  // Scratch in the backend's memory, grown on demand and reused across calls.
  BackendBuffer<float> h_, q_, k_, v_, att_, tmp_, gate_, up_, last_;
  BackendBuffer<int32_t> which_;
  std::vector<FfnGroup> groups_;
};

}  // namespace cleave
