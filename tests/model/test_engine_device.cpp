// The engine's device path (EngineOptions::device, Caps::host_memory) run on
// the CPU's kernels behind tests/fenced_backend.h: the bits of the CPU
// backend, no host access to device memory (it faults), no host pointer
// handed to a device op, and per step only ids, positions and block tables
// in and the logits rows out. Also --device parsing and its refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "model/generate.h"
#include "tests/fenced_backend.h"
#include "tests/model/model_fixtures.h"

using namespace cleave;
using namespace cleave::fixtures;
using cleave::testing::FencedBackend;

namespace {

struct Pair {
  std::unique_ptr<Engine> cpu, dev;
  std::shared_ptr<FencedBackend::Log> fence;  // what dev's backend saw
};

Pair cpu_and_device(const std::string& path, EngineOptions o) {
  Pair p;
  p.cpu = make_engine(path, o);
  auto fence = std::make_unique<FencedBackend>(make_cpu_backend(o.threads));
  p.fence = fence->log();
  auto dev = Engine::create(open_model(path), o, std::move(fence));
  REQUIRE_MESSAGE(dev.ok(), dev.status().to_string());
  p.dev = std::move(*dev);
  return p;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int32_t argmax(const float* v, int32_t n) {
  return int32_t(std::max_element(v, v + n) - v);
}

// Deterministic image rows for positions [position, position + n).
std::vector<float> image_rows(int32_t n, int32_t dim) {
  std::vector<float> rows(size_t(n) * size_t(dim));
  uint64_t x = 12345;
  for (float& v : rows) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = float(x >> 40) / float(1 << 24) - 0.5f;
  }
  return rows;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += x + "; ";
  return s;
}

}  // namespace

