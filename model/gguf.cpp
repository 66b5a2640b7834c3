// GGUF v3 reader (validating, over mmap or an in-memory image); the writer
// is model/gguf_writer.cpp.
#include "model/gguf.h"

#include "model/gguf_format.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cstdarg>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_set>

namespace cleave {

namespace gguf_detail {

std::string fmt(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  char buf[512];
  int n = std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  if (n < 0) return "gguf: (format error)";
  if (static_cast<size_t>(n) < sizeof buf) return std::string(buf, n);
  std::string s(static_cast<size_t>(n) + 1, '\0');
  va_start(ap, f);
  std::vsnprintf(s.data(), s.size(), f, ap);
  va_end(ap);
  s.resize(n);
  return s;
}

bool is_known_type(uint32_t t) {
  return t <= static_cast<uint32_t>(GgufType::FLOAT64);
}

bool is_uint_type(GgufType t) {
  return t == GgufType::UINT8 || t == GgufType::UINT16 || t == GgufType::UINT32 ||
         t == GgufType::UINT64;
}
bool is_sint_type(GgufType t) {
  return t == GgufType::INT8 || t == GgufType::INT16 || t == GgufType::INT32 ||
         t == GgufType::INT64;
}
bool is_float_type(GgufType t) {
  return t == GgufType::FLOAT32 || t == GgufType::FLOAT64;
}

std::string type_desc(const GgufValue& v) {
  if (v.type == GgufType::ARRAY) return std::string("ARRAY of ") + gguf_type_name(v.array_type);
  return gguf_type_name(v.type);
}

}  // namespace gguf_detail

using namespace gguf_detail;

namespace {

constexpr uint64_t kMaxKeyLen = 64 * 1024;            // keys and tensor names
constexpr uint64_t kMaxStringLen = 16 * 1024 * 1024;  // string values
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;           // key length, type, smallest value
constexpr uint64_t kMinTensorInfoBytes =
    8 + 4 + 8 + 4 + 8;  // name len, n_dims, 1 dim, type, offset
Status corrupt(std::string msg) {
  return Status(Code::corruption, "gguf: " + std::move(msg));
}

// Printable form of a name from the file, bounded in length.
std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 80; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    }
  }
  if (s.size() > 80) out += "...";
  return out;
}

// Bytes of a fixed-size scalar, 0 for STRING / ARRAY.
uint64_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::BOOL:
      return 1;
    case GgufType::UINT16:
    case GgufType::INT16:
      return 2;
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::FLOAT32:
      return 4;
    case GgufType::UINT64:
    case GgufType::INT64:
    case GgufType::FLOAT64:
      return 8;
    case GgufType::STRING:
    case GgufType::ARRAY:
      return 0;
  }
  return 0;
}


}  // namespace

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
      return "UINT8";
    case GgufType::INT8:
      return "INT8";
    case GgufType::UINT16:
      return "UINT16";
    case GgufType::INT16:
      return "INT16";
    case GgufType::UINT32:
      return "UINT32";
    case GgufType::INT32:
      return "INT32";
    case GgufType::FLOAT32:
      return "FLOAT32";
    case GgufType::BOOL:
      return "BOOL";
    case GgufType::STRING:
      return "STRING";
    case GgufType::ARRAY:
      return "ARRAY";
    case GgufType::UINT64:
      return "UINT64";
    case GgufType::INT64:
      return "INT64";
    case GgufType::FLOAT64:
      return "FLOAT64";
  }
  return "UNKNOWN";
}

uint64_t GgufValue::array_len() const {
  if (type != GgufType::ARRAY) return 0;
  if (array_type == GgufType::STRING) return arr_s.size();
  if (is_float_type(array_type)) return arr_f.size();
  if (is_sint_type(array_type)) return arr_i.size();
  return arr_u.size();
}

// ---------------------------------------------------------------------------
// Reader

class GgufParser {
 public:
  GgufParser(const uint8_t* data, size_t size) : p_(data), size_(size) {}

  Status parse(GgufFile& f);

 private:
  uint64_t remaining() const { return size_ - pos_; }

