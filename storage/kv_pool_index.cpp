#include "storage/kv_pool_index.h"

#include <algorithm>

namespace cleave {

KvPoolIndex::Holder KvPoolIndex::id_of(const std::string& holder) {
  auto it = ids_.find(holder);
  if (it != ids_.end()) return it->second;
  const Holder h = Holder(names_.size());
  names_.push_back(holder);
  counts_.push_back(0);
  ids_.emplace(holder, h);
  return h;
}

void KvPoolIndex::add_locked(Holder h, std::span<const BlockKey> keys) {
  for (const BlockKey& k : keys) {
    auto& v = where_[k];
    if (std::find(v.begin(), v.end(), h) != v.end()) continue;
    v.push_back(h);
    ++counts_[h];
  }
}

void KvPoolIndex::drop_locked(Holder h) {
  if (counts_[h] == 0) return;
  for (auto it = where_.begin(); it != where_.end();) {
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), h), v.end());
    it = v.empty() ? where_.erase(it) : std::next(it);
  }
  counts_[h] = 0;
}

void KvPoolIndex::reset(const std::string& holder, std::span<const BlockKey> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  const Holder h = id_of(holder);
  drop_locked(h);
  add_locked(h, keys);
}

void KvPoolIndex::add(const std::string& holder, std::span<const BlockKey> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  add_locked(id_of(holder), keys);
}

void KvPoolIndex::remove(const std::string& holder, std::span<const BlockKey> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  auto id = ids_.find(holder);
  if (id == ids_.end()) return;
  const Holder h = id->second;
  for (const BlockKey& k : keys) {
    auto it = where_.find(k);
    if (it == where_.end()) continue;
    auto& v = it->second;
    auto at = std::find(v.begin(), v.end(), h);
    if (at == v.end()) continue;
    v.erase(at);
    --counts_[h];
    if (v.empty()) where_.erase(it);
  }
}

void KvPoolIndex::drop(const std::string& holder) {
  std::lock_guard<std::mutex> lock(mu_);
  auto id = ids_.find(holder);
  if (id != ids_.end()) drop_locked(id->second);
}

int32_t KvPoolIndex::leading_run(const std::string& holder, std::span<const BlockKey> keys) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto id = ids_.find(holder);
  if (id == ids_.end()) return 0;
  int32_t n = 0;
  for (const BlockKey& k : keys) {
    auto it = where_.find(k);
    if (it == where_.end() || std::find(it->second.begin(), it->second.end(), id->second) == it->second.end())
      break;
    ++n;
  }
  return n;
}

std::vector<std::pair<std::string, int32_t>> KvPoolIndex::leading_runs(
    std::span<const BlockKey> keys) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> run(names_.size(), 0);
  std::vector<Holder> live;  // holders that hold every key so far
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = where_.find(keys[i]);
    if (it == where_.end()) break;
    std::vector<Holder> next;
    for (Holder h : it->second)
      if (i == 0 || std::find(live.begin(), live.end(), h) != live.end()) next.push_back(h);
    if (next.empty()) break;
    for (Holder h : next) run[h] = int32_t(i + 1);
    live = std::move(next);
  }
  std::vector<std::pair<std::string, int32_t>> out;
  for (Holder h = 0; h < Holder(names_.size()); ++h)
    if (run[h] > 0) out.emplace_back(names_[h], run[h]);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  return out;
}

size_t KvPoolIndex::blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return where_.size();
}

size_t KvPoolIndex::held_by(const std::string& holder) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto id = ids_.find(holder);
  return id == ids_.end() ? 0 : counts_[id->second];
}

std::vector<std::string> KvPoolIndex::holders() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (Holder h = 0; h < Holder(names_.size()); ++h)
    if (counts_[h] > 0) out.push_back(names_[h]);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace cleave
