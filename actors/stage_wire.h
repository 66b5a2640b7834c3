// Pipeline micro-batches and KV slices in their wire form (schema/
// StageBatch), CAF-free: the stage actor, the actor link and their tests
// share these conversions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/layer_stage.h"
#include "schema/messages.h"

namespace cleave {

// A layers message for the stage whose layers start at first_layer.
msg::StageBatch layers_message(const StageBatchData& batch, int32_t first_layer,
                               uint64_t model_fingerprint, uint32_t dim);
// The batch a layers message carries (sizes were checked by the decoder;
// a row's hidden state is `width` floats).
StageBatchData batch_of(const msg::StageBatch& m);
// An output message (the logits, or KV slices) from raw bytes.
msg::StageBatch output_message(const uint8_t* data, size_t bytes, uint32_t width,
                               int32_t first_layer, uint64_t model_fingerprint);
// A KV call for the stage whose layers start at first_layer.
msg::StageBatch kv_message(msg::StageOp op, std::span<const int32_t> blocks, const uint8_t* data,
                           size_t bytes, int32_t first_layer, uint64_t model_fingerprint);
// invalid_argument naming both when a message meant for one stage (its
// first layer, its model) reaches another.
Status check_addressed(const msg::StageBatch& m, LayerRange layers, uint64_t model_fingerprint);

}  // namespace cleave
