// Tier 2 (RocksDB): round trip, capacity, reopen, bit flips in stored values,
// foreign records, bad directories.
#include <doctest/doctest.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <atomic>
#include <thread>

#include "storage/rocksdb_tier.h"

namespace fs = std::filesystem;
using namespace cleave;

namespace {

KvLayout small_layout() {
  KvLayout l;
  l.tokens_per_block = 4;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 16;  // 2 * 2 * 4 * 16 * 4 * 2 layers = 2048 bytes
  return l;
}

constexpr uint64_t kModel = 0x1234abcd5678ef01ull;

BlockRecord make_record(uint64_t seed, const KvLayout& layout = small_layout(),
                        uint64_t model = kModel) {
  std::mt19937_64 rng(seed);
  BlockRecord r;
  r.header.key = {rng(), rng()};
  r.header.model_fingerprint = model;
  r.header.layout = layout;
  r.header.n_tokens = uint32_t(layout.tokens_per_block);
  r.bytes.resize(layout.block_bytes());
  for (auto& b : r.bytes) b = uint8_t(rng());
  seal(r);
  return r;
}

RocksDbTierOptions opts(size_t capacity = 64 << 20) {
  RocksDbTierOptions o;
  o.capacity_bytes = capacity;
  o.sync = false;
  o.model_fingerprint = kModel;
  o.layout = small_layout();
  return o;
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("cleave_rocksdb_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

// Raw RocksDB access to the "blocks" column family, for fault injection.
struct RawDb {
  rocksdb::DB* db = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  explicit RawDb(const std::string& dir) {
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"meta", {}}};
    rocksdb::DBOptions o;
    auto s = rocksdb::DB::Open(o, dir, families, &handles, &db);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
  }
  ~RawDb() {
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    delete db;
  }
  rocksdb::ColumnFamilyHandle* blocks() { return handles[1]; }
  std::string get(const BlockKey& k) {
    std::string v;
    auto s = db->Get({}, blocks(), encode_block_key(k), &v);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    return v;
  }
  void put(const BlockKey& k, const std::string& v) {
    auto s = db->Put({}, blocks(), encode_block_key(k), v);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
  }
};

}  // namespace

TEST_CASE("rocksdb tier: round trip, erase, counters") {
  TempDir dir;
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE_MESSAGE(tier.ok(), tier.status().to_string());
  auto& t = **tier;
  const BlockRecord r = make_record(1);
  CHECK(!t.contains(r.header.key));
  CHECK(t.lookup(r.header.key).status().code() == Code::not_found);
  REQUIRE(t.insert(r).ok());
  CHECK(t.contains(r.header.key));
  CHECK(t.usage_bytes() == kRecordHeaderBytes + r.bytes.size());
  CHECK(t.insert(r).ok());  // an identical record already there
  CHECK(t.usage_bytes() == kRecordHeaderBytes + r.bytes.size());
  auto got = t.lookup(r.header.key);
  REQUIRE_MESSAGE(got.ok(), got.status().to_string());
  CHECK(got->header.key == r.header.key);
  CHECK(got->header.checksum == r.header.checksum);
  CHECK(got->header.n_tokens == r.header.n_tokens);
  CHECK(got->header.layout == r.header.layout);
  CHECK(got->bytes == r.bytes);
  const auto c = t.counters();
  CHECK(c.inserts == 1);
  CHECK(c.hits == 1);
  CHECK(c.misses == 1);
  CHECK(c.bytes_written == kRecordHeaderBytes + r.bytes.size());
  CHECK(c.bytes_read == kRecordHeaderBytes + r.bytes.size());
  CHECK(t.erase(r.header.key).ok());
  CHECK(t.erase(r.header.key).code() == Code::not_found);
  CHECK(!t.contains(r.header.key));
  CHECK(t.usage_bytes() == 0);
  CHECK(std::string(t.compression_name()) != "");
  MESSAGE("compression: " << std::string(t.compression_name()));
}

