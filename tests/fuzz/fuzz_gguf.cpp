// libFuzzer target for the GGUF reader (model/gguf.h). Any bytes, parsed from
// memory and opened as a file (a memfd, so mmap runs too), give the same
// answer: corruption, or a file whose every metadata value the typed getters
// read or refuse (invalid_argument) and whose every tensor lies inside the
// file (its bytes are read: ASan sees every one of them for the in-memory
// copy).
#include <cstring>
#include <string>

#include "fuzz_check.h"
#include "model/gguf.h"

namespace {

using namespace cleave;
using fuzz::fail;

// A typed getter on a present key: the value, or invalid_argument.
template <class R>
void getter(const R& r, const std::string& key, const char* name) {
  if (!r.ok()) fuzz::expect_error(r.status(), {Code::invalid_argument}, (name + (" '" + key + "'")).c_str());
}

void touch(const GgufFile& f) {
  for (const GgufKv& kv : f.metadata()) {
    const std::string& k = kv.key;
    if (f.find(k) != &kv) fail("find('%s') is not its own entry (duplicate key?)", k.c_str());
    getter(f.get_string(k), k, "get_string");
    getter(f.get_uint(k), k, "get_uint");
    getter(f.get_int(k), k, "get_int");
    getter(f.get_float(k), k, "get_float");
    getter(f.get_bool(k), k, "get_bool");
    getter(f.get_string_array(k), k, "get_string_array");
    getter(f.get_float_array(k), k, "get_float_array");
    getter(f.get_int_array(k), k, "get_int_array");
    (void)kv.value.array_len();
    if (std::strcmp(gguf_type_name(kv.value.type), "UNKNOWN") == 0)
      fail("key '%s' has an unknown type %u", k.c_str(), unsigned(kv.value.type));
  }
  auto absent = f.get_uint("fuzz.absent.key");
  if (f.find("fuzz.absent.key") == nullptr && absent.status().code() != Code::not_found)
    fail("an absent key is not not_found: %s", absent.status().to_string().c_str());

  const uint64_t data_size = f.file_size() - f.data_offset();
  if (f.data_offset() > f.file_size()) fail("data section starts past the file");
  unsigned sum = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    if (f.find_tensor(t.name) != &t) fail("find_tensor('%s') is not its own entry", t.name.c_str());
    if (t.n_dims < 1 || t.n_dims > 4 || t.n_elements() <= 0) fail("tensor '%s' shape", t.name.c_str());
    if (t.offset > data_size || t.bytes > data_size - t.offset || t.bytes == 0)
      fail("tensor '%s' [%llu, +%llu) outside the data section", t.name.c_str(),
           (unsigned long long)t.offset, (unsigned long long)t.bytes);
    const WeightView w = f.view(t);
    if (w.rows < 1 || w.cols < 1 || w.row_bytes * size_t(w.rows) != t.bytes)
      fail("tensor '%s': view %lld x %lld, %zu bytes a row, for %llu bytes", t.name.c_str(),
           (long long)w.rows, (long long)w.cols, w.row_bytes, (unsigned long long)t.bytes);
    const uint8_t* p = f.tensor_data(t);
    for (uint64_t i = 0; i < t.bytes; ++i) sum += p[i];
  }
  volatile unsigned sink = sum;
  (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto parsed = GgufFile::parse(data, size);
  if (!parsed.ok()) {
    fuzz::expect_error(parsed.status(), {Code::corruption}, "GgufFile::parse");
    if (parsed.status().message().rfind("gguf: ", 0) != 0)
      fail("message without 'gguf: ': %s", parsed.status().message().c_str());
  } else {
    touch(**parsed);
  }

  const std::string path = fuzz::as_file(data, size);
  auto opened = GgufFile::open(path);
  if (opened.ok() != parsed.ok() ||
      (!opened.ok() && opened.status().code() != parsed.status().code()))
    fail("open and parse disagree: %s vs %s", opened.status().to_string().c_str(),
         parsed.status().to_string().c_str());
  if (opened.ok()) {
    const GgufFile& a = **parsed;
    const GgufFile& b = **opened;
    if (a.metadata().size() != b.metadata().size() || a.tensors().size() != b.tensors().size() ||
        a.data_offset() != b.data_offset() || a.alignment() != b.alignment())
      fail("open and parse read different files");
  } else if (opened.status().message() != parsed.status().message() + " (file '" + path + "')") {
    fail("open's message is not parse's naming the file: %s", opened.status().message().c_str());
  }
  return 0;
}
