#include "storage/tier.h"

#include <cstring>

namespace cleave {

Status Tier::insert(const BlockView& view) {
  BlockRecord r;
  std::memcpy(&r.header, view.header, sizeof(BlockHeader));
  r.bytes.assign(view.bytes, view.bytes + view.n_bytes);
  return insert(r);
}

Status Tier::read(const BlockKey& key, const std::function<Status(const BlockView&)>& fn) {
  Result<BlockRecord> r = lookup(key);
  if (!r.ok()) return r.status();
  return fn(BlockView::of(*r, /*verified=*/true));
}

Status move_block(Tier& from, Tier& to, const BlockKey& key) {
  CLEAVE_RETURN_IF_ERROR(from.read(key, [&](const BlockView& v) { return to.insert(v); }));
  return from.erase(key);
}

}  // namespace cleave
