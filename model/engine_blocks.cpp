// Engine: a sequence's KV blocks out and in, as host records (export_blocks,
// import_blocks) or in the backend's own memory (export_blocks_to,
// import_blocks_from: a device's blocks handed to another process without
// a host copy).
#include <algorithm>
#include <cstring>
#include <string>

#include "model/engine.h"

namespace cleave {

Status Engine::check_export(int32_t seq, int32_t first_block) const {
  if (!is_open(seq))
    return Status(Code::invalid_argument, "engine: export of sequence " + std::to_string(seq) +
                                              ", which is not open");
  CLEAVE_RETURN_IF_ERROR(link_ready());
  const int32_t n_blocks = seqs_[size_t(seq)].blocks->n_blocks();
  if (first_block < 0 || first_block > n_blocks)
    return Status(Code::invalid_argument, "engine: export from block " + std::to_string(first_block) +
                                              " of a sequence with " + std::to_string(n_blocks) +
                                              " blocks");
  return Status::Ok();
}

BlockHeader Engine::header_of(const Sequence& s, const std::vector<BlockKey>& keys, int32_t b) const {
  BlockHeader h;
  h.key = keys[size_t(b)];
  h.model_fingerprint = model_fp_;
  h.layout = layout_;
  h.n_tokens = uint32_t(std::min(options_.block_size, int32_t(s.tokens.size()) - b * options_.block_size));
  return h;
}

Result<std::vector<BlockRecord>> Engine::export_blocks(int32_t seq, int32_t first_block) const {
  CLEAVE_RETURN_IF_ERROR(check_export(seq, first_block));
  const Sequence& s = seqs_[size_t(seq)];
  const int32_t n_blocks = s.blocks->n_blocks();
  const std::vector<BlockKey> keys = keys_of(s);
  std::vector<BlockRecord> records(size_t(n_blocks - first_block));
  // The later layers' slices, from the stages that hold them (layers are
  // the outer dimension of a block, so each stage's slice is contiguous).
  const size_t own = own_block_bytes(), rest = block_bytes() - own;
  std::vector<uint8_t> later;
  if (link_ && !records.empty()) {
    const std::span<const int32_t> ids(s.blocks->blocks().data() + first_block, records.size());
    later.resize(ids.size() * rest);
    Status st = const_cast<StageLink&>(*link_).read_blocks(ids, later.data());
    if (!st.ok()) return const_cast<Engine*>(this)->broke(st);
  }
  for (int32_t b = first_block; b < n_blocks; ++b) {
    BlockRecord& r = records[size_t(b - first_block)];
    r.header = header_of(s, keys, b);
    r.bytes.resize(block_bytes());
    backend_->download(r.bytes.data(), block_data(s.blocks->blocks()[size_t(b)]), own);
    if (rest)
      std::copy(later.begin() + ptrdiff_t(size_t(b - first_block) * rest),
                later.begin() + ptrdiff_t(size_t(b - first_block + 1) * rest), r.bytes.begin() + ptrdiff_t(own));
    for (const ByteRange& u : unfilled_ranges(layout_, int32_t(r.header.n_tokens)))
      std::memset(r.bytes.data() + u.offset, 0, u.bytes);
    seal(r);
  }
  return records;
}

Status Engine::export_blocks_to(int32_t seq, int32_t first_block, void* dst,
                                std::vector<BlockHeader>& headers) const {
  CLEAVE_RETURN_IF_ERROR(check_export(seq, first_block));
  if (link_)
    return Status(Code::unsupported,
                  "engine: export into backend memory from a pipeline stage (its later layers are elsewhere)");
  const Sequence& s = seqs_[size_t(seq)];
  const int32_t n = s.blocks->n_blocks() - first_block;
  const std::vector<BlockKey> keys = keys_of(s);
  const size_t bb = block_bytes();
  uint8_t* to = static_cast<uint8_t*>(dst);
  for (int32_t i = 0; i < n; ++i)
    backend_->copy(to + size_t(i) * bb, block_data(s.blocks->blocks()[size_t(first_block + i)]), bb);
  // The last block's unfilled slots zeroed, as export_blocks does: from a
  // zeroed buffer in backend memory where the host cannot write.
  if (n > 0) {
    const int32_t filled = header_of(s, keys, first_block + n - 1).n_tokens;
    const std::vector<ByteRange> unfilled = unfilled_ranges(layout_, filled);
    uint8_t* last = to + size_t(n - 1) * bb;
    if (host_) {
      for (const ByteRange& u : unfilled) std::memset(last + u.offset, 0, u.bytes);
    } else if (!unfilled.empty()) {
      size_t most = 0;
      for (const ByteRange& u : unfilled) most = std::max(most, u.bytes);
      void* zeros = backend_->alloc(most);
      if (!zeros) return Status(Code::out_of_memory, "engine: no backend memory for an export's zeroed slots");
      const std::vector<uint8_t> host_zeros(most, 0);
      backend_->upload(zeros, host_zeros.data(), most);
      for (const ByteRange& u : unfilled) backend_->copy(last + u.offset, zeros, u.bytes);
      backend_->sync();
      backend_->free(zeros);
    }
  }
  std::vector<uint64_t> sums(static_cast<size_t>(n));
  if (n > 0) {
    Status st = checksum_blocks_in_place(*backend_, dst, bb, n, sums.data());
    if (!st.ok()) return Status(st.code(), "engine: checksums of exported blocks: " + st.message());
  }
  headers.clear();
  for (int32_t i = 0; i < n; ++i) {
    headers.push_back(header_of(s, keys, first_block + i));
    headers.back().checksum = sums[size_t(i)];
  }
  return Status::Ok();
}

Result<std::shared_ptr<BackendBlocks>> Engine::export_backend_blocks(int32_t seq, int32_t first_block) const {
  CLEAVE_RETURN_IF_ERROR(check_export(seq, first_block));
  const int32_t n = seqs_[size_t(seq)].blocks->n_blocks() - first_block;
  auto blocks = BackendBlocks::allocate(backend_, size_t(std::max(n, 1)), block_bytes());
  if (!blocks.ok()) return Status(blocks.status().code(), "engine: export: " + blocks.status().message());
  CLEAVE_RETURN_IF_ERROR(export_blocks_to(seq, first_block, (*blocks)->data(), (*blocks)->headers()));
  return blocks;
}

Result<int32_t> Engine::check_import(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                                     const std::vector<const BlockHeader*>& headers, size_t n_bytes,
                                     std::vector<int32_t>& probe_tokens) const {
  if (!is_open(seq))
    return Status(Code::invalid_argument, "engine: import_blocks needs an open sequence; " +
                                              std::to_string(seq) + " is not");
  if (n_tokens < 0 || (n_tokens > 0 && tokens == nullptr))
    return Status(Code::invalid_argument, "engine: import of " + std::to_string(n_tokens) +
                                              " tokens without a token array");
  CLEAVE_RETURN_IF_ERROR(link_ready());
  if (n_tokens > options_.context)
    return Status(Code::out_of_range, "engine: import of " + std::to_string(n_tokens) +
                                          " tokens exceeds the context of " +
                                          std::to_string(options_.context));
  const int32_t n_vocab = config().n_vocab;
  for (int32_t i = 0; i < n_tokens; ++i)
    if (tokens[i] < 0 || tokens[i] >= n_vocab)
      return Status(Code::invalid_argument, "engine: import token id " + std::to_string(tokens[i]) +
                                                " is outside the vocabulary [0, " +
                                                std::to_string(n_vocab) + ")");
  const int32_t bs = options_.block_size;
  // What the sequence holds already (an attached cached prefix) must be
  // whole blocks of these tokens; the records continue after it.
  const std::vector<int32_t>& held = seqs_[size_t(seq)].tokens;
  const int32_t n_held = int32_t(held.size());
  if (n_held % bs != 0 || n_held > n_tokens || !std::equal(held.begin(), held.end(), tokens))
    return Status(Code::invalid_argument,
                  "engine: import into sequence " + std::to_string(seq) + ", which holds " +
                      std::to_string(n_held) + " tokens that are not whole blocks of the " +
                      std::to_string(n_tokens) + " tokens imported");
  const int32_t first = n_held / bs;
  const int32_t n_blocks = (n_tokens + bs - 1) / bs - first;
  if (int32_t(headers.size()) != n_blocks)
    return Status(Code::invalid_argument, "engine: import of " + std::to_string(n_tokens) +
                                              " tokens after " + std::to_string(n_held) +
                                              " held needs " + std::to_string(n_blocks) +
                                              " blocks, got " + std::to_string(headers.size()));
  // The keys these tokens give: a record made for other tokens cannot attach.
  Sequence probe;
  probe.tokens.assign(tokens, tokens + n_tokens);
  probe.images = seqs_[size_t(seq)].images;
  const std::vector<BlockKey> keys = keys_of(probe);
  for (int32_t i = 0; i < n_blocks; ++i) {
    const int32_t b = first + i;
    const BlockHeader& h = *headers[size_t(i)];
    const std::string who = "engine: import block " + std::to_string(b) + ": ";
    Status st = verify_header(h, n_bytes, model_fp_, layout_);
    if (!st.ok()) return Status(st.code(), who + st.message());
    const uint32_t want = uint32_t(std::min(bs, n_tokens - b * bs));
    if (h.n_tokens != want)
      return Status(Code::invalid_argument, who + "holds " + std::to_string(h.n_tokens) +
                                                " tokens, the sequence needs " +
                                                std::to_string(want) + " there");
    if (!(h.key == keys[size_t(b)]))
      return Status(Code::invalid_argument, who + "key " + h.key.hex() +
                                                " is not the key of these tokens (" +
                                                keys[size_t(b)].hex() + ")");
  }
  probe_tokens = std::move(probe.tokens);
  return first;
}

Status Engine::import_blocks(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                             const std::vector<BlockRecord>& records) {
  std::vector<const BlockHeader*> headers;
  for (const BlockRecord& r : records) headers.push_back(&r.header);
  std::vector<int32_t> probe_tokens;
  auto first = check_import(seq, tokens, n_tokens, headers, block_bytes(), probe_tokens);
  if (!first.ok()) return first.status();
  for (size_t i = 0; i < records.size(); ++i) {  // sizes and checksums
    Status st = verify(records[i], model_fp_, layout_);
    if (!st.ok())
      return Status(st.code(), "engine: import block " + std::to_string(*first + int32_t(i)) + ": " + st.message());
  }
  const int32_t n_blocks = int32_t(records.size());
  CLEAVE_RETURN_IF_ERROR(make_room(n_blocks));
  Sequence& s = seqs_[size_t(seq)];
  auto grant = s.blocks->append_tokens(n_tokens - int32_t(s.tokens.size()));
  CLEAVE_CHECK(grant.ok() && !grant->no_room && !grant->copy);
  const size_t own = own_block_bytes(), rest = block_bytes() - own;
  for (int32_t i = 0; i < n_blocks; ++i)
    backend_->upload(block_data(s.blocks->blocks()[size_t(*first + i)]), records[size_t(i)].bytes.data(), own);
  if (link_ && n_blocks > 0) {
    std::vector<uint8_t> later(size_t(n_blocks) * rest);
    for (int32_t i = 0; i < n_blocks; ++i)
      std::copy(records[size_t(i)].bytes.begin() + ptrdiff_t(own), records[size_t(i)].bytes.end(),
                later.begin() + ptrdiff_t(size_t(i) * rest));
    const std::span<const int32_t> ids(s.blocks->blocks().data() + *first, size_t(n_blocks));
    // The tokens are not the sequence's yet and nothing is published: the
    // broken engine refuses the rest anyway.
    Status st = link_->write_blocks(ids, later.data());
    if (!st.ok()) return broke(st);
  }
  s.tokens = std::move(probe_tokens);
  publish_full_blocks(s);
  return Status::Ok();
}

Status Engine::import_blocks_from(int32_t seq, const int32_t* tokens, int32_t n_tokens,
                                  const std::vector<BlockHeader>& headers, const void* src) {
  if (link_)
    return Status(Code::unsupported,
                  "engine: import from backend memory into a pipeline stage (its later layers are elsewhere)");
  std::vector<const BlockHeader*> hs;
  for (const BlockHeader& h : headers) hs.push_back(&h);
  const size_t bb = block_bytes();
  std::vector<int32_t> probe_tokens;
  auto first = check_import(seq, tokens, n_tokens, hs, bb, probe_tokens);
  if (!first.ok()) return first.status();
  const int32_t n_blocks = int32_t(headers.size());
  if (n_blocks > 0) {
    if (!src) return Status(Code::invalid_argument, "engine: import of blocks from no memory");
    std::vector<uint64_t> sums(static_cast<size_t>(n_blocks));
    Status st = checksum_blocks_in_place(*backend_, src, bb, n_blocks, sums.data());
    if (!st.ok()) return Status(st.code(), "engine: checksums of imported blocks: " + st.message());
    for (int32_t i = 0; i < n_blocks; ++i)
      if (sums[size_t(i)] != headers[size_t(i)].checksum)
        return Status(Code::corruption, "engine: import block " + std::to_string(*first + i) + ": block " +
                                             headers[size_t(i)].key.hex() + ": checksum mismatch");
  }
  CLEAVE_RETURN_IF_ERROR(make_room(n_blocks));
  Sequence& s = seqs_[size_t(seq)];
  auto grant = s.blocks->append_tokens(n_tokens - int32_t(s.tokens.size()));
  CLEAVE_CHECK(grant.ok() && !grant->no_room && !grant->copy);
  const uint8_t* from = static_cast<const uint8_t*>(src);
  for (int32_t i = 0; i < n_blocks; ++i)
    backend_->copy(block_data(s.blocks->blocks()[size_t(*first + i)]), from + size_t(i) * bb, bb);
  s.tokens = std::move(probe_tokens);
  publish_full_blocks(s);
  return Status::Ok();
}

}  // namespace cleave
