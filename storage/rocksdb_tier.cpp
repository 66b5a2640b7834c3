#include "storage/rocksdb_tier.h"

#include "storage/rocksdb_logger.h"

#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <cstring>
#include <vector>

namespace cleave {
namespace {

void put_u16(char* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = char(uint8_t(v >> (8 * i)));
}
void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = char(uint8_t(v >> (8 * i)));
}
void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = char(uint8_t(v >> (8 * i)));
}
uint16_t get_u16(const char* p) {
  return uint16_t(uint8_t(p[0]) | (uint16_t(uint8_t(p[1])) << 8));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(p[i])) << (8 * i);
  return v;
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(uint8_t(p[i])) << (8 * i);
  return v;
}

constexpr size_t kHeaderChecksumAt = 72;
constexpr uint32_t kMetaMagic = 0x4D564B43;  // "CKVM"
constexpr size_t kMetaBytes = 4 + 2 + 8 + 20;
const char* const kMetaKey = "owner";

void put_layout(char* p, const KvLayout& l) {
  put_u32(p, pack_kv_types(l));  // K's type | V's << 16
  put_u32(p + 4, uint32_t(l.tokens_per_block));
  put_u32(p + 8, uint32_t(l.n_layers));
  put_u32(p + 12, uint32_t(l.n_kv_heads));
  put_u32(p + 16, uint32_t(l.head_dim));
}
KvLayout get_layout(const char* p) {
  KvLayout l;
  unpack_kv_types(get_u32(p), l);
  l.tokens_per_block = int32_t(get_u32(p + 4));
  l.n_layers = int32_t(get_u32(p + 8));
  l.n_kv_heads = int32_t(get_u32(p + 12));
  l.head_dim = int32_t(get_u32(p + 16));
  return l;
}

std::string encode_meta(uint64_t fingerprint, const KvLayout& layout) {
  std::string v(kMetaBytes, '\0');
  put_u32(v.data(), kMetaMagic);
  put_u16(v.data() + 4, kRecordVersion);
  put_u64(v.data() + 6, fingerprint);
  put_layout(v.data() + 14, layout);
  return v;
}

BlockKey decode_block_key(const rocksdb::Slice& s) {
  BlockKey k;
  k.lo = get_u64(s.data());
  k.hi = get_u64(s.data() + 8);
  return k;
}

Status io_error(const std::string& what, const std::string& path, const rocksdb::Status& s) {
  const Code code = s.IsCorruption() ? Code::corruption : Code::io_error;
  return Status(code, "rocksdb tier: " + what + " '" + path + "': " + s.ToString());
}

}  // namespace

std::string encode_block_key(const BlockKey& key) {
  std::string k(16, '\0');
  put_u64(k.data(), key.lo);
  put_u64(k.data() + 8, key.hi);
  return k;
}

std::string encode_record(const BlockRecord& r) {
  std::string v(kRecordHeaderBytes + r.bytes.size(), '\0');
  char* p = v.data();
  put_u32(p, kRecordMagic);
  put_u16(p + 4, kRecordVersion);
  put_u16(p + 6, uint16_t(kRecordHeaderBytes));
  put_u64(p + 8, r.header.key.lo);
  put_u64(p + 16, r.header.key.hi);
  put_u64(p + 24, r.header.model_fingerprint);
  put_layout(p + 32, r.header.layout);
  put_u32(p + 52, r.header.n_tokens);
  put_u64(p + 56, r.header.checksum);
  put_u64(p + 64, uint64_t(r.bytes.size()));
  put_u64(p + kHeaderChecksumAt,
          checksum_bytes(reinterpret_cast<const uint8_t*>(p), kHeaderChecksumAt));
  if (!r.bytes.empty()) std::memcpy(p + kRecordHeaderBytes, r.bytes.data(), r.bytes.size());
  return v;
}

Result<BlockRecord> decode_record(const BlockKey& expected_key, const char* data, size_t size) {
  const std::string who = "rocksdb tier: block " + expected_key.hex() + ": ";
  if (size < kRecordHeaderBytes)
    return Status(Code::corruption, who + "stored value of " + std::to_string(size) +
                                         " bytes is shorter than the " +
                                         std::to_string(kRecordHeaderBytes) + "-byte header");
  if (get_u32(data) != kRecordMagic)
    return Status(Code::corruption, who + "bad record magic");
  if (get_u16(data + 4) != kRecordVersion)
    return Status(Code::corruption, who + "unknown record format version " +
                                         std::to_string(get_u16(data + 4)));
  if (get_u16(data + 6) != kRecordHeaderBytes)
    return Status(Code::corruption, who + "header size " + std::to_string(get_u16(data + 6)) +
                                         " differs from " + std::to_string(kRecordHeaderBytes));
  const uint64_t header_sum =
      checksum_bytes(reinterpret_cast<const uint8_t*>(data), kHeaderChecksumAt);
  if (header_sum != get_u64(data + kHeaderChecksumAt))
    return Status(Code::corruption, who + "header checksum mismatch");
  const uint64_t n_bytes = get_u64(data + 64);
  if (n_bytes != size - kRecordHeaderBytes)
    return Status(Code::corruption, who + "header says " + std::to_string(n_bytes) +
                                         " bytes, the value holds " +
                                         std::to_string(size - kRecordHeaderBytes));
  BlockRecord r;
  r.header.key.lo = get_u64(data + 8);
  r.header.key.hi = get_u64(data + 16);
  if (!(r.header.key == expected_key))
    return Status(Code::corruption, who + "value carries the key " + r.header.key.hex());
  r.header.model_fingerprint = get_u64(data + 24);
  r.header.layout = get_layout(data + 32);
  r.header.n_tokens = get_u32(data + 52);
  r.header.checksum = get_u64(data + 56);
  r.bytes.assign(reinterpret_cast<const uint8_t*>(data) + kRecordHeaderBytes,
                 reinterpret_cast<const uint8_t*>(data) + size);
  return r;
}

