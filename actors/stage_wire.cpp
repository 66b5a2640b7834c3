#include "actors/stage_wire.h"

#include <cstring>

#include "storage/block.h"

namespace cleave {
namespace {
void put_data(msg::StageBatch& m, const uint8_t* data, size_t bytes) {
  m.data.assign(data, data + bytes);
  m.checksum = checksum_bytes(m.data.data(), m.data.size());
}
}  // namespace

msg::StageBatch layers_message(const StageBatchData& b, int32_t first_layer, uint64_t fp,
                               uint32_t dim) {
  msg::StageBatch m;
  m.op = msg::StageOp::layers;
  m.first_layer = first_layer;
  m.model_fingerprint = fp;
  m.width = dim;
  m.positions = b.positions;
  m.row_table = b.row_table;
  m.table_offsets.push_back(0);
  for (const std::vector<int32_t>& t : b.tables) {
    m.table_ids.insert(m.table_ids.end(), t.begin(), t.end());
    m.table_offsets.push_back(uint32_t(m.table_ids.size()));
  }
  m.logit_rows = b.logit_rows;
  put_data(m, reinterpret_cast<const uint8_t*>(b.x.data()), b.x.size() * sizeof(float));
  return m;
}

StageBatchData batch_of(const msg::StageBatch& m) {
  StageBatchData b;
  b.positions = m.positions;
  b.row_table = m.row_table;
  for (size_t t = 0; t + 1 < m.table_offsets.size(); ++t)
    b.tables.emplace_back(m.table_ids.begin() + m.table_offsets[t],
                          m.table_ids.begin() + m.table_offsets[t + 1]);
  b.logit_rows = m.logit_rows;
  b.x.resize(m.data.size() / sizeof(float));
  if (!b.x.empty()) std::memcpy(b.x.data(), m.data.data(), b.x.size() * sizeof(float));
  return b;
}

msg::StageBatch output_message(const uint8_t* data, size_t bytes, uint32_t width,
                               int32_t first_layer, uint64_t fp) {
  msg::StageBatch m;
  m.op = msg::StageOp::output;
  m.first_layer = first_layer;
  m.model_fingerprint = fp;
  m.width = width;
  put_data(m, data, bytes);
  return m;
}

msg::StageBatch kv_message(msg::StageOp op, std::span<const int32_t> blocks, const uint8_t* data,
                           size_t bytes, int32_t first_layer, uint64_t fp) {
  msg::StageBatch m;
  m.op = op;
  m.first_layer = first_layer;
  m.model_fingerprint = fp;
  m.blocks.assign(blocks.begin(), blocks.end());
  put_data(m, data, bytes);
  return m;
}

Status check_addressed(const msg::StageBatch& m, LayerRange layers, uint64_t fp) {
  if (m.first_layer != layers.first)
    return Status(Code::invalid_argument, "stage " + layers.to_string() +
                                              ": a message for the stage from layer " +
                                              std::to_string(m.first_layer));
  if (m.model_fingerprint != fp)
    return Status(Code::invalid_argument, "stage " + layers.to_string() +
                                              ": a message for another model (fingerprint " +
                                              std::to_string(m.model_fingerprint) + ", this one " +
                                              std::to_string(fp) + ")");
  return Status::Ok();
}

}  // namespace cleave