  Status need(uint64_t n, const char* what) {
    if (n > remaining()) {
      return corrupt(fmt("truncated reading %s at offset %zu: need %" PRIu64 " bytes, %" PRIu64
                         " left (file size %zu)",
                         what, pos_, n, remaining(), size_));
    }
    return Status::Ok();
  }
  template <class T>
  Status read(T& out, const char* what) {
    CLEAVE_RETURN_IF_ERROR(need(sizeof(T), what));
    std::memcpy(&out, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status read_string(std::string& out, uint64_t limit, const char* what);
  Status read_scalar(GgufType t, GgufValue& v, const char* what);
  Status read_value(GgufType t, GgufValue& v, const std::string& key);

  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
};

Status GgufParser::read_string(std::string& out, uint64_t limit, const char* what) {
  size_t at = pos_;
  uint64_t len = 0;
  char lwhat[96];
  std::snprintf(lwhat, sizeof lwhat, "%s length", what);
  CLEAVE_RETURN_IF_ERROR(read(len, lwhat));
  if (len > limit) {
    return corrupt(fmt("%s length %" PRIu64 " at offset %zu exceeds the limit %" PRIu64, what, len,
                       at, limit));
  }
  if (len > remaining()) {
    return corrupt(fmt("truncated reading %s of %" PRIu64 " bytes at offset %zu: %" PRIu64
                       " bytes left (file size %zu)",
                       what, len, pos_, remaining(), size_));
  }
  out.assign(reinterpret_cast<const char*>(p_ + pos_), len);
  pos_ += len;
  return Status::Ok();
}

Status GgufParser::read_scalar(GgufType t, GgufValue& v, const char* what) {
  switch (t) {
    case GgufType::UINT8: {
      uint8_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.u = x;
      break;
    }
    case GgufType::UINT16: {
      uint16_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.u = x;
      break;
    }
    case GgufType::UINT32: {
      uint32_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.u = x;
      break;
    }
    case GgufType::UINT64: {
      uint64_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.u = x;
      break;
    }
    case GgufType::INT8: {
      int8_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.i = x;
      break;
    }
    case GgufType::INT16: {
      int16_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.i = x;
      break;
    }
    case GgufType::INT32: {
      int32_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.i = x;
      break;
    }
    case GgufType::INT64: {
      int64_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.i = x;
      break;
    }
    case GgufType::FLOAT32: {
      float x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.f = x;
      break;
    }
    case GgufType::FLOAT64: {
      double x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      v.f = x;
      break;
    }
    case GgufType::BOOL: {
      size_t at = pos_;
      uint8_t x = 0;
      CLEAVE_RETURN_IF_ERROR(read(x, what));
      if (x > 1) return corrupt(fmt("%s: bool value %u at offset %zu is not 0 or 1", what, x, at));
      v.u = x;
      break;
    }
    default:
      return corrupt(fmt("%s: internal: not a scalar type", what));
  }
  return Status::Ok();
}

Status GgufParser::read_value(GgufType t, GgufValue& v, const std::string& key) {
  v.type = t;
  std::string what = "value of key '" + printable(key) + "'";
  if (t == GgufType::STRING) return read_string(v.s, kMaxStringLen, what.c_str());
  if (t != GgufType::ARRAY) return read_scalar(t, v, what.c_str());

  size_t at = pos_;
  uint32_t et_raw = 0;
  uint64_t count = 0;
  CLEAVE_RETURN_IF_ERROR(read(et_raw, "array element type"));
  if (!is_known_type(et_raw)) {
    return corrupt(fmt("key '%s': unknown array element type %u at offset %zu",
                       printable(key).c_str(), et_raw, at));
  }
  GgufType et = static_cast<GgufType>(et_raw);
  if (et == GgufType::ARRAY) {
    return corrupt(fmt("key '%s': nested array (array of ARRAY) at offset %zu is not supported",
                       printable(key).c_str(), at));
  }
  v.array_type = et;
  size_t count_at = pos_;
  CLEAVE_RETURN_IF_ERROR(read(count, "array count"));
  uint64_t elem_min = et == GgufType::STRING ? 8 : scalar_size(et);
  if (count > remaining() / elem_min) {
    return corrupt(fmt("key '%s': array count %" PRIu64 " at offset %zu of %s elements (>= %" PRIu64
                       " bytes each) is too large for the %" PRIu64 " bytes left",
                       printable(key).c_str(), count, count_at, gguf_type_name(et), elem_min,
                       remaining()));
  }
  std::string ewhat = "element of array '" + printable(key) + "'";
  if (et == GgufType::STRING) {
    v.arr_s.resize(count);
    for (uint64_t i = 0; i < count; ++i) {
      CLEAVE_RETURN_IF_ERROR(read_string(v.arr_s[i], kMaxStringLen, ewhat.c_str()));
    }
    return Status::Ok();
  }
  GgufValue e;
  if (is_float_type(et))
    v.arr_f.reserve(count);
  else if (is_sint_type(et))
    v.arr_i.reserve(count);
  else
    v.arr_u.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    CLEAVE_RETURN_IF_ERROR(read_scalar(et, e, ewhat.c_str()));
    if (is_float_type(et))
      v.arr_f.push_back(e.f);
    else if (is_sint_type(et))
      v.arr_i.push_back(e.i);
    else
      v.arr_u.push_back(e.u);
  }
  return Status::Ok();
}

Status GgufParser::parse(GgufFile& f) {
  f.base_ = p_;
  f.size_ = size_;
  if (size_ == 0) return corrupt("empty file (0 bytes)");
  if (size_ < 4) {
    return corrupt(fmt("truncated reading magic at offset 0: need 4 bytes, file size %zu", size_));
  }
  if (std::memcmp(p_, "GGUF", 4) != 0) {
    return corrupt(fmt("bad magic %02x %02x %02x %02x ('%s'), expected 'GGUF'", p_[0], p_[1], p_[2],
                       p_[3],
                       printable(std::string_view(reinterpret_cast<const char*>(p_), 4)).c_str()));
  }
  pos_ = 4;
  uint32_t version = 0;
  CLEAVE_RETURN_IF_ERROR(read(version, "version"));
  if (version != 2 && version != 3) {
    return corrupt(fmt("unsupported version %u (supported: 2, 3)", version));
  }
  f.version_ = version;
  uint64_t n_tensors = 0, n_kv = 0;
  CLEAVE_RETURN_IF_ERROR(read(n_tensors, "tensor count"));
  CLEAVE_RETURN_IF_ERROR(read(n_kv, "metadata count"));
  if (n_kv > remaining() / kMinKvBytes) {
    return corrupt(fmt("n_kv %" PRIu64 " is too large for the %" PRIu64
                       " bytes left in the file (each key/value needs >= %" PRIu64 ")",
                       n_kv, remaining(), kMinKvBytes));
  }
  if (n_tensors > remaining() / kMinTensorInfoBytes) {
    return corrupt(fmt("n_tensors %" PRIu64 " is too large for the %" PRIu64
                       " bytes left in the file (each tensor info needs >= %" PRIu64 ")",
                       n_tensors, remaining(), kMinTensorInfoBytes));
  }

  // Metadata.
  std::unordered_set<std::string> keys;
  f.kvs_.reserve(n_kv);
  for (uint64_t k = 0; k < n_kv; ++k) {
    GgufKv kv;
    size_t key_at = pos_;
    CLEAVE_RETURN_IF_ERROR(read_string(kv.key, kMaxKeyLen, "key"));
    if (!keys.insert(kv.key).second) {
      return corrupt(fmt("duplicate key '%s' at offset %zu", printable(kv.key).c_str(), key_at));
    }
    size_t type_at = pos_;
    uint32_t t = 0;
    CLEAVE_RETURN_IF_ERROR(read(t, "value type"));
    if (!is_known_type(t)) {
      return corrupt(fmt("key '%s': unknown value type %u at offset %zu", printable(kv.key).c_str(),
                         t, type_at));
    }
    CLEAVE_RETURN_IF_ERROR(read_value(static_cast<GgufType>(t), kv.value, kv.key));
    f.kvs_.push_back(std::move(kv));
  }

  // Alignment.
  uint64_t alignment = kDefaultAlignment;
  if (const GgufKv* a = f.find("general.alignment")) {
    const GgufValue& v = a->value;
    if (is_uint_type(v.type)) {
      alignment = v.u;
    } else if (is_sint_type(v.type)) {
      if (v.i <= 0)
        return corrupt(fmt("general.alignment %" PRId64 " is not a positive power of two", v.i));
      alignment = static_cast<uint64_t>(v.i);
    } else {
      return corrupt(
          fmt("general.alignment has type %s, expected an integer (UINT32)", type_desc(v).c_str()));
    }
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      return corrupt(
          fmt("general.alignment %" PRIu64 " is not a positive power of two", alignment));
    }
  }
  f.alignment_ = alignment;

