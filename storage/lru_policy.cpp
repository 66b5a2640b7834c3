#include "storage/lru_policy.h"

namespace cleave {

void LruPolicy::add(size_t tier, const BlockKey& key, size_t bytes) {
  PerTier& t = tiers_.at(tier);
  if (t.index.count(key)) {
    touch(tier, key);
    return;
  }
  t.lru.push_back(key);
  t.index.emplace(key, Entry{std::prev(t.lru.end()), bytes});
  t.bytes += bytes;
}

void LruPolicy::remove(size_t tier, const BlockKey& key) {
  PerTier& t = tiers_.at(tier);
  auto it = t.index.find(key);
  if (it == t.index.end()) return;
  t.bytes -= it->second.bytes;
  t.lru.erase(it->second.pos);
  t.index.erase(it);
}

bool LruPolicy::tracked(size_t tier, const BlockKey& key) const {
  return tiers_.at(tier).index.count(key) != 0;
}

void LruPolicy::touch(size_t tier, const BlockKey& key) {
  PerTier& t = tiers_.at(tier);
  auto it = t.index.find(key);
  if (it == t.index.end()) return;
  t.lru.splice(t.lru.end(), t.lru, it->second.pos);
}

void LruPolicy::touch(const BlockKey& key) {
  for (size_t i = 0; i < tiers_.size(); ++i) touch(i, key);
}

void LruPolicy::pin(const BlockKey& key) { ++pins_[key]; }

bool LruPolicy::unpin(const BlockKey& key) {
  auto it = pins_.find(key);
  if (it == pins_.end()) return false;
  if (--it->second == 0) pins_.erase(it);
  return true;
}

int LruPolicy::pin_count(const BlockKey& key) const {
  auto it = pins_.find(key);
  return it == pins_.end() ? 0 : it->second;
}

std::optional<std::vector<BlockKey>> LruPolicy::victims(size_t tier, size_t bytes_needed) const {
  std::vector<BlockKey> out;
  if (bytes_needed == 0) return out;
  const PerTier& t = tiers_.at(tier);
  size_t freed = 0;
  for (const BlockKey& key : t.lru) {
    if (pins_.count(key)) continue;
    out.push_back(key);
    freed += t.index.at(key).bytes;
    if (freed >= bytes_needed) return out;
  }
  return std::nullopt;
}

std::vector<BlockKey> LruPolicy::order(size_t tier) const {
  const PerTier& t = tiers_.at(tier);
  return {t.lru.begin(), t.lru.end()};
}

}  // namespace cleave