TEST_CASE("engine on a device: the CPU backend's bits, and the host never touches device memory") {
  struct Case {
    ModelSpec spec;
    std::string name;
    DType kv;
  };
  ModelSpec f16_tied = small_dense();
  f16_tied.type = DType::F16;
  f16_tied.tied_output = true;
  ModelSpec q8 = small_dense();
  q8.type = DType::Q8_0;
  q8.dim = 128;  // head_dim 32: Q8_0 KV rows
  q8.n_heads = 4;
  for (const Case& c : {Case{small_dense(), "dense-f32", DType::F32},
                        Case{f16_tied, "dense-f16-tied", DType::F16},
                        Case{q8, "dense-q8", DType::Q8_0}, Case{small_moe(), "moe", DType::F32}}) {
    CAPTURE(c.name);
    EngineOptions o;
    o.threads = 2;
    o.max_seqs = 4;
    o.cache_type_k = o.cache_type_v = c.kv;
    Pair p = cpu_and_device(model_path(c.spec, c.name), o);
    const int32_t V = p.cpu->config().n_vocab, D = p.cpu->config().dim;
    const std::vector<float> img = image_rows(4, D);
    const std::vector<KeySpan> spans = {{3, 4, BlockKey{}}};
    std::vector<int32_t> seq_cpu, seq_dev;
    for (int i = 0; i < 3; ++i) {
      auto a = p.cpu->open_sequence(i == 2 ? spans : std::vector<KeySpan>{});
      auto b = p.dev->open_sequence(i == 2 ? spans : std::vector<KeySpan>{});
      REQUIRE((a.ok() && b.ok()));
      seq_cpu.push_back(*a), seq_dev.push_back(*b);
    }
    const auto p0 = prompt_of(20, 1), p1 = prompt_of(37, 2);
    std::vector<int32_t> p2 = prompt_of(9, 3);
    // Both engines take the same batches: several prompts (chunked, one of
    // them with image rows at positions 3..6), then decode steps of all
    // three fed their greedy tokens. Every batch's logits must match bit
    // for bit.
    std::vector<float> lc, ld;
    auto step = [&](const std::vector<std::array<int64_t, 3>>& items,
                    const std::vector<std::vector<int32_t>*>& toks, const std::vector<float>* emb) {
      std::vector<Engine::Item> ic, id;
      for (size_t i = 0; i < items.size(); ++i) {
        const auto [s, from, count] = items[i];
        Engine::Item it{0, toks[i]->data() + from, int32_t(count), {}};
        if (emb && s == 2) it.embeddings = std::span<const float>(*emb);
        it.seq = seq_cpu[size_t(s)];
        ic.push_back(it);
        it.seq = seq_dev[size_t(s)];
        id.push_back(it);
      }
      lc.assign(items.size() * size_t(V), 0.f);
      ld.assign(items.size() * size_t(V), 1.f);
      Status a = p.cpu->forward(ic, lc.data());
      Status b = p.dev->forward(id, ld.data());
      REQUIRE_MESSAGE(a.ok(), a.to_string());
      REQUIRE_MESSAGE(b.ok(), b.to_string());
      CHECK(same(lc, ld));
    };
    auto p0v = p0, p1v = p1;
    step({{0, 0, 20}, {1, 0, 16}, {2, 0, 9}}, {&p0v, &p1v, &p2}, &img);  // the image rows
    step({{1, 16, 21}, {0, 19, 1}}, {&p1v, &p0v}, nullptr);             // a chunk beside a repeat
    std::vector<int32_t> next = {argmax(&lc[0], V), argmax(&lc[size_t(V)], V), 5};
    for (int t = 0; t < 6; ++t) {
      std::vector<int32_t> a{next[0]}, b{next[1]}, d{next[2]};
      step({{0, 0, 1}, {1, 0, 1}, {2, 0, 1}}, {&a, &b, &d}, nullptr);
      for (int i = 0; i < 3; ++i) next[size_t(i)] = argmax(&lc[size_t(i) * size_t(V)], V);
    }
    // The KV both engines wrote: the same bytes (full blocks: a partial
    // one's unwritten slots hold whatever the memory held).
    auto ec = p.cpu->export_blocks(seq_cpu[1]);
    auto ed = p.dev->export_blocks(seq_dev[1]);
    REQUIRE((ec.ok() && ed.ok()));
    REQUIRE(ec->size() == ed->size());
    REQUIRE(ec->size() == 3);  // 43 tokens
    for (size_t b = 0; b < 2; ++b) CHECK((*ec)[b].bytes == (*ed)[b].bytes);
    // A cached prefix ending inside a block: the next forward copies that
    // block within device memory (Backend::copy) before writing it.
    for (Engine* e : {p.cpu.get(), p.dev.get()}) e->close_sequence(e == p.cpu.get() ? seq_cpu[1] : seq_dev[1]);
    auto rc = p.cpu->open_sequence(), rd = p.dev->open_sequence();
    REQUIRE((rc.ok() && rd.ok()));
    seq_cpu[1] = *rc, seq_dev[1] = *rd;
    auto hc = p.cpu->attach_cached_prefix(*rc, p1.data(), 32);
    auto hd = p.dev->attach_cached_prefix(*rd, p1.data(), 32);
    REQUIRE((hc.ok() && hd.ok()));
    CHECK(*hc == 31);  // inside block 1, shared with the cache
    CHECK(*hd == 31);
    auto tail = p1;
    step({{1, 31, 6}}, {&tail}, nullptr);
    // Import into the device engine what the CPU engine exported.
    auto xc = p.cpu->export_blocks(seq_cpu[0]);
    REQUIRE(xc.ok());
    auto fresh = p.dev->open_sequence();
    REQUIRE(fresh.ok());
    const std::vector<int32_t>& toks = p.cpu->sequence_tokens(seq_cpu[0]);
    REQUIRE(p.dev->import_blocks(*fresh, toks.data(), int32_t(toks.size()), *xc).ok());
    p.dev->close_sequence(seq_dev[0]);
    seq_dev[0] = *fresh;
    std::vector<int32_t> one{next[0]};
    step({{0, 0, 1}}, {&one}, nullptr);
    CHECK_MESSAGE(p.fence->violations.empty(), joined(p.fence->violations));
  }
}

