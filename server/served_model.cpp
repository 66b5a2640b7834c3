#include "server/served_model.h"

#include <chrono>
#include <filesystem>

#include "model/clip.h"
#include "model/llama.h"
#include "model/multimodal.h"

namespace cleave::server {

Result<ServedModel> describe_served_model(const ServedModelArgs& args) {
  ServedModel m;
  auto lm = LlamaModel::load(args.model);
  if (!lm.ok()) return lm.status();
  const LlamaConfig& cfg = (*lm)->config();
  m.context = args.context > 0 ? args.context : cfg.context;
  m.n_vocab = cfg.n_vocab;
  if (!args.tokenizer)
    return Status(Code::invalid_argument, "the model has no tokenizer: the server needs one");
  m.tokenizer = args.tokenizer;
  m.prefill_chunk = args.prefill_chunk;
  m.created = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  m.name = args.name;
  if (m.name.empty()) m.name = std::filesystem::path(args.model_path).stem().string();

  std::string names;
  for (const std::string& n : chat_template_names()) names += (names.empty() ? "" : ", ") + n;
  if (!args.chat_template.empty()) {
    if (!chat_template_info(args.chat_template).ok())
      return Status(Code::invalid_argument, "--chat-template '" + args.chat_template +
                                                "' is not a built-in template; known: " + names);
    m.chat_template = args.chat_template;
  } else if (auto jinja = args.model->get_string("tokenizer.chat_template"); jinja.ok()) {
    auto detected = detect_chat_template(*jinja);
    if (!detected.ok())
      return Status(Code::invalid_argument,
                    "the model's tokenizer.chat_template is not one cleave knows (no Jinja "
                    "engine: built-in templates only); choose one with --chat-template NAME: " + names);
    m.chat_template = *detected;
  } else {
    m.chat_template = "chatml";  // llama.cpp's fallback for a model without a template
  }
  auto special = special_tokens_from_gguf(*args.model);
  if (!special.ok()) return special.status();
  m.special_tokens = std::move(*special);

  if (args.mmproj) {
    auto clip = ClipModel::load(args.mmproj);
    if (!clip.ok()) return clip.status();
    Status st = check_projector_fits(**clip, cfg.dim);
    if (!st.ok()) return st;
    m.image_tokens = (*clip)->config().n_patches;
  }
  return m;
}

}  // namespace cleave::server
