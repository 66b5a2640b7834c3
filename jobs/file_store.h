// The files of the Batch API (POST /v1/files, GET /v1/files/{id}[/content]):
// DIR/<id> holds the bytes, DIR/<id>.json the File object; both written to a
// temporary name, fsync'd and renamed, so a kill leaves a file whole or
// absent. Ids are "file-" and 24 random hex digits; a name that is not one
// is not_found (nothing outside DIR is ever read).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"

namespace cleave::jobs {

struct FileObject {
  std::string id, filename, purpose;
  uint64_t bytes = 0;
  int64_t created_at = 0;
  std::string json() const;  // OpenAI's File object
};

class FileStore {
 public:
  // Creates DIR when absent; io_error naming it otherwise.
  static Result<FileStore> open(const std::string& dir);
  Result<FileObject> create(std::string_view bytes, const std::string& filename, const std::string& purpose);
  Result<FileObject> get(const std::string& id) const;
  // The path of a file's bytes (not_found when there is no such file).
  Result<std::string> content_path(const std::string& id) const;
  // Whether `id` has a file id's form.
  static bool valid_id(std::string_view id);

 private:
  std::string dir_;
};

// `digits` random lowercase hex digits (ids of files and batches).
std::string random_hex(int digits);

// Reads a whole file; io_error naming it.
Result<std::string> read_file_bytes(const std::string& path);
// Writes bytes to path atomically (temporary name, fsync, rename).
Status write_file_atomic(const std::string& path, std::string_view bytes);

}  // namespace cleave::jobs