TEST_CASE("engine on a device: weights go up once, then a step moves ids and logits rows only") {
  const std::string path = model_path(small_dense(), "dense-f32");
  EngineOptions o;
  o.threads = 1;
  o.max_seqs = 4;
  auto fence = std::make_unique<FencedBackend>(make_cpu_backend(1));
  const std::shared_ptr<FencedBackend::Log> f = fence->log();
  auto file = open_model(path);
  auto e = Engine::create(file, o, std::move(fence));
  REQUIRE(e.ok());
  // Every tensor of a dense model, once (the test model has an output
  // matrix of its own), in its stored bytes; nothing comes back.
  uint64_t tensor_bytes = 0;
  for (const GgufTensorInfo& t : file->tensors()) tensor_bytes += t.bytes;
  CHECK(f->traffic.upload_bytes == tensor_bytes);
  CHECK(f->traffic.downloads == 0);
  Engine& eng = **e;
  const int32_t V = eng.config().n_vocab;
  const int32_t a = *eng.open_sequence(), b = *eng.open_sequence();
  const auto pa = prompt_of(40, 4), pb = prompt_of(7, 5);
  std::vector<float> lg(2 * size_t(V));
  REQUIRE(eng.forward({{a, pa.data(), 40}, {b, pb.data(), 7}}, lg.data()).ok());
  f->traffic = {};
  const int32_t ta = 11, tb = 12;
  REQUIRE(eng.forward({{a, &ta, 1}, {b, &tb, 1}}, lg.data()).ok());
  // ids (2), positions (2), the two block tables (41 -> 3 blocks, 8 -> 1)
  // and the 2 rows' AttnRows, once for every layer's kv_write and attention.
  const FencedBackend::Traffic t = f->traffic;
  CHECK(t.uploads == 4);
  CHECK(t.upload_bytes == sizeof(int32_t) * (2 + 2 + 3 + 1) + 2 * sizeof(AttnRow));
  CHECK(t.downloads == 1);
  CHECK(t.download_bytes == 2 * size_t(V) * sizeof(float));
  CHECK(f->violations.empty());
  // Everything the engine allocated in device memory goes with it.
  CHECK(f->live_allocations > 0);
  e->reset();
  CHECK(f->live_allocations == 0);

  // An MoE model: every tensor up once (the experts too); per decode step
  // each of its 2 layers also downloads its rows' expert ids (2 rows x 2)
  // and uploads the gather plan (the 4 gathered rows' sources, and where
  // each (row, expert) output sits).
  auto moe_file = open_model(model_path(small_moe(), "moe"));
  auto mfence = std::make_unique<FencedBackend>(make_cpu_backend(1));
  const std::shared_ptr<FencedBackend::Log> mf = mfence->log();
  auto me = Engine::create(moe_file, o, std::move(mfence));
  REQUIRE(me.ok());
  uint64_t moe_bytes = 0;
  for (const GgufTensorInfo& t2 : moe_file->tensors()) moe_bytes += t2.bytes;
  CHECK(mf->traffic.upload_bytes == moe_bytes);
  Engine& moe = **me;
  const int32_t ma = *moe.open_sequence(), mb = *moe.open_sequence();
  REQUIRE(moe.forward({{ma, pa.data(), 40}, {mb, pb.data(), 7}}, lg.data()).ok());
  mf->traffic = {};
  REQUIRE(moe.forward({{ma, &ta, 1}, {mb, &tb, 1}}, lg.data()).ok());
  const FencedBackend::Traffic mt = mf->traffic;
  CHECK(mt.uploads == 4 + 2 * 2);
  CHECK(mt.upload_bytes == sizeof(int32_t) * (2 + 2 + 3 + 1 + 2 * (4 + 4)) + 2 * sizeof(AttnRow));
  CHECK(mt.downloads == 1 + 2);
  CHECK(mt.download_bytes == 2 * size_t(V) * sizeof(float) + 2 * 4 * sizeof(int32_t));
  CHECK(mf->violations.empty());
}

TEST_CASE("engine on a device: a batch whose activations do not fit is refused, losing nothing") {
  const std::string path = model_path(small_dense(), "dense-f32");
  EngineOptions o;
  o.max_seqs = 16;
  // How much of the device the weights and KV take.
  size_t fixed = 0;
  {
    auto probe = std::make_unique<FencedBackend>(make_cpu_backend(1));
    const auto log = probe->log();
    auto e = Engine::create(open_model(path), o, std::move(probe));
    REQUIRE(e.ok());
    fixed = log->used_bytes;
  }
  // Room for a few rows' activations and logits, not for sixteen.
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  auto fence = std::make_unique<FencedBackend>(make_cpu_backend(1), (fixed + (size_t(1) << 20)) / page * page + page);
  const auto log = fence->log();
  auto made = Engine::create(open_model(path), o, std::move(fence));
  REQUIRE(made.ok());
  Engine& e = **made;
  const int32_t V = e.config().n_vocab;
  std::vector<int32_t> seqs;
  for (int i = 0; i < 16; ++i) seqs.push_back(*e.open_sequence());
  const auto prompt = prompt_of(3, 9);
  std::vector<Engine::Item> items;
  for (int32_t s : seqs) items.push_back({s, prompt.data(), 3});
  std::vector<float> lg(16 * size_t(V));
  Status st = e.forward(items, lg.data());  // 16 logits rows of 32,000 floats: 2 MiB
  CHECK(st.code() == Code::out_of_memory);
  CHECK(st.message().find("does not fit the fenced backend's memory") != std::string::npos);
  for (int32_t s : seqs) CHECK(e.sequence_length(s) == 0);
  // One sequence's batch still runs, and its logits are the CPU engine's.
  REQUIRE(e.forward({items[0]}, lg.data()).ok());
  auto cpu = make_engine(path, o);
  const int32_t cs = *cpu->open_sequence();
  std::vector<float> want(static_cast<size_t>(V));
  REQUIRE(cpu->forward({{cs, prompt.data(), 3}}, want.data()).ok());
  CHECK(std::memcmp(want.data(), lg.data(), want.size() * sizeof(float)) == 0);
  CHECK(log->violations.empty());
}

