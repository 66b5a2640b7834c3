// RocksDB's info log, sent to stderr instead of a LOG file beside the data:
// a LOG file on a full disk makes Debian's RocksDB (built with assertions)
// abort in its logger after the first failed write, and a job must stop with
// an error there, not crash. Errors only, one line each,
// prefixed with the database's directory.
#pragma once

#include <rocksdb/env.h>

#include <cstdarg>
#include <cstdio>
#include <memory>
#include <string>

namespace cleave {

class StderrRocksLogger : public rocksdb::Logger {
 public:
  explicit StderrRocksLogger(std::string dir) : Logger(rocksdb::InfoLogLevel::ERROR_LEVEL), dir_(std::move(dir)) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[512];
    std::vsnprintf(buf, sizeof buf, format, ap);
    std::fprintf(stderr, "cleave rocksdb %s: %s\n", dir_.c_str(), buf);
  }

 private:
  std::string dir_;
};

inline std::shared_ptr<rocksdb::Logger> stderr_rocks_logger(const std::string& dir) {
  return std::make_shared<StderrRocksLogger>(dir);
}

}  // namespace cleave
