// GGUF v3: a validating reader over mmap and a writer.
// Every malformed file yields a Status (code corruption, or io_error for
// open/mmap failures) whose message starts with "gguf: " and names the
// problem and the values involved. Nothing is read past the file's end.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace cleave {

enum class GgufType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value. Scalars keep their exact value in the matching field;
// arrays keep their elements (numbers widened, strings as strings).
struct GgufValue {
  GgufType type = GgufType::UINT32;
  GgufType array_type = GgufType::UINT32;  // element type when type == ARRAY
  uint64_t u = 0;                          // UINT*, BOOL
  int64_t i = 0;                           // INT*
  double f = 0;                            // FLOAT*
  std::string s;                           // STRING
  std::vector<uint64_t> arr_u;             // array of UINT* / BOOL
  std::vector<int64_t> arr_i;              // array of INT*
  std::vector<double> arr_f;               // array of FLOAT*
  std::vector<std::string> arr_s;          // array of STRING
  uint64_t array_len() const;
};

struct GgufKv {
  std::string key;
  GgufValue value;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};  // innermost first
  DType type = DType::F32;
  uint64_t offset = 0;  // relative to the data section
  uint64_t bytes = 0;
  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

class GgufFile {
 public:
  // Open, mmap and validate the whole header and tensor table.
  static Result<std::shared_ptr<const GgufFile>> open(const std::string& path);
  // Validate an in-memory image (same checks; the buffer must outlive the file).
  static Result<std::shared_ptr<const GgufFile>> parse(const uint8_t* data, size_t size);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }
  const uint8_t* data() const { return base_; }  // the whole file image (file_size bytes)
  // Over an mmap: gives this process's resident pages of the file back to
  // the page cache (madvise MADV_DONTNEED; a later read faults them in
  // again), so that after reading the whole file once (its fingerprint) a
  // process keeps resident only the tensors it computes with: an attention
  // node not its experts', an expert node only its own. A no-op in memory.
  void release_resident_pages() const;
  // The same for the whole pages inside [p, p + bytes), when that range lies
  // in the mapping (anything else: a no-op).
  void release_pages(const void* p, size_t bytes) const;
  uint64_t data_offset() const { return data_offset_; }

  const std::vector<GgufKv>& metadata() const { return kvs_; }
  const GgufKv* find(std::string_view key) const;

  // Typed getters: not_found when absent, invalid_argument (naming the key,
  // the stored type and the expected one) when the type does not fit.
  Result<std::string> get_string(std::string_view key) const;
  Result<uint64_t> get_uint(std::string_view key) const;   // any integer type, value >= 0
  Result<int64_t> get_int(std::string_view key) const;     // any integer type
  Result<double> get_float(std::string_view key) const;    // FLOAT32/FLOAT64
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;
  Result<std::vector<float>> get_float_array(std::string_view key) const;
  Result<std::vector<int32_t>> get_int_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  const uint8_t* tensor_data(const GgufTensorInfo& t) const { return base_ + data_offset_ + t.offset; }
  // A 2-D view of a tensor (ne[0] = cols, rows = ne[1]*ne[2]*ne[3]).
  WeightView view(const GgufTensorInfo& t) const;

 private:
  GgufFile() = default;
  friend class GgufParser;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // munmap on destruction when set
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<GgufKv> kvs_;
  std::vector<GgufTensorInfo> tensors_;
};

// Writes GGUF v3 files the way llama.cpp's gguf writer does (alignment from
// general.alignment, default 32; tensor data padded to it).
class GgufWriter {
 public:
  void set(std::string key, GgufValue value);
  void set_string(std::string key, std::string v);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_f32(std::string key, float v);
  void set_bool(std::string key, bool v);
  void set_string_array(std::string key, std::vector<std::string> v);
  void set_f32_array(std::string key, std::vector<float> v);
  void set_i32_array(std::string key, std::vector<int32_t> v);
  // ne innermost first; data.size() must equal the tensor's byte size.
  void add_tensor(std::string name, DType type, std::vector<int64_t> ne, std::vector<uint8_t> data);
  Status write(const std::string& path) const;

 private:
  std::vector<GgufKv> kvs_;
  struct Tensor {
    std::string name;
    DType type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;
  };
  std::vector<Tensor> tensors_;
};

}  // namespace cleave