  // Tensor infos.
  if (n_tensors > remaining() / kMinTensorInfoBytes) {
    return corrupt(fmt("n_tensors %" PRIu64 " is too large for the %" PRIu64
                       " bytes left after the metadata (each tensor info needs >= %" PRIu64 ")",
                       n_tensors, remaining(), kMinTensorInfoBytes));
  }
  std::unordered_set<std::string> names;
  f.tensors_.reserve(n_tensors);
  for (uint64_t ti = 0; ti < n_tensors; ++ti) {
    GgufTensorInfo t;
    size_t name_at = pos_;
    CLEAVE_RETURN_IF_ERROR(read_string(t.name, kMaxKeyLen, "tensor name"));
    if (!names.insert(t.name).second) {
      return corrupt(
          fmt("duplicate tensor name '%s' at offset %zu", printable(t.name).c_str(), name_at));
    }
    std::string nm = printable(t.name);
    size_t nd_at = pos_;
    CLEAVE_RETURN_IF_ERROR(read(t.n_dims, "tensor n_dims"));
    if (t.n_dims == 0 || t.n_dims > 4) {
      return corrupt(fmt("tensor '%s' has n_dims %u at offset %zu (must be 1..4)", nm.c_str(),
                         t.n_dims, nd_at));
    }
    int64_t n_el = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      uint64_t ne = 0;
      CLEAVE_RETURN_IF_ERROR(read(ne, "tensor dimension"));
      if (ne == 0 || ne > static_cast<uint64_t>(INT64_MAX)) {
        return corrupt(fmt("tensor '%s' dim %u is %" PRId64 " (must be > 0)", nm.c_str(), d,
                           static_cast<int64_t>(ne)));
      }
      t.ne[d] = static_cast<int64_t>(ne);
      if (__builtin_mul_overflow(n_el, t.ne[d], &n_el)) {
        return corrupt(fmt("tensor '%s' element count overflows int64 (ne = %" PRId64 " x %" PRId64
                           " x %" PRId64 " x %" PRId64 ")",
                           nm.c_str(), t.ne[0], t.ne[1], t.ne[2], t.ne[3]));
      }
    }
    size_t type_at = pos_;
    uint32_t type_id = 0;
    CLEAVE_RETURN_IF_ERROR(read(type_id, "tensor type"));
    if (!dtype_known(type_id)) {
      return corrupt(
          fmt("tensor '%s' has unknown or unsupported type id %u at offset %zu "
              "(supported: F32=0, F16=1, Q8_0=8, BF16=30)",
              nm.c_str(), type_id, type_at));
    }
    t.type = static_cast<DType>(type_id);
    CLEAVE_RETURN_IF_ERROR(read(t.offset, "tensor offset"));
    int64_t blk = dtype_block_elems(t.type);
    if (t.ne[0] % blk != 0) {
      return corrupt(fmt("tensor '%s' of type %s: ne[0] %" PRId64
                         " is not a multiple of the block size %" PRId64,
                         nm.c_str(), dtype_name(t.type), t.ne[0], blk));
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(n_el / blk),
                               static_cast<uint64_t>(dtype_block_bytes(t.type)), &bytes) ||
        bytes > static_cast<uint64_t>(INT64_MAX)) {
      return corrupt(fmt("tensor '%s' byte size overflows (%" PRId64 " elements of %s)", nm.c_str(),
                         n_el, dtype_name(t.type)));
    }
    t.bytes = bytes;
    if (t.offset % alignment != 0) {
      return corrupt(fmt("tensor '%s' offset %" PRIu64 " is not aligned to %" PRIu64, nm.c_str(),
                         t.offset, alignment));
    }
    f.tensors_.push_back(std::move(t));
  }

  // Data section.
  uint64_t data_offset = 0;
  uint64_t pad = (alignment - pos_ % alignment) % alignment;
  if (__builtin_add_overflow(static_cast<uint64_t>(pos_), pad, &data_offset))
    data_offset = UINT64_MAX;
  if (data_offset > size_) {
    if (!f.tensors_.empty()) {
      return corrupt(fmt("data section start %" PRIu64 " (header end %zu aligned to %" PRIu64
                         ") is beyond the file end %zu",
                         data_offset, pos_, alignment, size_));
    }
    data_offset = size_;  // vocab-only files may end without padding
  }
  f.data_offset_ = data_offset;
  uint64_t data_size = size_ - data_offset;
  for (const GgufTensorInfo& t : f.tensors_) {
    if (t.offset > data_size) {
      return corrupt(fmt("tensor '%s' offset %" PRIu64
                         " is beyond the end of the data section (%" PRIu64 " bytes)",
                         printable(t.name).c_str(), t.offset, data_size));
    }
    if (t.bytes > data_size - t.offset) {
      return corrupt(fmt("tensor '%s' data [%" PRIu64 ", +%" PRIu64
                         ") exceeds the data section size %" PRIu64,
                         printable(t.name).c_str(), t.offset, t.bytes, data_size));
    }
  }
  std::vector<size_t> order(f.tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensorInfo& a = f.tensors_[order[k - 1]];
    const GgufTensorInfo& b = f.tensors_[order[k]];
    if (a.offset + a.bytes > b.offset) {
      return corrupt(fmt("tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64
                         ") overlap",
                         printable(a.name).c_str(), a.offset, a.offset + a.bytes,
                         printable(b.name).c_str(), b.offset, b.offset + b.bytes));
    }
  }
  return Status::Ok();
}