TEST_CASE("rocksdb tier: capacity answers out_of_memory and writes nothing") {
  TempDir dir;
  const size_t one = kRecordHeaderBytes + small_layout().block_bytes();
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts(2 * one + 10));
    REQUIRE(tier.ok());
    auto& t = **tier;
    REQUIRE(t.insert(make_record(1)).ok());
    REQUIRE(t.insert(make_record(2)).ok());
    const BlockRecord third = make_record(3);
    const Status s = t.insert(third);
    CHECK(s.code() == Code::out_of_memory);
    CHECK(!t.contains(third.header.key));
    CHECK(t.usage_bytes() == 2 * one);
    CHECK(t.counters().inserts == 2);
  }
  auto tier = RocksDbTier::open(dir.path.string(), opts(2 * one + 10));
  REQUIRE(tier.ok());
  CHECK((*tier)->size() == 2);
  CHECK(!(*tier)->contains(make_record(3).header.key));
}

TEST_CASE("rocksdb tier: insert verifies the record") {
  TempDir dir;
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(tier.ok());
  BlockRecord r = make_record(5);
  r.bytes[7] ^= 1;
  CHECK((*tier)->insert(r).code() == Code::corruption);
  KvLayout other = small_layout();
  other.head_dim = 8;
  CHECK((*tier)->insert(make_record(6, other)).code() == Code::corruption);
  CHECK((*tier)->insert(make_record(7, small_layout(), kModel + 1)).code() == Code::corruption);
  CHECK((*tier)->size() == 0);
}

TEST_CASE("rocksdb tier: reopen rebuilds the index and usage") {
  TempDir dir;
  std::vector<BlockRecord> records;
  size_t usage = 0;
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts());
    REQUIRE(tier.ok());
    for (int i = 0; i < 50; ++i) {
      records.push_back(make_record(100 + i));
      REQUIRE((*tier)->insert(records.back()).ok());
    }
    REQUIRE((*tier)->erase(records[10].header.key).ok());
    usage = (*tier)->usage_bytes();
  }
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(tier.ok());
  auto& t = **tier;
  CHECK(t.size() == 49);
  CHECK(t.usage_bytes() == usage);
  for (int i = 0; i < 50; ++i) {
    CHECK(t.contains(records[i].header.key) == (i != 10));
    if (i == 10) continue;
    auto got = t.lookup(records[i].header.key);
    REQUIRE(got.ok());
    CHECK(got->bytes == records[i].bytes);
  }
}

TEST_CASE("rocksdb tier: bit flips in stored values are 100% detected") {
  TempDir dir;
  constexpr int kRecords = 200;
  constexpr int kFlipped = 100;
  std::vector<BlockRecord> records;
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts());
    REQUIRE(tier.ok());
    for (int i = 0; i < kRecords; ++i) {
      records.push_back(make_record(1000 + i));
      REQUIRE((*tier)->insert(records.back()).ok());
    }
  }
  std::mt19937_64 rng(42);
  int header_flips = 0;
  {
    RawDb raw(dir.path.string());
    for (int i = 0; i < kFlipped; ++i) {
      std::string v = raw.get(records[i].header.key);
      // A quarter of the flips land in the header, the rest anywhere.
      const size_t limit = (i % 4 == 0) ? kRecordHeaderBytes : v.size();
      const size_t bit = rng() % (limit * 8);
      header_flips += bit / 8 < kRecordHeaderBytes;
      v[bit / 8] = char(uint8_t(v[bit / 8]) ^ (1u << (bit % 8)));
      raw.put(records[i].header.key, v);
    }
  }
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(tier.ok());
  auto& t = **tier;
  REQUIRE(t.size() == size_t(kRecords));
  int detected = 0;
  for (int i = 0; i < kFlipped; ++i) {
    auto got = t.lookup(records[i].header.key);
    if (!got.ok() && got.status().code() == Code::corruption) {
      ++detected;
      CHECK(got.status().message().find(records[i].header.key.hex()) != std::string::npos);
    }
    CHECK(!t.contains(records[i].header.key));  // dropped
  }
  CHECK(detected == kFlipped);
  for (int i = kFlipped; i < kRecords; ++i) {
    auto got = t.lookup(records[i].header.key);
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    CHECK(got->bytes == records[i].bytes);
  }
  const auto c = t.counters();
  CHECK(c.corrupt_reads == uint64_t(kFlipped));
  CHECK(c.hits == uint64_t(kRecords - kFlipped));
  CHECK(c.misses == uint64_t(kFlipped));
  MESSAGE("flipped " << kFlipped << " records (" << header_flips << " in the header), detected "
                     << detected);
  // The dropped entries are gone from disk too.
  tier = Status(Code::aborted, "closed");
  auto again = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(again.ok());
  CHECK((*again)->size() == size_t(kRecords - kFlipped));
}