TEST_CASE("engine on a device: what it cannot run there is refused by name") {
  // (MoE models, pipeline stages and expert executors run there: the cases
  // above, test_pipeline_stages.cpp and test_experts.cpp.)
  EngineOptions o;
  // A backend of its own beside a device name.
  o.device = "cuda:0";
  auto both = Engine::create(open_model(model_path(small_dense(), "dense-f32")), o,
                             std::make_unique<FencedBackend>(make_cpu_backend(1)));
  CHECK(both.status().code() == Code::invalid_argument);
  // A device that is not there (no GPU, or no CUDA in the build) says why.
  if (!make_cuda_backend(0).ok()) {
    auto none = Engine::create(open_model(model_path(small_dense(), "dense-f32")), o);
    REQUIRE(!none.ok());
    CHECK(none.status().code() == Code::unavailable);
    CHECK(none.status().message().rfind("engine: cuda backend: ", 0) == 0);
  }
  o.device = "gpu0";
  auto bad = Engine::create(open_model(model_path(small_dense(), "dense-f32")), o);
  CHECK(bad.status().code() == Code::invalid_argument);
  CHECK(bad.status().message() == "engine: device 'gpu0' is not one of cpu, cuda:N (N a GPU index in [0, 1023])");
}

TEST_CASE("--device values") {
  for (const char* good : {"cpu", "cuda:0", "cuda:7", "cuda:12", "cuda:1023"}) {
    CAPTURE(good);
    auto d = parse_device(good);
    REQUIRE(d.ok());
    CHECK(d->name() == good);
  }
  for (const char* bad : {"", "CPU", "gpu", "cuda", "cuda:", "cuda:01", "cuda:-1", "cuda:1024",
                          "cuda:0 ", "cuda:x", "cuda:99999"}) {
    CAPTURE(bad);
    CHECK(parse_device(bad).status().code() == Code::invalid_argument);
  }
  // int8 kernels are the CPU's: refused on CUDA before any device is sought.
  auto int8 = make_backend(Device{Device::Kind::cuda, 0}, 1, Compute::int8);
  CHECK(int8.status().code() == Code::unsupported);
  auto cpu = make_backend(Device{}, 2, Compute::exact);
  REQUIRE(cpu.ok());
  CHECK((*cpu)->caps().name == "cpu");
  CHECK((*cpu)->caps().host_memory);
}