Result<std::shared_ptr<const GgufFile>> GgufFile::parse(const uint8_t* data, size_t size) {
  std::shared_ptr<GgufFile> f(new GgufFile());
  if (data == nullptr && size != 0) return Status(Code::invalid_argument, "gguf: null buffer");
  static const uint8_t kEmpty = 0;
  GgufParser p(data ? data : &kEmpty, size);
  Status st = p.parse(*f);
  if (!st.ok()) return st;
  return std::shared_ptr<const GgufFile>(std::move(f));
}

Result<std::shared_ptr<const GgufFile>> GgufFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return Status(Code::io_error,
                  fmt("gguf: cannot open '%s': %s", path.c_str(), std::strerror(errno)));
  }
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    int e = errno;
    ::close(fd);
    return Status(Code::io_error,
                  fmt("gguf: cannot stat '%s': %s", path.c_str(), std::strerror(e)));
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status(Code::io_error, fmt("gguf: '%s' is not a regular file", path.c_str()));
  }
  size_t size = static_cast<size_t>(sb.st_size);
  std::shared_ptr<GgufFile> f(new GgufFile());
  if (size > 0) {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return Status(Code::io_error, fmt("gguf: cannot mmap '%s' (%zu bytes): %s", path.c_str(),
                                        size, std::strerror(e)));
    }
    f->mapping_ = m;
  }
  ::close(fd);
  static const uint8_t kEmpty = 0;
  const uint8_t* base = f->mapping_ ? static_cast<const uint8_t*>(f->mapping_) : &kEmpty;
  GgufParser p(base, size);
  Status st = p.parse(*f);
  if (!st.ok()) return Status(st.code(), st.message() + " (file '" + path + "')");
  return std::shared_ptr<const GgufFile>(std::move(f));
}

