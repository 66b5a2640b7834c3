#include "jobs/result_log.h"

#include "jobs/fault_point.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

namespace cleave::jobs {
namespace {

constexpr size_t kScanChunk = 64 << 10;

std::string errno_text(int err) {
  std::string text = std::strerror(err);
  return err == ENOSPC ? "disk full (" + text + ")" : text;
}

Status io_error(const std::string& path, const std::string& what, int err) {
  return Status(Code::io_error, "result log '" + path + "': " + what + ": " + errno_text(err));
}

Status sync_fd(int fd, const std::string& path, const std::string& what) {
  while (::fdatasync(fd) != 0)
    if (errno != EINTR) return io_error(path, what, errno);
  return Status::Ok();
}

// Makes a new file's directory entry durable (fdatasync covers only the data).
Status sync_parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error(path, "cannot open its directory '" + dir + "'", errno);
  Status s;
  while (::fsync(fd) != 0)
    if (errno != EINTR) {
      s = io_error(path, "cannot sync its directory '" + dir + "'", errno);
      break;
    }
  ::close(fd);
  return s;
}

std::string custom_id_of(std::string_view line) {
  const auto j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
  if (!j.is_object()) return {};
  const auto it = j.find("custom_id");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

ResultLog::~ResultLog() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<ResultLog>> ResultLog::open(const std::string& path,
                                                   uint64_t committed_bytes) {
  if (path.empty()) return Status(Code::invalid_argument, "result log: empty path");
  struct stat st {};
  const bool existed = ::stat(path.c_str(), &st) == 0;
  std::unique_ptr<ResultLog> log(new ResultLog());
  log->path_ = path;
  log->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (log->fd_ < 0) return io_error(path, "cannot open", errno);
  if (::fstat(log->fd_, &st) != 0) return io_error(path, "cannot stat", errno);
  if (!S_ISREG(st.st_mode))
    return Status(Code::io_error, "result log '" + path + "': not a regular file");
  const auto length = uint64_t(st.st_size);
  if (length < committed_bytes)
    return Status(Code::corruption, "result log '" + path + "' is " + std::to_string(length) +
                                        " bytes, shorter than its committed length of " +
                                        std::to_string(committed_bytes) +
                                        " bytes (changed by someone else)");
  if (length > committed_bytes) {  // a partial line or lines never committed
    if (::ftruncate(log->fd_, off_t(committed_bytes)) != 0)
      return io_error(path, "cannot cut to " + std::to_string(committed_bytes) + " bytes", errno);
    CLEAVE_RETURN_IF_ERROR(sync_fd(log->fd_, path, "cannot sync after the cut"));
  }
  if (!existed) CLEAVE_RETURN_IF_ERROR(sync_parent(path));
  log->size_ = committed_bytes;
  return log;
}

Result<uint64_t> ResultLog::append(std::string_view bytes) {
  if (bytes.empty()) return size_;
  const uint64_t start = size_;
  size_t done = 0;
  Status failure;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, off_t(start + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      failure = io_error(path_,
                         "cannot write " + std::to_string(bytes.size()) + " bytes at offset " +
                             std::to_string(start),
                         n < 0 ? errno : EIO);
      break;
    }
    done += size_t(n);
  }
  if (failure.ok()) {
    fault_point("result.after_write");  // written, not yet synced
    failure = sync_fd(fd_, path_, "cannot sync the appended lines");
  }
  if (!failure.ok()) {
    // Leave no partial line for the next append (best effort: the error stands).
    if (::ftruncate(fd_, off_t(start)) == 0) sync_fd(fd_, path_, "").ok();
    return failure;
  }
  size_ = start + bytes.size();
  return size_;
}

Result<std::vector<ResultLog::Line>> ResultLog::scan(const std::string& path, uint64_t upto) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error(path, "cannot open for reading", errno);
  std::vector<Line> lines;
  std::string line;  // the current line so far
  std::string chunk(kScanChunk, '\0');
  uint64_t offset = 0;
  Status failure;
  while (offset < upto) {
    const size_t want = size_t(std::min<uint64_t>(kScanChunk, upto - offset));
    const ssize_t n = ::pread(fd, chunk.data(), want, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      failure = io_error(path, "cannot read at offset " + std::to_string(offset), errno);
      break;
    }
    if (n == 0) break;  // the file ends before `upto`
    const std::string_view data(chunk.data(), size_t(n));
    size_t from = 0;  // the bytes of `data` before `from` are consumed
    for (size_t nl; (nl = data.find('\n', from)) != std::string_view::npos; from = nl + 1) {
      line.append(data.substr(from, nl - from));
      lines.push_back({offset + nl + 1, custom_id_of(line)});
      line.clear();
    }
    line.append(data.substr(from));
    offset += uint64_t(n);
  }
  ::close(fd);
  if (!failure.ok()) return failure;
  return lines;
}

}  // namespace cleave::jobs