RocksDbTier::RocksDbTier(std::string dir, RocksDbTierOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {}

RocksDbTier::~RocksDbTier() {
  // Handles first, then the DB (STACK_NOTES).
  if (db_) {
    for (auto* h : {blocks_, meta_, default_})
      if (h) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db_->Close().PermitUncheckedError();
    delete db_;
  }
}

Result<std::unique_ptr<RocksDbTier>> RocksDbTier::open(const std::string& dir,
                                                       const RocksDbTierOptions& options) {
  if (options.capacity_bytes == 0)
    return Status(Code::invalid_argument, "rocksdb tier '" + dir + "': capacity_bytes is 0");
  if (dir.empty()) return Status(Code::invalid_argument, "rocksdb tier: empty directory path");
  CLEAVE_RETURN_IF_ERROR(options.layout.validate());

  std::unique_ptr<RocksDbTier> tier(new RocksDbTier(dir, options));

  rocksdb::CompressionType compression = rocksdb::kNoCompression;
  const auto supported = rocksdb::GetSupportedCompressions();
  auto has = [&](rocksdb::CompressionType t) {
    for (auto s : supported)
      if (s == t) return true;
    return false;
  };
  if (has(rocksdb::kLZ4Compression)) {
    compression = rocksdb::kLZ4Compression;
    tier->compression_name_ = "LZ4";
  } else if (has(rocksdb::kZSTD)) {
    compression = rocksdb::kZSTD;
    tier->compression_name_ = "ZSTD";
  } else if (has(rocksdb::kSnappyCompression)) {
    compression = rocksdb::kSnappyCompression;
    tier->compression_name_ = "Snappy";
  }

  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.paranoid_checks = true;
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_options.info_log = stderr_rocks_logger(dir);  // no LOG file: see rocksdb_logger.h
  rocksdb::ColumnFamilyOptions blocks_options;
  blocks_options.compression = compression;
  rocksdb::ColumnFamilyOptions small_options;
  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, small_options},
      {"blocks", blocks_options},
      {"meta", small_options}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, dir, families, &handles, &db);
  if (!s.ok()) return io_error("cannot open", dir, s);
  tier->db_ = db;
  tier->default_ = handles[0];
  tier->blocks_ = handles[1];
  tier->meta_ = handles[2];

  CLEAVE_RETURN_IF_ERROR(tier->check_meta());
  CLEAVE_RETURN_IF_ERROR(tier->rebuild_index());
  return tier;
}

Status RocksDbTier::check_meta() {
  const std::string want = encode_meta(options_.model_fingerprint, options_.layout);
  std::string have;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta_, kMetaKey, &have);
  if (s.IsNotFound()) {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    s = db_->Put(wo, meta_, kMetaKey, want);
    if (!s.ok()) return io_error("cannot write the meta record in", dir_, s);
    return Status::Ok();
  }
  if (!s.ok()) return io_error("cannot read the meta record in", dir_, s);
  if (have.size() != kMetaBytes || get_u32(have.data()) != kMetaMagic)
    return Status(Code::corruption, "rocksdb tier '" + dir_ + "': the meta record is damaged");
  if (have != want) {
    const uint64_t fp = get_u64(have.data() + 6);
    const KvLayout layout = get_layout(have.data() + 14);
    return Status(Code::invalid_argument,
                  "rocksdb tier '" + dir_ + "' was made for model fingerprint " +
                      std::to_string(fp) + " and layout fingerprint " +
                      std::to_string(layout.fingerprint()) + ", not model " +
                      std::to_string(options_.model_fingerprint) + " and layout " +
                      std::to_string(options_.layout.fingerprint()));
  }
  return Status::Ok();
}

