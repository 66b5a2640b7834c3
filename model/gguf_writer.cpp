// GGUF v3 writer (model/gguf.h's GgufWriter).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "model/gguf.h"
#include "model/gguf_format.h"

namespace cleave {

using namespace gguf_detail;


void GgufWriter::set(std::string key, GgufValue value) {
  for (GgufKv& kv : kvs_) {
    if (kv.key == key) {
      kv.value = std::move(value);
      return;
    }
  }
  kvs_.push_back(GgufKv{std::move(key), std::move(value)});
}

void GgufWriter::set_string(std::string key, std::string v) {
  GgufValue x;
  x.type = GgufType::STRING;
  x.s = std::move(v);
  set(std::move(key), std::move(x));
}
void GgufWriter::set_u32(std::string key, uint32_t v) {
  GgufValue x;
  x.type = GgufType::UINT32;
  x.u = v;
  set(std::move(key), std::move(x));
}
void GgufWriter::set_i32(std::string key, int32_t v) {
  GgufValue x;
  x.type = GgufType::INT32;
  x.i = v;
  set(std::move(key), std::move(x));
}
void GgufWriter::set_f32(std::string key, float v) {
  GgufValue x;
  x.type = GgufType::FLOAT32;
  x.f = v;
  set(std::move(key), std::move(x));
}
void GgufWriter::set_bool(std::string key, bool v) {
  GgufValue x;
  x.type = GgufType::BOOL;
  x.u = v ? 1 : 0;
  set(std::move(key), std::move(x));
}
void GgufWriter::set_string_array(std::string key, std::vector<std::string> v) {
  GgufValue x;
  x.type = GgufType::ARRAY;
  x.array_type = GgufType::STRING;
  x.arr_s = std::move(v);
  set(std::move(key), std::move(x));
}
void GgufWriter::set_f32_array(std::string key, std::vector<float> v) {
  GgufValue x;
  x.type = GgufType::ARRAY;
  x.array_type = GgufType::FLOAT32;
  x.arr_f.assign(v.begin(), v.end());
  set(std::move(key), std::move(x));
}
void GgufWriter::set_i32_array(std::string key, std::vector<int32_t> v) {
  GgufValue x;
  x.type = GgufType::ARRAY;
  x.array_type = GgufType::INT32;
  x.arr_i.assign(v.begin(), v.end());
  set(std::move(key), std::move(x));
}

void GgufWriter::add_tensor(std::string name, DType type, std::vector<int64_t> ne,
                            std::vector<uint8_t> data) {
  tensors_.push_back(Tensor{std::move(name), type, std::move(ne), std::move(data)});
}

namespace {

struct Out {
  std::vector<uint8_t> b;
  template <class T>
  void put(T v) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
  }
};

Status bad_value(const std::string& key, const std::string& why) {
  return Status(Code::invalid_argument, "gguf: writer: key '" + key + "': " + why);
}

Status put_scalar(Out& o, GgufType t, uint64_t u, int64_t i, double f, const std::string& key) {
  switch (t) {
    case GgufType::UINT8:
      o.put<uint8_t>(static_cast<uint8_t>(u));
      break;
    case GgufType::UINT16:
      o.put<uint16_t>(static_cast<uint16_t>(u));
      break;
    case GgufType::UINT32:
      o.put<uint32_t>(static_cast<uint32_t>(u));
      break;
    case GgufType::UINT64:
      o.put<uint64_t>(u);
      break;
    case GgufType::BOOL:
      o.put<uint8_t>(u ? 1 : 0);
      break;
    case GgufType::INT8:
      o.put<int8_t>(static_cast<int8_t>(i));
      break;
    case GgufType::INT16:
      o.put<int16_t>(static_cast<int16_t>(i));
      break;
    case GgufType::INT32:
      o.put<int32_t>(static_cast<int32_t>(i));
      break;
    case GgufType::INT64:
      o.put<int64_t>(i);
      break;
    case GgufType::FLOAT32:
      o.put<float>(static_cast<float>(f));
      break;
    case GgufType::FLOAT64:
      o.put<double>(f);
      break;
    default:
      return bad_value(key, "not a scalar type");
  }
  return Status::Ok();
}

Status put_value(Out& o, const GgufKv& kv) {
  const GgufValue& v = kv.value;
  uint32_t t = static_cast<uint32_t>(v.type);
  if (!is_known_type(t)) return bad_value(kv.key, "unknown value type " + std::to_string(t));
  o.put<uint32_t>(t);
  if (v.type == GgufType::STRING) {
    o.str(v.s);
    return Status::Ok();
  }
  if (v.type != GgufType::ARRAY) return put_scalar(o, v.type, v.u, v.i, v.f, kv.key);
  uint32_t et = static_cast<uint32_t>(v.array_type);
  if (!is_known_type(et) || v.array_type == GgufType::ARRAY) {
    return bad_value(kv.key, std::string("unsupported array element type ") + std::to_string(et));
  }
  o.put<uint32_t>(et);
  o.put<uint64_t>(v.array_len());
  if (v.array_type == GgufType::STRING) {
    for (const std::string& s : v.arr_s) o.str(s);
  } else if (is_float_type(v.array_type)) {
    for (double x : v.arr_f) CLEAVE_RETURN_IF_ERROR(put_scalar(o, v.array_type, 0, 0, x, kv.key));
  } else if (is_sint_type(v.array_type)) {
    for (int64_t x : v.arr_i) CLEAVE_RETURN_IF_ERROR(put_scalar(o, v.array_type, 0, x, 0, kv.key));
  } else {
    for (uint64_t x : v.arr_u) CLEAVE_RETURN_IF_ERROR(put_scalar(o, v.array_type, x, 0, 0, kv.key));
  }
  return Status::Ok();
}

Status write_all(int fd, const uint8_t* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status(Code::io_error,
                    fmt("gguf: cannot write '%s': %s", path.c_str(), std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

}  // namespace

Status GgufWriter::write(const std::string& path) const {
  uint64_t alignment = kDefaultAlignment;
  for (const GgufKv& kv : kvs_) {
    if (kv.key != "general.alignment") continue;
    if (is_uint_type(kv.value.type))
      alignment = kv.value.u;
    else if (is_sint_type(kv.value.type) && kv.value.i > 0)
      alignment = static_cast<uint64_t>(kv.value.i);
    else
      alignment = 0;
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 30)) {
      return Status(Code::invalid_argument,
                    "gguf: writer: general.alignment must be a power of two integer (got type " +
                        type_desc(kv.value) + ")");
    }
  }
  auto pad_to = [&](uint64_t x) { return (x + alignment - 1) / alignment * alignment; };

  Out o;
  o.b.insert(o.b.end(), {'G', 'G', 'U', 'F'});
  o.put<uint32_t>(3);
  o.put<uint64_t>(tensors_.size());
  o.put<uint64_t>(kvs_.size());
  for (const GgufKv& kv : kvs_) {
    o.str(kv.key);
    CLEAVE_RETURN_IF_ERROR(put_value(o, kv));
  }
  std::unordered_set<std::string> names;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    if (!names.insert(t.name).second) {
      return Status(Code::invalid_argument, "gguf: writer: duplicate tensor name '" + t.name + "'");
    }
    if (t.ne.empty() || t.ne.size() > 4) {
      return Status(Code::invalid_argument, "gguf: writer: tensor '" + t.name + "' has " +
                                                std::to_string(t.ne.size()) +
                                                " dims (must be 1..4)");
    }
    if (!dtype_known(static_cast<uint32_t>(t.type))) {
      return Status(Code::invalid_argument, "gguf: writer: tensor '" + t.name +
                                                "' has unknown type id " +
                                                std::to_string(static_cast<uint32_t>(t.type)));
    }
    int64_t n = 1;
    for (int64_t d : t.ne) {
      if (d <= 0 || __builtin_mul_overflow(n, d, &n)) {
        return Status(Code::invalid_argument,
                      "gguf: writer: tensor '" + t.name + "' has a bad dim " + std::to_string(d));
      }
    }
    int64_t blk = dtype_block_elems(t.type);
    if (t.ne[0] % blk != 0) {
      return Status(Code::invalid_argument, "gguf: writer: tensor '" + t.name + "' ne[0] " +
                                                std::to_string(t.ne[0]) + " is not a multiple of " +
                                                std::to_string(blk));
    }
    uint64_t bytes =
        static_cast<uint64_t>(n / blk) * static_cast<uint64_t>(dtype_block_bytes(t.type));
    if (bytes != t.data.size()) {
      return Status(Code::invalid_argument, "gguf: writer: tensor '" + t.name + "' has " +
                                                std::to_string(t.data.size()) +
                                                " data bytes, expected " + std::to_string(bytes));
    }
    o.str(t.name);
    o.put<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) o.put<uint64_t>(static_cast<uint64_t>(d));
    o.put<uint32_t>(static_cast<uint32_t>(t.type));
    o.put<uint64_t>(offset);
    offset = pad_to(offset + bytes);
  }
  o.b.resize(pad_to(o.b.size()), 0);

  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status(Code::io_error,
                  fmt("gguf: cannot create '%s': %s", tmp.c_str(), std::strerror(errno)));
  }
  Status st = write_all(fd, o.b.data(), o.b.size(), path);
  static const uint8_t kZeros[256] = {};
  for (size_t k = 0; st.ok() && k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    st = write_all(fd, t.data.data(), t.data.size(), path);
    uint64_t pad = pad_to(t.data.size()) - t.data.size();
    while (st.ok() && pad > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(pad, sizeof kZeros));
      st = write_all(fd, kZeros, n, path);
      pad -= n;
    }
  }
  if (st.ok() && ::fsync(fd) != 0) {
    st = Status(Code::io_error,
                fmt("gguf: cannot fsync '%s': %s", path.c_str(), std::strerror(errno)));
  }
  if (::close(fd) != 0 && st.ok()) {
    st = Status(Code::io_error,
                fmt("gguf: cannot close '%s': %s", path.c_str(), std::strerror(errno)));
  }
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = Status(Code::io_error, fmt("gguf: cannot rename '%s' to '%s': %s", tmp.c_str(),
                                    path.c_str(), std::strerror(errno)));
  }
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

}  // namespace cleave
