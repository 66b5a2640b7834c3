// The job journal over RocksDB (the value encoding is in journal_codec.cpp).
#include "jobs/journal.h"

#include "storage/rocksdb_logger.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <filesystem>
#include <system_error>

namespace cleave::jobs {
namespace {

const std::string kMetaKey = "meta";
const std::string kRecordPrefix = "req/";
constexpr size_t kRecordKeyBytes = 4 + 8;

std::string record_key(uint64_t index) {
  std::string k = kRecordPrefix;
  for (int i = 7; i >= 0; --i) k.push_back(char(uint8_t(index >> (8 * i))));
  return k;
}

uint64_t record_index(const rocksdb::Slice& key) {
  uint64_t v = 0;
  for (size_t i = kRecordPrefix.size(); i < kRecordKeyBytes; ++i) v = (v << 8) | uint8_t(key[i]);
  return v;
}

bool is_disk_full(const rocksdb::Status& s) {
  return s.IsNoSpace() || s.ToString().find("No space left") != std::string::npos;
}

// "journal '<dir>': <what>: disk full (<rocksdb's words>)"
Status db_error(const std::string& dir, const std::string& what, const rocksdb::Status& s) {
  const std::string who = "journal '" + dir + "': " + what + ": ";
  if (is_disk_full(s)) return Status(Code::io_error, who + "disk full (" + s.ToString() + ")");
  if (s.IsCorruption()) return Status(Code::corruption, who + s.ToString());
  return Status(Code::io_error, who + s.ToString());
}

rocksdb::Options journal_options(bool create, const std::string& dir) {
  rocksdb::Options o;
  o.info_log = stderr_rocks_logger(dir);  // no LOG file: see storage/rocksdb_logger.h
  o.create_if_missing = create;
  o.paranoid_checks = true;
  o.max_background_jobs = 2;
  o.keep_log_file_num = 2;
  o.write_buffer_size = 4 << 20;
  o.max_write_buffer_number = 2;
  o.max_total_wal_size = 16 << 20;
  o.target_file_size_base = 4 << 20;
  o.max_bytes_for_level_base = 16 << 20;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  return o;  // auto compactions stay on: disk use follows the live records
}

// not_found when `dir` holds no database (and we are not to create one);
// an unreadable directory falls through to RocksDB's own error.
Status check_exists(const std::string& dir) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(std::filesystem::path(dir) / "CURRENT", ec);
  if (!ec && !exists) return Status(Code::not_found, "journal '" + dir + "': no journal there");
  return Status::Ok();
}

Status prepare_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  if (fs::exists(st) && !fs::is_directory(st))
    return Status(Code::io_error, "journal '" + dir + "': cannot open: not a directory");
  fs::create_directories(dir, ec);
  if (ec) {
    const bool full = ec == std::errc::no_space_on_device;
    return Status(Code::io_error, "journal '" + dir + "': cannot create the directory: " +
                                      (full ? "disk full (" + ec.message() + ")" : ec.message()));
  }
  return Status::Ok();
}

Status read_only_refusal(const std::string& dir, const char* what) {
  return Status(Code::unsupported, "journal '" + dir + "': opened read-only, " + what + " refused");
}

Status write(rocksdb::DB& db, const std::string& dir, rocksdb::WriteBatch& batch, bool sync,
             const char* what) {
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  const rocksdb::Status s = db.Write(wo, &batch);
  if (!s.ok()) return db_error(dir, std::string(what) + " failed", s);
  return Status::Ok();
}

}  // namespace

Journal::~Journal() {
  if (db_) db_->Close().PermitUncheckedError();
}

Result<std::unique_ptr<Journal>> Journal::open(const std::string& dir, bool create) {
  if (dir.empty()) return Status(Code::invalid_argument, "journal: empty directory path");
  CLEAVE_RETURN_IF_ERROR(create ? prepare_dir(dir) : check_exists(dir));
  rocksdb::DB* db = nullptr;
  const rocksdb::Status s = rocksdb::DB::Open(journal_options(create, dir), dir, &db);
  if (!s.ok()) return db_error(dir, "cannot open", s);
  std::unique_ptr<Journal> j(new Journal());
  j->dir_ = dir;
  j->db_.reset(db);
  return j;
}