TEST_CASE("rocksdb tier: truncated and garbage values answer corruption") {
  TempDir dir;
  const BlockRecord a = make_record(1), b = make_record(2), c = make_record(3), d = make_record(4);
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts());
    REQUIRE(tier.ok());
    for (const auto* r : {&a, &b, &c, &d}) REQUIRE((*tier)->insert(*r).ok());
  }
  {
    RawDb raw(dir.path.string());
    std::string v = raw.get(a.header.key);
    raw.put(a.header.key, v.substr(0, 40));                       // truncated header
    raw.put(b.header.key, v.substr(0, v.size() - 1));             // truncated bytes
    raw.put(c.header.key, std::string(v.size(), '\xA5'));          // garbage
    raw.put(d.header.key, encode_record(a));                       // another key's record
  }
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(tier.ok());
  for (const auto* r : {&a, &b, &c, &d}) {
    auto got = (*tier)->lookup(r->header.key);
    CHECK(got.status().code() == Code::corruption);
    CHECK(got.status().message().find(r->header.key.hex()) != std::string::npos);
  }
  CHECK((*tier)->counters().corrupt_reads == 4);
  CHECK((*tier)->usage_bytes() == 0);
}

TEST_CASE("rocksdb tier: records of another model or layout are rejected") {
  TempDir dir;
  KvLayout other = small_layout();
  other.n_layers = 1;
  const BlockRecord foreign_layout = make_record(11, other);
  const BlockRecord foreign_model = make_record(12, small_layout(), kModel ^ 1);
  const BlockRecord good = make_record(13);
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts());
    REQUIRE(tier.ok());
    REQUIRE((*tier)->insert(good).ok());
  }
  {
    RawDb raw(dir.path.string());  // well-formed records smuggled in
    raw.put(foreign_layout.header.key, encode_record(foreign_layout));
    raw.put(foreign_model.header.key, encode_record(foreign_model));
  }
  {
    auto tier = RocksDbTier::open(dir.path.string(), opts());
    REQUIRE(tier.ok());
    auto& t = **tier;
    CHECK(t.lookup(foreign_layout.header.key).status().code() == Code::corruption);
    CHECK(t.lookup(foreign_model.header.key).status().code() == Code::corruption);
    CHECK(t.lookup(good.header.key).ok());
    const auto c = t.counters();
    CHECK(c.foreign_reads == 2);
    CHECK(c.misses == 2);
    CHECK(c.corrupt_reads == 0);
  }
  // The whole database opened for another model or layout: a typed error.
  RocksDbTierOptions o = opts();
  o.model_fingerprint = kModel + 7;
  auto wrong_model = RocksDbTier::open(dir.path.string(), o);
  CHECK(wrong_model.status().code() == Code::invalid_argument);
  CHECK(wrong_model.status().message().find(dir.path.string()) != std::string::npos);
  o = opts();
  o.layout = other;
  CHECK(RocksDbTier::open(dir.path.string(), o).status().code() == Code::invalid_argument);
}

TEST_CASE("rocksdb tier: bad options and directories give typed errors") {
  TempDir dir;
  CHECK(RocksDbTier::open(dir.path.string(), opts(0)).status().code() == Code::invalid_argument);
  RocksDbTierOptions bad = opts();
  bad.layout.head_dim = 0;
  CHECK(RocksDbTier::open(dir.path.string(), bad).status().code() == Code::invalid_argument);

  const std::string missing = (dir.path / "no" / "such" / "parent" / "db").string();
  auto m = RocksDbTier::open(missing, opts());
  CHECK(m.status().code() == Code::io_error);
  CHECK(m.status().message().find(missing) != std::string::npos);

  // Read-only directory. Root ignores mode bits, so there fall back to a
  // path under a regular file, which no one can create.
  fs::create_directories(dir.path);
  const fs::path ro = dir.path / "readonly";
  fs::create_directories(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec, fs::perm_options::replace);
  std::string target = (ro / "db").string();
  if (::access(ro.c_str(), W_OK) == 0) {
    const fs::path file = dir.path / "a_file";
    std::ofstream(file) << "x";
    target = (file / "db").string();
    MESSAGE("running as root: using a path under a regular file");
  }
  auto r = RocksDbTier::open(target, opts());
  CHECK(r.status().code() == Code::io_error);
  CHECK(r.status().message().find(target) != std::string::npos);
  fs::permissions(ro, fs::perms::owner_all, fs::perm_options::replace);

  // Two tiers on one directory: the second is refused (RocksDB's lock).
  auto first = RocksDbTier::open((dir.path / "db").string(), opts());
  REQUIRE(first.ok());
  CHECK(RocksDbTier::open((dir.path / "db").string(), opts()).status().code() == Code::io_error);
}

