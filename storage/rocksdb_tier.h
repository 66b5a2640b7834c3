// Tier 2: KV blocks in an embedded RocksDB on local disk.
//
// Column families:
//   "blocks": key = the 16-byte BlockKey (lo then hi, little-endian),
//             value = an encoded record (encode_record below);
//   "meta":   key "owner" = the model fingerprint and KvLayout the database
//             was made for.
// Opening a database made for another model or layout is refused with
// invalid_argument naming the directory and both fingerprints (the caller
// chose the wrong directory; nothing in it would ever hit). Every record is
// still checked against the expected fingerprint and layout on every read:
// a foreign record found anyway answers corruption, is dropped and counted
// as a miss (foreign_reads).
//
// Record value layout (all fields little-endian, 80-byte header):
//   0  u32 magic 'CKVB' (0x42564B43)    4  u16 format version (1)
//   6  u16 header size (80)             8  u64 key.lo   16 u64 key.hi
//   24 u64 model fingerprint            32 u32 dtype    36 i32 tokens_per_block
//   40 i32 n_layers  44 i32 n_kv_heads  48 i32 head_dim
//   52 u32 n_tokens                     56 u64 checksum of the bytes (XXH3-64)
//   64 u64 byte count                   72 u64 XXH3-64 of header bytes [0, 72)
//   80 the block's bytes
// The header checksum covers the fields the bytes checksum does not, so any
// bit flip anywhere in a value is detected.
//
// Durability: sync=true fsyncs the WAL before insert/erase return, so an
// acknowledged write survives kill -9 and power loss; sync=false survives a
// process crash only.
//
// Thread safety: all methods may be called from any thread (one mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "storage/tier.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace cleave {

struct RocksDbTierOptions {
  size_t capacity_bytes = 0;  // counted as encoded (uncompressed) value bytes; 0 is invalid
  bool sync = true;           // rocksdb::WriteOptions::sync on every insert and erase
  uint64_t model_fingerprint = 0;
  KvLayout layout;
};

struct RocksDbTierCounters {
  uint64_t inserts = 0;        // records written
  uint64_t hits = 0;           // lookups answered with a verified record
  uint64_t misses = 0;         // lookups answered not_found or corruption
  uint64_t corrupt_reads = 0;  // stored values that failed to parse or verify (dropped)
  uint64_t foreign_reads = 0;  // intact records of another model/layout (dropped)
  uint64_t bytes_written = 0;  // encoded value bytes written
  uint64_t bytes_read = 0;     // encoded value bytes read
};

constexpr uint32_t kRecordMagic = 0x42564B43;  // "CKVB" little-endian
constexpr uint16_t kRecordVersion = 1;
constexpr size_t kRecordHeaderBytes = 80;

// The 16-byte RocksDB key of a block.
std::string encode_block_key(const BlockKey& key);
// The RocksDB value of a record (see the layout above).
std::string encode_record(const BlockRecord& record);
// Parses a value with full bounds checks: corruption naming `expected_key`
// when the value is truncated, has a bad magic/version/size/header checksum,
// or carries another key. Does not verify() the bytes.
Result<BlockRecord> decode_record(const BlockKey& expected_key, const char* data, size_t size);

class RocksDbTier final : public Tier {
 public:
  // invalid_argument: zero capacity, bad layout, or a database made for
  // another model/layout. io_error naming the path: the directory cannot be
  // created or opened (missing parent, read-only, a file in the way, locked).
  static Result<std::unique_ptr<RocksDbTier>> open(const std::string& dir,
                                                   const RocksDbTierOptions& options);
  ~RocksDbTier() override;
  RocksDbTier(const RocksDbTier&) = delete;
  RocksDbTier& operator=(const RocksDbTier&) = delete;

  const char* name() const override { return "rocksdb"; }
  using Tier::insert;  // insert(BlockView): copies, then insert(record), which verifies
  Status insert(const BlockRecord& record) override;
  Result<BlockRecord> lookup(const BlockKey& key) override;
  bool contains(const BlockKey& key) const override;
  Status erase(const BlockKey& key) override;
  size_t capacity_bytes() const override { return options_.capacity_bytes; }
  size_t usage_bytes() const override;
  // The indexed blocks (rebuilt from disk on open) with their encoded value bytes.
  std::vector<std::pair<BlockKey, size_t>> list() const override;

  size_t size() const;  // records indexed
  RocksDbTierCounters counters() const;
  const std::string& dir() const { return dir_; }
  // The compression the blocks column family uses ("LZ4", "ZSTD", "Snappy", "none").
  const char* compression_name() const { return compression_name_; }

 private:
  RocksDbTier(std::string dir, RocksDbTierOptions options);
  Status rebuild_index();
  Status check_meta();
  // Deletes a bad stored entry (best effort) and forgets it; mutex_ held.
  void drop_locked(const BlockKey& key);

  std::string dir_;
  RocksDbTierOptions options_;
  const char* compression_name_ = "none";
  rocksdb::DB* db_ = nullptr;
  rocksdb::ColumnFamilyHandle* blocks_ = nullptr;
  rocksdb::ColumnFamilyHandle* meta_ = nullptr;
  rocksdb::ColumnFamilyHandle* default_ = nullptr;

  mutable std::mutex mutex_;
  // The first failed write (disk full, read-only): RocksDB must not be
  // written again after it (Debian's build asserts), so every later write
  // answers this.
  Status write_failure_;
  std::unordered_map<BlockKey, uint64_t, BlockKeyHash> index_;  // key -> encoded value bytes
  size_t usage_ = 0;
  RocksDbTierCounters counters_;
};

}  // namespace cleave