TEST_CASE("engine on a device: KV blocks exported into device memory import into another engine, never through the host") {
  const std::string path = model_path(small_dense(), "dense-f32");
  EngineOptions o;
  o.threads = 1;
  o.max_seqs = 2;
  o.block_size = 8;
  Pair src = cpu_and_device(path, o), dst = cpu_and_device(path, o);
  const int32_t V = src.cpu->config().n_vocab;
  const auto prompt = prompt_of(29, 7);  // 3 full blocks and 5 tokens
  const int32_t a = *src.dev->open_sequence(), ac = *src.cpu->open_sequence();
  const size_t nv = static_cast<size_t>(V);
  std::vector<float> lg(nv), lc(nv);
  REQUIRE(src.dev->forward({{a, prompt.data(), 29}}, lg.data()).ok());
  REQUIRE(src.cpu->forward({{ac, prompt.data(), 29}}, lc.data()).ok());
  auto host = src.cpu->export_blocks(ac, 1);  // what the host path seals
  REQUIRE(host.ok());
  REQUIRE(host->size() == 3);

  Backend& sb = src.dev->backend();
  const size_t bb = host->front().bytes.size();
  void* out = sb.alloc(3 * bb);
  REQUIRE(out != nullptr);
  src.fence->traffic = {};
  std::vector<BlockHeader> headers;
  Status st = src.dev->export_blocks_to(a, 1, out, headers);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  // No byte of a block went up or down: copied and hashed on the device.
  // One upload: the zeros for the last block's 3 unfilled slots.
  const KvLayout& L = host->front().header.layout;
  CHECK(src.fence->traffic.downloads == 0);
  CHECK(src.fence->traffic.uploads == 1);
  CHECK(src.fence->traffic.upload_bytes == 3 * std::max(L.k_row_bytes(), L.v_row_bytes()));
  CHECK(src.fence->checksummed_blocks == 3);
  REQUIRE(headers.size() == 3);
  // The device's bytes, moved by the test (between two processes this is
  // the IPC region) into the other engine's device memory.
  std::vector<uint8_t> moved(3 * bb);
  sb.download(moved.data(), out, moved.size());
  for (size_t i = 0; i < 3; ++i) {
    CHECK(headers[i].key == (*host)[i].header.key);
    CHECK(headers[i].n_tokens == (*host)[i].header.n_tokens);
    CHECK(headers[i].model_fingerprint == (*host)[i].header.model_fingerprint);
    CHECK(headers[i].checksum == checksum_bytes(moved.data() + i * bb, bb));
  }
  // The CPU engine's bytes, the last block's unfilled slots zeroed by both.
  for (size_t i = 0; i < 3; ++i) CHECK(headers[i].checksum == (*host)[i].header.checksum);
  Backend& db = dst.dev->backend();
  void* in = db.alloc(3 * bb);
  REQUIRE(in != nullptr);
  db.upload(in, moved.data(), moved.size());
  const int32_t b = *dst.dev->open_sequence(), bc = *dst.cpu->open_sequence();
  // Its first block comes from its own prefill of that block's tokens.
  REQUIRE(dst.dev->forward({{b, prompt.data(), 8}}, lg.data()).ok());
  REQUIRE(dst.cpu->forward({{bc, prompt.data(), 8}}, lc.data()).ok());
  // A flipped byte in block 2 (the third record) is corruption naming it,
  // and nothing changes.
  uint8_t byte = 0;
  db.download(&byte, static_cast<uint8_t*>(in) + 2 * bb + 100, 1);
  const uint8_t flipped = uint8_t(byte ^ 0x10);
  db.upload(static_cast<uint8_t*>(in) + 2 * bb + 100, &flipped, 1);
  st = dst.dev->import_blocks_from(b, prompt.data(), 29, headers, in);
  CHECK(st.code() == Code::corruption);
  CHECK(st.message().find("block 3") != std::string::npos);
  CHECK(dst.dev->sequence_length(b) == 8);
  db.upload(static_cast<uint8_t*>(in) + 2 * bb + 100, &byte, 1);
  // Other tokens give other keys: refused.
  std::vector<int32_t> other = prompt;
  other[20] = (other[20] + 1) % V;
  st = dst.dev->import_blocks_from(b, other.data(), 29, headers, in);
  CHECK(st.code() == Code::invalid_argument);
  CHECK(dst.dev->sequence_length(b) == 8);

  dst.fence->traffic = {};
  dst.fence->checksummed_blocks = 0;
  st = dst.dev->import_blocks_from(b, prompt.data(), 29, headers, in);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CHECK(dst.fence->traffic.uploads == 0);
  CHECK(dst.fence->traffic.downloads == 0);
  CHECK(dst.fence->checksummed_blocks == 3);
  REQUIRE(dst.cpu->import_blocks(bc, prompt.data(), 29, *host).ok());
  CHECK(dst.dev->sequence_length(b) == 29);
  // Decoding goes on with the source engine's bits.
  const int32_t next = 3;
  std::vector<float> want(nv), got(nv), ref(nv);
  REQUIRE(src.cpu->forward({{ac, &next, 1}}, want.data()).ok());
  REQUIRE(dst.dev->forward({{b, &next, 1}}, got.data()).ok());
  REQUIRE(dst.cpu->forward({{bc, &next, 1}}, ref.data()).ok());
  CHECK(same(got, want));
  CHECK(same(ref, want));
  CHECK(src.fence->violations.empty());
  CHECK(dst.fence->violations.empty());

  // On host memory (the CPU backend) the same calls hash on the host (the
  // sequence grew by a token since).
  auto now = src.cpu->export_blocks(ac, 1);
  REQUIRE(now.ok());
  void* hbuf = src.cpu->backend().alloc(3 * bb);
  std::vector<BlockHeader> hh;
  REQUIRE(src.cpu->export_blocks_to(ac, 1, hbuf, hh).ok());
  REQUIRE(hh.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(hh[i].checksum == (*now)[i].header.checksum);
    CHECK(std::memcmp(static_cast<uint8_t*>(hbuf) + i * bb, (*now)[i].bytes.data(), bb) == 0);
  }
  CHECK(src.cpu->export_blocks_to(ac, 5, hbuf, hh).code() == Code::invalid_argument);
  src.cpu->backend().free(hbuf);
  sb.free(out);
  db.free(in);
}