TEST_CASE("rocksdb tier: threads inserting and reading the same keys") {
  TempDir dir;
  auto tier = RocksDbTier::open(dir.path.string(), opts());
  REQUIRE(tier.ok());
  auto& t = **tier;
  std::vector<BlockRecord> records;
  for (int i = 0; i < 32; ++i) records.push_back(make_record(500 + i));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int round = 0; round < 20; ++round)
        for (int i = 0; i < 32; ++i) {
          const auto& r = records[(i + w * 7) % 32];
          if (!t.insert(r).ok()) ++failures;
          auto got = t.lookup(r.header.key);
          if (!got.ok() || got->bytes != r.bytes) ++failures;
        }
    });
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  CHECK(t.size() == 32);
  CHECK(t.counters().inserts == 32);
  CHECK(t.usage_bytes() == 32 * (kRecordHeaderBytes + small_layout().block_bytes()));
}

TEST_CASE("rocksdb tier: F16, Q8_0 and Q4_0 blocks are stored at their size and read back, other types are foreign") {
  for (auto [kt, vt] : {std::pair{DType::F16, DType::F16}, std::pair{DType::Q8_0, DType::Q8_0},
                        std::pair{DType::F16, DType::Q8_0}, std::pair{DType::Q4_0, DType::Q4_0},
                        std::pair{DType::Q8_0, DType::Q4_0}}) {
    const std::string types = std::string(dtype_name(kt)) + "/" + dtype_name(vt);
    CAPTURE(types);
    TempDir dir;
    KvLayout l = small_layout();
    l.head_dim = 32;  // Q8_0 and Q4_0 rows are 32-element blocks
    l.k_type = kt;
    l.v_type = vt;
    // Rows of K and V: 2 layers x 2 heads x 4 tokens each; bytes per row by type.
    CHECK(l.block_bytes() == size_t(2 * 2 * 4) * (dtype_row_bytes(kt, 32) + dtype_row_bytes(vt, 32)));
    RocksDbTierOptions o = opts();
    o.layout = l;
    const BlockRecord r = make_record(21, l);
    KvLayout f32 = l;
    f32.k_type = f32.v_type = DType::F32;
    const BlockRecord other = make_record(22, f32);
    {
      auto tier = RocksDbTier::open(dir.path.string(), o);
      REQUIRE_MESSAGE(tier.ok(), tier.status().to_string());
      REQUIRE((*tier)->insert(r).ok());
      CHECK((*tier)->usage_bytes() == kRecordHeaderBytes + l.block_bytes());
      CHECK((*tier)->insert(other).code() == Code::corruption);  // verify(): not this tier's layout
      CHECK((*tier)->usage_bytes() == kRecordHeaderBytes + l.block_bytes());
    }
    {
      RawDb raw(dir.path.string());
      raw.put(other.header.key, encode_record(other));
    }
    auto tier = RocksDbTier::open(dir.path.string(), o);  // reopened: the types came back from disk
    REQUIRE_MESSAGE(tier.ok(), tier.status().to_string());
    auto got = (*tier)->lookup(r.header.key);
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    CHECK(got->header.layout == l);
    CHECK(got->bytes == r.bytes);
    CHECK((*tier)->lookup(other.header.key).status().code() == Code::corruption);
    // The database opened with F32 KV: made for another layout.
    tier.value().reset();
    CHECK(RocksDbTier::open(dir.path.string(), opts()).status().code() == Code::invalid_argument);
  }
}