Result<std::unique_ptr<Journal>> Journal::open_read_only(const std::string& dir) {
  if (dir.empty()) return Status(Code::invalid_argument, "journal: empty directory path");
  CLEAVE_RETURN_IF_ERROR(check_exists(dir));
  rocksdb::DB* db = nullptr;
  const rocksdb::Status s = rocksdb::DB::OpenForReadOnly(journal_options(false, dir), dir, &db);
  if (!s.ok()) return db_error(dir, "cannot open read-only", s);
  std::unique_ptr<Journal> j(new Journal());
  j->dir_ = dir;
  j->read_only_ = true;
  j->db_.reset(db);
  return j;
}

Result<JobMeta> Journal::meta() {
  std::string value;
  const rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), kMetaKey, &value);
  if (s.IsNotFound()) return Status(Code::not_found, "journal '" + dir_ + "': no job meta yet");
  if (!s.ok()) return db_error(dir_, "cannot read the job meta", s);
  auto m = decode_meta(value);
  if (!m.ok()) {  // "journal: job meta: ..." -> "journal '<dir>': job meta: ..."
    std::string why = m.status().message();
    if (why.rfind("journal: ", 0) == 0) why.erase(0, 9);
    return Status(m.status().code(), "journal '" + dir_ + "': " + why);
  }
  return m;
}

Result<std::map<uint64_t, RequestRecord>> Journal::records() {
  std::map<uint64_t, RequestRecord> out;
  rocksdb::ReadOptions ro;
  const std::string upper = "req0";  // '/' + 1: just past every "req/" key
  const rocksdb::Slice upper_slice(upper);
  ro.iterate_upper_bound = &upper_slice;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  for (it->Seek(kRecordPrefix); it->Valid(); it->Next()) {
    const rocksdb::Slice key = it->key();
    if (key.size() != kRecordKeyBytes) {
      ++counters_.corrupt_records;
      continue;
    }
    auto r = decode_record(it->value().ToString());
    if (!r.ok()) {
      ++counters_.corrupt_records;
      continue;
    }
    out.emplace(record_index(key), std::move(*r));
  }
  if (!it->status().ok()) return db_error(dir_, "cannot read the request records", it->status());
  return out;
}

Status Journal::commit(const std::vector<std::pair<uint64_t, RequestRecord>>& records,
                       const JobMeta* meta, bool sync) {
  if (read_only_) return read_only_refusal(dir_, "commit");
  rocksdb::WriteBatch batch;
  for (const auto& [index, record] : records) {
    const rocksdb::Status s = batch.Put(record_key(index), encode_record(record));
    if (!s.ok()) return db_error(dir_, "cannot build the commit", s);
  }
  if (meta) {
    const rocksdb::Status s = batch.Put(kMetaKey, encode_meta(*meta));
    if (!s.ok()) return db_error(dir_, "cannot build the commit", s);
  }
  if (!write_failure_.ok()) return write_failure_;
  Status st = write(*db_, dir_, batch, sync, "commit");
  if (!st.ok()) write_failure_ = st;
  return st;
}

Status Journal::erase(const std::vector<uint64_t>& indices, bool sync) {
  if (read_only_) return read_only_refusal(dir_, "erase");
  rocksdb::WriteBatch batch;
  for (uint64_t index : indices) {
    const rocksdb::Status s = batch.Delete(record_key(index));
    if (!s.ok()) return db_error(dir_, "cannot build the erase", s);
  }
  if (!write_failure_.ok()) return write_failure_;
  Status st = write(*db_, dir_, batch, sync, "erase");
  if (!st.ok()) write_failure_ = st;
  return st;
}

Status Journal::corrupt_for_testing(uint64_t index, size_t byte) {
  if (read_only_) return read_only_refusal(dir_, "corrupt_for_testing");
  const std::string key = record_key(index);
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &value);
  if (s.IsNotFound())
    return Status(Code::not_found, "journal '" + dir_ + "': no record " + std::to_string(index));
  if (!s.ok()) return db_error(dir_, "cannot read record " + std::to_string(index), s);
  if (value.empty())
    return Status(Code::invalid_argument,
                  "journal '" + dir_ + "': record " + std::to_string(index) + " is empty");
  value[byte % value.size()] ^= char(0xFF);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  s = db_->Put(wo, key, value);
  if (!s.ok()) return db_error(dir_, "cannot write record " + std::to_string(index), s);
  return Status::Ok();
}

}  // namespace cleave::jobs
