// Private to schema/codec*.cpp (it includes the generated Cap'n Proto
// header): what the encoder (codec_write.cpp), the count of what reading an
// encoding back costs (codec_size.cpp), the decoder (codec_read.cpp) and
// codec.cpp, which puts them together per message type, share: each
// section's function for every Envelope member is declared here, its helpers
// stay in its file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cleave.capnp.h"
#include "schema/codec.h"

namespace cleave::codec::detail {

// ---- plain -> wire (codec_write.cpp), wire -> plain (codec_read.cpp) ----

#define CLEAVE_PUT_GET(Type, Name)               \
  void put(wire::Name::Builder b, const Type& m); \
  void get(wire::Name::Reader r, Type& m);
CLEAVE_PUT_GET(GenerateRequest, GenerateRequest)
CLEAVE_PUT_GET(msg::StreamEvent, StreamEvent)
CLEAVE_PUT_GET(msg::Handoff, Handoff)
CLEAVE_PUT_GET(msg::KvPut, KvPut)
CLEAVE_PUT_GET(msg::KvAck, KvAck)
CLEAVE_PUT_GET(msg::KvGet, KvGet)
CLEAVE_PUT_GET(msg::KvBlocks, KvBlocks)
CLEAVE_PUT_GET(msg::Health, Health)
CLEAVE_PUT_GET(msg::Stats, Stats)
CLEAVE_PUT_GET(msg::KvPull, KvPull)
CLEAVE_PUT_GET(msg::KvChunk, KvChunk)
CLEAVE_PUT_GET(msg::EncodeRequest, EncodeRequest)
CLEAVE_PUT_GET(msg::ImageEmbeddings, ImageEmbeddings)
CLEAVE_PUT_GET(msg::ExpertBatch, ExpertBatch)
CLEAVE_PUT_GET(msg::StageBatch, StageBatch)
#undef CLEAVE_PUT_GET

// Whether put() writes these bytes as a segment of their own.
bool by_reference(const std::vector<uint8_t>& bytes);

// A list longer than its bound: thrown from the converters (they run inside
// decode's try block) and reported as invalid_argument.
struct TooLong {
  std::string what;
};

// ---- what reading an encoding back costs (codec_size.cpp) --------------

// read: charged words; by_reference: of those, the words of blobs that stay
// outside the message's segment.
struct Words {
  uint64_t read = 0;
  uint64_t by_reference = 0;
};
inline Words operator+(Words a, Words b) {
  return {a.read + b.read, a.by_reference + b.by_reference};
}
inline Words operator+(Words a, uint64_t b) { return {a.read + b, a.by_reference}; }
inline Words operator+(uint64_t a, Words b) { return {a + b.read, b.by_reference}; }

template <class W>
constexpr uint64_t struct_words() {
  return uint64_t(W::_capnpPrivate::dataWordSize) + uint64_t(W::_capnpPrivate::pointerCount);
}

// content(m): the words of what the member's struct points to.
Words content(const GenerateRequest& r);
Words content(const msg::EncodeRequest& m);
Words content(const msg::ImageEmbeddings& m);
uint64_t content(const msg::StreamEvent& e);
uint64_t content(const msg::KvPull&);
Words content(const msg::ExpertBatch& m);
Words content(const msg::StageBatch& m);
Words content(const msg::KvChunk& m);
Words content(const msg::Handoff& h);
Words content(const msg::KvPut& m);
Words content(const msg::KvBlocks& m);
uint64_t content(const msg::KvAck& m);
Words content(const msg::KvGet& m);
uint64_t content(const msg::Health& m);
Words content(const msg::Stats& m);

}  // namespace cleave::codec::detail