void GgufFile::release_resident_pages() const {
  if (mapping_) ::madvise(mapping_, size_, MADV_DONTNEED);  // advice: a failure changes nothing
}

void GgufFile::release_pages(const void* p, size_t bytes) const {
  if (!mapping_) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(mapping_), a = reinterpret_cast<uintptr_t>(p);
  if (a < base || a + bytes > base + size_ || a + bytes < a) return;
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (a + page - 1) / page * page, hi = (a + bytes) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advice only
}

GgufFile::~GgufFile() {
  if (mapping_) ::munmap(mapping_, size_);
}

const GgufKv* GgufFile::find(std::string_view key) const {
  for (const GgufKv& kv : kvs_) {
    if (kv.key == key) return &kv;
  }
  return nullptr;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  for (const GgufTensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

namespace {

Status not_found(std::string_view key) {
  return Status(Code::not_found, "gguf: key '" + std::string(key) + "' not found");
}
Status mismatch(std::string_view key, const GgufValue& v, const char* expected) {
  return Status(Code::invalid_argument, "gguf: key '" + std::string(key) + "' has type " +
                                            type_desc(v) + ", expected " + expected);
}

}  // namespace

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  if (kv->value.type != GgufType::STRING) return mismatch(key, kv->value, "STRING");
  return kv->value.s;
}

Result<uint64_t> GgufFile::get_uint(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  const GgufValue& v = kv->value;
  if (is_uint_type(v.type)) return v.u;
  if (is_sint_type(v.type)) {
    if (v.i < 0) {
      return Status(Code::invalid_argument,
                    fmt("gguf: key '%s' has negative value %" PRId64
                        " (type %s), expected an unsigned integer",
                        std::string(key).c_str(), v.i, gguf_type_name(v.type)));
    }
    return static_cast<uint64_t>(v.i);
  }
  return mismatch(key, v, "an unsigned integer");
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  const GgufValue& v = kv->value;
  if (is_sint_type(v.type)) return v.i;
  if (is_uint_type(v.type)) {
    if (v.u > static_cast<uint64_t>(INT64_MAX)) {
      return Status(Code::invalid_argument,
                    fmt("gguf: key '%s' value %" PRIu64 " (type %s) does not fit INT64",
                        std::string(key).c_str(), v.u, gguf_type_name(v.type)));
    }
    return static_cast<int64_t>(v.u);
  }
  return mismatch(key, v, "an integer");
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  if (!is_float_type(kv->value.type)) return mismatch(key, kv->value, "FLOAT32 or FLOAT64");
  return kv->value.f;
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  if (kv->value.type != GgufType::BOOL) return mismatch(key, kv->value, "BOOL");
  return kv->value.u != 0;
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  const GgufValue& v = kv->value;
  if (v.type != GgufType::ARRAY || v.array_type != GgufType::STRING) {
    return mismatch(key, v, "ARRAY of STRING");
  }
  return v.arr_s;
}

Result<std::vector<float>> GgufFile::get_float_array(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  const GgufValue& v = kv->value;
  if (v.type != GgufType::ARRAY || !is_float_type(v.array_type)) {
    return mismatch(key, v, "ARRAY of FLOAT32 or FLOAT64");
  }
  return std::vector<float>(v.arr_f.begin(), v.arr_f.end());
}

Result<std::vector<int32_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufKv* kv = find(key);
  if (!kv) return not_found(key);
  const GgufValue& v = kv->value;
  if (v.type != GgufType::ARRAY || !(is_uint_type(v.array_type) || is_sint_type(v.array_type))) {
    return mismatch(key, v, "ARRAY of an integer type");
  }
  std::vector<int32_t> out;
  if (is_uint_type(v.array_type)) {
    out.reserve(v.arr_u.size());
    for (size_t i = 0; i < v.arr_u.size(); ++i) {
      if (v.arr_u[i] > static_cast<uint64_t>(INT32_MAX)) {
        return Status(
            Code::invalid_argument,
            fmt("gguf: key '%s' element %zu value %" PRIu64 " (type %s) does not fit INT32",
                std::string(key).c_str(), i, v.arr_u[i], gguf_type_name(v.array_type)));
      }
      out.push_back(static_cast<int32_t>(v.arr_u[i]));
    }
  } else {
    out.reserve(v.arr_i.size());
    for (size_t i = 0; i < v.arr_i.size(); ++i) {
      if (v.arr_i[i] > INT32_MAX || v.arr_i[i] < INT32_MIN) {
        return Status(
            Code::invalid_argument,
            fmt("gguf: key '%s' element %zu value %" PRId64 " (type %s) does not fit INT32",
                std::string(key).c_str(), i, v.arr_i[i], gguf_type_name(v.array_type)));
      }
      out.push_back(static_cast<int32_t>(v.arr_i[i]));
    }
  }
  return out;
}

WeightView GgufFile::view(const GgufTensorInfo& t) const {
  WeightView w;
  w.type = t.type;
  w.data = tensor_data(t);
  w.rows = t.ne[1] * t.ne[2] * t.ne[3];
  w.cols = t.ne[0];
  w.row_bytes = dtype_row_bytes(t.type, t.ne[0]);
  return w;
}

}  // namespace cleave
