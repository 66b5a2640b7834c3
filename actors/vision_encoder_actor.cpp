// The vision_encoder actor: a VisionEncoder (model/vision_encoder.h) that
// batches the requests arriving between two steps and answers each with
// its images' embeddings (or a typed error for that request alone).
#include "actors/actor_types.h"
#include "model/vision_encoder.h"
#include "schema/codec.h"

namespace cleave::actors {
namespace {

struct VisionState {
  struct Job {
    msg::EncodeRequest request;
    caf::typed_response_promise<Bytes> reply;
  };
  std::shared_ptr<VisionEncoder> encoder;
  std::string origin;  // "vision_encoder/0", "NODE/vision_encoder/0"
  std::vector<Job> queue;
  bool step_queued = false;
  uint64_t requests = 0, replies = 0, failed = 0, bad_messages = 0, steps = 0;
  static inline const char* name = "cleave.vision_encoder";
};
using vision_pointer = vision_encoder_actor::stateful_pointer<VisionState>;

// Encodes every request that arrived since the last step in one batch and
// answers each (the encoder fails a bad request alone).
void run_encode_step(vision_pointer self) {
  auto& s = self->state;
  s.step_queued = false;
  std::vector<VisionState::Job> jobs;
  jobs.swap(s.queue);
  std::vector<std::vector<PromptImage>*> groups;
  std::vector<uint64_t> ids;
  for (auto& j : jobs) {
    groups.push_back(&j.request.images);
    ids.push_back(j.request.request_id);
  }
  const auto t0 = Clock::now();
  const std::vector<Status> status = s.encoder->encode(groups, ids);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ++s.steps;
  for (size_t k = 0; k < jobs.size(); ++k) {
    if (!status[k].ok()) {
      ++s.failed;
      jobs[k].reply.deliver(to_error(status[k]));
      continue;
    }
    msg::ImageEmbeddings m;
    m.request_id = ids[k];
    m.images = std::move(jobs[k].request.images);
    for (PromptImage& im : m.images) im.image.rgb = {};  // the router has them
    m.origin = s.origin;
    m.seconds = seconds;
    ++s.replies;
    jobs[k].reply.deliver(codec::encode(m));
  }
}

vision_encoder_actor::behavior_type vision_encoder_fn(vision_pointer self,
                                                      std::shared_ptr<VisionEncoder> encoder,
                                                      std::string origin) {
  self->state.encoder = std::move(encoder);
  self->state.origin = std::move(origin);
  return {
      [=](encode_atom, const Bytes& bytes) -> caf::result<Bytes> {
        auto& s = self->state;
        auto request = codec::decode_as<msg::EncodeRequest>(bytes);
        if (!request.ok()) {
          ++s.bad_messages;
          return to_error(request.status());
        }
        ++s.requests;
        auto reply = self->make_response_promise<Bytes>();
        s.queue.push_back({std::move(request.value()), reply});
        if (!s.step_queued) {  // after the messages already queued
          s.step_queued = true;
          self->send(caf::actor_cast<vision_encoder_actor>(self), step_atom::value);
        }
        return reply;
      },
      [=](step_atom) { run_encode_step(self); },
      [=](stats_atom) -> Bytes {
        auto& s = self->state;
        const VisionEncoderCounters c = s.encoder->counters();
        return encode_stats(s.origin, {{"requests", s.requests},
                                       {"replies", s.replies},
                                       {"failures", s.failed + s.bad_messages},
                                       {"bad_messages", s.bad_messages},
                                       {"steps", s.steps},
                                       {"images", c.images},
                                       {"cache_hits", c.cache_hits},
                                       {"cache_misses", c.cache_misses},
                                       {"cache_evictions", c.cache_evictions},
                                       {"cache_entries", c.cache_entries},
                                       {"cache_bytes", c.cache_bytes},
                                       {"batches", c.batches},
                                       {"encode_us", uint64_t(c.encode_seconds * 1e6)}});
      },
  };
}

}  // namespace

vision_encoder_actor spawn_vision_encoder(caf::actor_system& system,
                                          std::shared_ptr<VisionEncoder> encoder, std::string origin) {
  return system.spawn<caf::detached>(vision_encoder_fn, std::move(encoder), std::move(origin));
}

}  // namespace cleave::actors
