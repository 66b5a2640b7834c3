#include "jobs/file_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <mutex>
#include <random>

namespace cleave::jobs {
namespace {

using json = nlohmann::json;

}  // namespace

std::string random_hex(int digits) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < digits; ++i) out.push_back(hex[rng() & 15]);
  return out;
}


std::string FileObject::json() const {
  nlohmann::json o = {{"id", id},           {"object", "file"},   {"bytes", bytes}, {"created_at", created_at},
                      {"filename", filename}, {"purpose", purpose}, {"status", "processed"}};
  return o.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Result<std::string> read_file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(Code::io_error, "cannot open " + path);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return Status(Code::io_error, "cannot read " + path);
  return bytes;
}

Status write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status(Code::io_error, "cannot write " + tmp + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Status(Code::io_error, "cannot write " + tmp + ": " +
                                        (err == ENOSPC ? std::string("disk full") : std::strerror(err)));
    }
    done += size_t(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return Status(Code::io_error, "cannot write " + path + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

bool FileStore::valid_id(std::string_view id) {
  if (id.size() != 29 || id.substr(0, 5) != "file-") return false;
  for (char c : id.substr(5))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

Result<FileStore> FileStore::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status(Code::io_error, "cannot create " + dir + ": " + ec.message());
  FileStore s;
  s.dir_ = dir;
  return s;
}

Result<FileObject> FileStore::create(std::string_view bytes, const std::string& filename,
                                     const std::string& purpose) {
  FileObject f;
  f.id = "file-" + random_hex(24);
  f.filename = filename;
  f.purpose = purpose;
  f.bytes = bytes.size();
  f.created_at = std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  CLEAVE_RETURN_IF_ERROR(write_file_atomic(dir_ + "/" + f.id, bytes));
  CLEAVE_RETURN_IF_ERROR(write_file_atomic(dir_ + "/" + f.id + ".json", f.json()));
  return f;
}

Result<FileObject> FileStore::get(const std::string& id) const {
  if (!valid_id(id)) return Status(Code::not_found, "no file " + id.substr(0, 64));
  auto text = read_file_bytes(dir_ + "/" + id + ".json");
  if (!text.ok()) return Status(Code::not_found, "no file " + id);
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status(Code::corruption, "the record of file " + id + " is damaged");
  FileObject f;
  try {
    f.id = j.at("id").get<std::string>();
    f.filename = j.at("filename").get<std::string>();
    f.purpose = j.at("purpose").get<std::string>();
    f.bytes = j.at("bytes").get<uint64_t>();
    f.created_at = j.at("created_at").get<int64_t>();
  } catch (const json::exception&) {
    return Status(Code::corruption, "the record of file " + id + " is damaged");
  }
  return f;
}

Result<std::string> FileStore::content_path(const std::string& id) const {
  auto f = get(id);
  if (!f.ok()) return f.status();
  return dir_ + "/" + id;
}

}  // namespace cleave::jobs
