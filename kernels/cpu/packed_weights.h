// Weight matrices in the layouts the CPU kernels multiply (exact panels,
// kernels/cpu/panels.h; int8 panels, kernels/cpu/int8.h), made once per
// process: backends that prepare the same view (several engines over one
// mmapped model) share one copy, freed with its last holder. A prepared
// view's bytes must not change while a copy of it lives.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <memory>

#include "kernels/backend.h"

namespace cleave::cpu {

enum class PackForm { exact, int8 };

struct PackedWeights {
  PackForm form = PackForm::exact;
  DType type = DType::F32;
  int64_t rows = 0, cols = 0;
  size_t row_bytes = 0;
  size_t bytes = 0;
  uint8_t* data = nullptr;  // 64-byte aligned

  PackedWeights() = default;
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;
  ~PackedWeights();
  bool matches(const WeightView& w, PackForm f) const {
    return form == f && type == w.type && rows == w.rows && cols == w.cols && row_bytes == w.row_bytes;
  }
};

// Bytes of w in form f.
size_t packed_bytes(const WeightView& w, PackForm f);

// The process's copy of w in form f; when there is none, `fill(out)` packs
// one into out (out.data holds packed_bytes(w, f), 64-byte aligned) under
// the registry's lock.
std::shared_ptr<const PackedWeights> shared_packed(const WeightView& w, PackForm f,
                                                   const std::function<void(uint8_t* out)>& fill);

}  // namespace cleave::cpu
