#include "kernels/cpu/packed_weights.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cpu/int8.h"
#include "kernels/cpu/panels.h"

namespace cleave::cpu {

PackedWeights::~PackedWeights() { std::free(data); }

size_t packed_bytes(const WeightView& w, PackForm f) {
  if (f == PackForm::int8) return int8_panel_bytes(w.rows, w.cols);
  const int64_t panels = (w.rows + kPanel - 1) / kPanel;
  return size_t(panels) * panel_stride(static_cast<int>(w.type), w.cols);
}

namespace {

using Key = std::tuple<const void*, int, int64_t, int64_t, size_t, int>;

struct Registry {
  std::mutex mu;
  std::map<Key, std::weak_ptr<const PackedWeights>> copies;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: backends may outlive statics
  return *r;
}

}  // namespace

std::shared_ptr<const PackedWeights> shared_packed(const WeightView& w, PackForm f,
                                                   const std::function<void(uint8_t* out)>& fill) {
  Registry& r = registry();
  const Key key{w.data, static_cast<int>(w.type), w.rows, w.cols, w.row_bytes, static_cast<int>(f)};
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.copies.find(key);
  if (it != r.copies.end()) {
    if (auto p = it->second.lock()) return p;
  }
  // Drop the entries whose copies are gone before adding one.
  for (auto e = r.copies.begin(); e != r.copies.end();) e = e->second.expired() ? r.copies.erase(e) : std::next(e);
  auto p = std::make_shared<PackedWeights>();
  p->form = f;
  p->type = w.type;
  p->rows = w.rows;
  p->cols = w.cols;
  p->row_bytes = w.row_bytes;
  p->bytes = packed_bytes(w, f);
  p->data = static_cast<uint8_t*>(std::aligned_alloc(64, (p->bytes + 63) / 64 * 64 + 64));
  CLEAVE_CHECK(p->data != nullptr);
  fill(p->data);
  r.copies[key] = p;
  return p;
}

}  // namespace cleave::cpu
