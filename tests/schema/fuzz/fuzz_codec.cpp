// libFuzzer target for the codec: any input decoded as every kind must give
// an error or a value; a value must re-encode to bytes that decode to a value
// encoding to the same bytes. ASan/UBSan catch what a crash would not.
#include <cstdio>
#include <cstdlib>

#include "schema/codec.h"

namespace {

using cleave::codec::Bytes;

template <class T>
void check_kind(const uint8_t* data, size_t size, const char* name) {
  T value;
  if (!cleave::codec::decode(reinterpret_cast<const char*>(data), size, value).ok()) return;
  const Bytes first = cleave::codec::encode(value);
  T again;
  cleave::Status st = cleave::codec::decode(first, again);
  if (!st.ok()) {
    std::fprintf(stderr, "%s: re-encoded value does not decode: %s\n", name,
                 st.to_string().c_str());
    std::abort();
  }
  if (cleave::codec::encode(again) != first) {
    std::fprintf(stderr, "%s: re-encoding changed the bytes\n", name);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace msg = cleave::msg;
  check_kind<cleave::GenerateRequest>(data, size, "GenerateRequest");
  check_kind<msg::StreamEvent>(data, size, "StreamEvent");
  check_kind<msg::Handoff>(data, size, "Handoff");
  check_kind<msg::KvPut>(data, size, "KvPut");
  check_kind<msg::KvAck>(data, size, "KvAck");
  check_kind<msg::KvGet>(data, size, "KvGet");
  check_kind<msg::KvBlocks>(data, size, "KvBlocks");
  check_kind<msg::Health>(data, size, "Health");
  check_kind<msg::Stats>(data, size, "Stats");
  check_kind<msg::KvPull>(data, size, "KvPull");
  check_kind<msg::KvChunk>(data, size, "KvChunk");
  check_kind<msg::EncodeRequest>(data, size, "EncodeRequest");
  check_kind<msg::ImageEmbeddings>(data, size, "ImageEmbeddings");
  check_kind<msg::ExpertBatch>(data, size, "ExpertBatch");
  check_kind<msg::StageBatch>(data, size, "StageBatch");
  return 0;
}