Status RocksDbTier::rebuild_index() {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.clear();
  usage_ = 0;
  std::vector<std::string> bad_keys;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), blocks_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const rocksdb::Slice k = it->key();
      if (k.size() != 16) {
        bad_keys.push_back(k.ToString());
        continue;
      }
      const uint64_t n = it->value().size();
      index_[decode_block_key(k)] = n;
      usage_ += n;
    }
    if (!it->status().ok()) return io_error("cannot scan the blocks of", dir_, it->status());
  }
  if (!bad_keys.empty()) {
    rocksdb::WriteBatch batch;
    for (const auto& k : bad_keys) batch.Delete(blocks_, k);
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync;
    db_->Write(wo, &batch).PermitUncheckedError();
    counters_.corrupt_reads += bad_keys.size();
  }
  return Status::Ok();
}

Status RocksDbTier::insert(const BlockRecord& record) {
  CLEAVE_RETURN_IF_ERROR(verify(record, options_.model_fingerprint, options_.layout));
  const std::string value = encode_record(record);
  std::lock_guard<std::mutex> lock(mutex_);
  if (index_.count(record.header.key)) return Status::Ok();  // content-addressed: same record
  if (!write_failure_.ok()) return write_failure_;
  if (usage_ + value.size() > options_.capacity_bytes)
    return Status(Code::out_of_memory,
                  "rocksdb tier '" + dir_ + "': " + std::to_string(value.size()) +
                      " bytes do not fit (usage " + std::to_string(usage_) + " of " +
                      std::to_string(options_.capacity_bytes) + ")");
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Put(blocks_, encode_block_key(record.header.key), value);
  if (s.ok()) {
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync;
    s = db_->Write(wo, &batch);
  }
  if (!s.ok()) {
    write_failure_ = io_error("cannot write block " + record.header.key.hex() + " to", dir_, s);
    return write_failure_;
  }
  index_[record.header.key] = value.size();
  usage_ += value.size();
  counters_.inserts++;
  counters_.bytes_written += value.size();
  return Status::Ok();
}

void RocksDbTier::drop_locked(const BlockKey& key) {
  if (write_failure_.ok()) {
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync;
    rocksdb::Status s = db_->Delete(wo, blocks_, encode_block_key(key));
    if (!s.ok()) write_failure_ = io_error("cannot erase block " + key.hex() + " from", dir_, s);
  }
  auto it = index_.find(key);
  if (it != index_.end()) {
    usage_ -= it->second;
    index_.erase(it);
  }
}

Result<BlockRecord> RocksDbTier::lookup(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!index_.count(key)) {
    counters_.misses++;
    return Status(Code::not_found, "rocksdb tier: block " + key.hex() + " is not stored");
  }
  rocksdb::PinnableSlice value;
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), blocks_, encode_block_key(key), &value);
  if (s.IsNotFound()) {  // index and disk disagree: trust the disk
    drop_locked(key);
    counters_.misses++;
    return Status(Code::not_found, "rocksdb tier: block " + key.hex() + " is not stored");
  }
  if (s.IsCorruption()) {
    drop_locked(key);
    counters_.corrupt_reads++;
    counters_.misses++;
    return Status(Code::corruption, "rocksdb tier: block " + key.hex() + ": " + s.ToString());
  }
  if (!s.ok()) {
    counters_.misses++;
    return io_error("cannot read block " + key.hex() + " from", dir_, s);
  }
  counters_.bytes_read += value.size();
  Result<BlockRecord> r = decode_record(key, value.data(), value.size());
  if (!r.ok()) {
    drop_locked(key);
    counters_.corrupt_reads++;
    counters_.misses++;
    return r.status();
  }
  Status v = verify(*r, options_.model_fingerprint, options_.layout);
  if (!v.ok()) {
    const bool foreign = r->header.model_fingerprint != options_.model_fingerprint ||
                         !(r->header.layout == options_.layout);
    drop_locked(key);
    (foreign ? counters_.foreign_reads : counters_.corrupt_reads)++;
    counters_.misses++;
    return Status(Code::corruption, "rocksdb tier: " + v.message());
  }
  counters_.hits++;
  return r;
}

bool RocksDbTier::contains(const BlockKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.count(key) != 0;
}

Status RocksDbTier::erase(const BlockKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(key);
  if (it == index_.end())
    return Status(Code::not_found, "rocksdb tier: block " + key.hex() + " is not stored");
  if (!write_failure_.ok()) return write_failure_;
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  rocksdb::Status s = db_->Delete(wo, blocks_, encode_block_key(key));
  if (!s.ok()) {
    write_failure_ = io_error("cannot erase block " + key.hex() + " from", dir_, s);
    return write_failure_;
  }
  usage_ -= it->second;
  index_.erase(it);
  return Status::Ok();
}

size_t RocksDbTier::usage_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return usage_;
}

std::vector<std::pair<BlockKey, size_t>> RocksDbTier::list() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<BlockKey, size_t>> out;
  out.reserve(index_.size());
  for (const auto& [k, n] : index_) out.emplace_back(k, size_t(n));
  return out;
}

size_t RocksDbTier::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.size();
}

RocksDbTierCounters RocksDbTier::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace cleave
