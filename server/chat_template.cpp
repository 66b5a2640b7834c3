#include "server/chat_template.h"

#include <algorithm>
#include <memory>
#include <unordered_map>

#include "model/gguf.h"
#include "model/multimodal.h"

namespace cleave::server {
namespace {

Status bad(std::string what) { return Status(Code::invalid_argument, std::move(what)); }

// The canonical Jinja of the built-ins cleave can embed (besides shapes).
constexpr std::string_view kChatmlJinja =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
constexpr std::string_view kLlama2Jinja =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}";
constexpr std::string_view kLlama3Jinja =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

constexpr ChatTemplateInfo kTemplates[] = {
    {"chatml", "", "", kChatmlJinja},
    {"gemma", "", "", ""},
    {"llama-2", "<s>", "</s>", kLlama2Jinja},
    {"llama-3", "<|begin_of_text|>", "", kLlama3Jinja},
    {"mistral-v7", "", "</s>", ""},
    {"phi3", "", "", ""},
    {"shapes", "", "", kShapesChatTemplateJinja},
    {"zephyr", "", "", ""},
};

std::string names_list() {
  std::string s;
  for (const ChatTemplateInfo& t : kTemplates) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

bool contains(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

size_t count_markers(std::string_view text) {
  size_t n = 0;
  for (size_t at = text.find(kImageMarker); at != std::string_view::npos;
       at = text.find(kImageMarker, at + kImageMarker.size()))
    ++n;
  return n;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

// Pieces under construction: adjacent text merges.
struct Out {
  std::vector<ChatPiece> pieces;
  void text(std::string_view t) {
    if (t.empty()) return;
    if (!pieces.empty() && !pieces.back().special) pieces.back().text += t;
    else pieces.push_back({false, std::string(t)});
  }
  void special(std::string_view t) { pieces.push_back({true, std::string(t)}); }
};

using Messages = std::vector<ChatMessage>;  // roles normalised: developer -> system

void chatml(const Messages& m, bool gen, Out& o) {
  for (const ChatMessage& msg : m) {
    o.special("<|im_start|>");
    o.text(msg.role + "\n" + msg.text);
    o.special("<|im_end|>");
    o.text("\n");
  }
  if (gen) {
    o.special("<|im_start|>");
    o.text("assistant\n");
  }
}

// <|ROLE|>\nCONTENT END\n (phi3: <|end|>, zephyr: <|endoftext|>).
void role_tags(const Messages& m, bool gen, std::string_view end, Out& o) {
  for (const ChatMessage& msg : m) {
    o.special("<|" + msg.role + "|>");
    o.text("\n" + msg.text);
    o.special(end);
    o.text("\n");
  }
  if (gen) {
    o.special("<|assistant|>");
    o.text("\n");
  }
}

void llama3(const Messages& m, bool gen, Out& o) {
  o.special("<|begin_of_text|>");
  auto header = [&](const std::string& role) {
    o.special("<|start_header_id|>");
    o.text(role);
    o.special("<|end_header_id|>");
  };
  for (const ChatMessage& msg : m) {
    header(msg.role);
    o.text("\n\n" + trim(msg.text));
    o.special("<|eot_id|>");
  }
  if (gen) {
    header("assistant");
    o.text("\n\n");
  }
}

Status llama2(const Messages& m, Out& o) {
  size_t first = 0;
  const bool has_system = !m.empty() && m[0].role == "system";
  if (has_system) first = 1;
  for (size_t i = first; i < m.size(); ++i) {
    const bool want_user = (i - first) % 2 == 0;
    if (m[i].role != (want_user ? "user" : "assistant"))
      return bad("the llama-2 template takes an optional system message first, then user and assistant "
                 "messages alternating from a user one; messages[" + std::to_string(i) + "] is " +
                 m[i].role);
    std::string content = m[i].text;
    if (i == first && has_system) content = "<<SYS>>\n" + m[0].text + "\n<</SYS>>\n\n" + content;
    if (want_user) {
      o.special("<s>");
      o.text("[INST] " + trim(content) + " [/INST]");
    } else {
      o.text(" " + trim(content) + " ");
      o.special("</s>");
    }
  }
  return Status::Ok();
}

void mistral_v7(const Messages& m, Out& o) {
  for (const ChatMessage& msg : m) {
    if (msg.role == "system") {
      o.special("[SYSTEM_PROMPT]");
      o.text(" " + msg.text);
      o.special("[/SYSTEM_PROMPT]");
    } else if (msg.role == "user") {
      o.special("[INST]");
      o.text(" " + msg.text);
      o.special("[/INST]");
    } else {
      o.text(" " + msg.text);
      o.special("</s>");
    }
  }
}

void gemma(const Messages& m, bool gen, Out& o) {
  std::string system;
  for (const ChatMessage& msg : m) {
    if (msg.role == "system") {  // no system turn: merged into the next user turn (llama.cpp)
      system = trim(msg.text);
      continue;
    }
    const std::string role = msg.role == "assistant" ? "model" : msg.role;
    o.special("<start_of_turn>");
    std::string body = role + "\n";
    if (!system.empty() && role != "model") {
      body += system + "\n\n";
      system.clear();
    }
    o.text(body + trim(msg.text));
    o.special("<end_of_turn>");
    o.text("\n");
  }
  if (gen) {
    o.special("<start_of_turn>");
    o.text("model\n");
  }
}

Status shapes(const Messages& m, Out& o) {
  if (m.size() != 1 || m[0].role != "user") {
    for (size_t i = 0; i < m.size(); ++i)
      if (m[i].role != "user")
        return bad("the shapes template takes exactly one user message (images, then text); messages[" +
                   std::to_string(i) + "] has the role " + m[i].role);
    return bad("the shapes template takes exactly one user message (images, then text), got " +
               std::to_string(m.size()) + " user messages");
  }
  const std::string& text = m[0].text;
  size_t at = 0;
  for (int32_t i = 0; i < m[0].n_images; ++i) {
    if (text.compare(at, kImageMarker.size(), kImageMarker) != 0)
      return bad("the shapes template takes the images before the text");
    at += kImageMarker.size();
  }
  o.text(text);
  return Status::Ok();
}

}  // namespace

std::vector<std::string> chat_template_names() {
  std::vector<std::string> names;
  for (const ChatTemplateInfo& t : kTemplates) names.emplace_back(t.name);
  return names;  // kTemplates is sorted
}

Result<ChatTemplateInfo> chat_template_info(std::string_view name) {
  for (const ChatTemplateInfo& t : kTemplates)
    if (t.name == name) return t;
  return bad("unknown chat template \"" + std::string(name) + "\"; the built-in ones are: " + names_list());
}

Result<std::string> detect_chat_template(std::string_view t) {
  const std::string pick = "; pick one with --chat-template NAME, NAME one of: " + names_list();
  if (t.empty()) return bad("the model has no tokenizer.chat_template" + pick);
  for (const ChatTemplateInfo& info : kTemplates)
    if (t == info.name || (!info.jinja.empty() && t == info.jinja)) return std::string(info.name);
  auto unknown = [&](std::string_view family) -> Status {
    return bad("tokenizer.chat_template looks like " + std::string(family) +
               ", which is not built into cleave" + pick);
  };
  if (contains(t, "<|im_start|>")) {
    if (contains(t, "<|im_sep|>")) return unknown("phi4");
    if (contains(t, "<end_of_utterance>")) return unknown("smolvlm");
    return std::string("chatml");
  }
  if (t.substr(0, 7) == "mistral" || contains(t, "[INST]")) {
    if (contains(t, "[SYSTEM_PROMPT]")) return std::string("mistral-v7");
    if (contains(t, "' [INST] ' + system_message") || contains(t, "[AVAILABLE_TOOLS]"))
      return unknown("mistral v1 / v3");
    if (contains(t, "<<SYS>>")) return std::string("llama-2");
    return unknown("llama-2 without a system prompt (<<SYS>>)");
  }
  if (contains(t, "<|assistant|>") && contains(t, "<|end|>")) return std::string("phi3");
  if (contains(t, "<|assistant|>") && contains(t, "<|user|>")) return unknown("falcon3 / glmedge");
  if (contains(t, "<|user|>") && contains(t, "<|endoftext|>")) return std::string("zephyr");
  if (contains(t, "<start_of_turn>")) return std::string("gemma");
  if (contains(t, "<|start_header_id|>") && contains(t, "<|end_header_id|>")) return std::string("llama-3");
  return bad("tokenizer.chat_template is not a template cleave recognises" + pick);
}

Result<std::vector<ChatPiece>> render_chat(std::string_view name, const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt) {
  auto info = chat_template_info(name);
  if (!info.ok()) return info.status();
  Messages m = messages;
  for (size_t i = 0; i < m.size(); ++i) {
    ChatMessage& msg = m[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (msg.role == "developer") msg.role = "system";
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
      return bad(where + " has the role \"" + msg.role +
                 "\"; the chat templates know system, developer, user and assistant");
    if (msg.n_images < 0 || count_markers(msg.text) != size_t(msg.n_images))
      return bad(where + "'s text holds " + std::to_string(count_markers(msg.text)) + " " +
                 std::string(kImageMarker) + " markers but it has " + std::to_string(msg.n_images) +
                 " images");
  }
  Out o;
  const std::string_view n = info->name;
  if (n == "chatml") chatml(m, add_generation_prompt, o);
  else if (n == "phi3") role_tags(m, add_generation_prompt, "<|end|>", o);
  else if (n == "zephyr") role_tags(m, add_generation_prompt, "<|endoftext|>", o);
  else if (n == "llama-3") llama3(m, add_generation_prompt, o);
  else if (n == "mistral-v7") mistral_v7(m, o);
  else if (n == "gemma") gemma(m, add_generation_prompt, o);
  else if (n == "llama-2") CLEAVE_RETURN_IF_ERROR(llama2(m, o));
  else CLEAVE_RETURN_IF_ERROR(shapes(m, o));
  return std::move(o.pieces);
}

Result<std::string> apply_chat_template(std::string_view name, const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt) {
  auto pieces = render_chat(name, messages, add_generation_prompt);
  if (!pieces.ok()) return pieces.status();
  std::string s;
  for (const ChatPiece& p : *pieces) s += p.text;
  return s;
}

Result<SpecialTokenLookup> special_tokens_from_gguf(const GgufFile& file) {
  auto map = std::make_shared<std::unordered_map<std::string, int32_t>>();
  if (file.find("tokenizer.ggml.token_type")) {
    auto tokens = file.get_string_array("tokenizer.ggml.tokens");
    if (!tokens.ok()) return Status(Code::corruption, "special tokens: " + tokens.status().message());
    auto types = file.get_int_array("tokenizer.ggml.token_type");
    if (!types.ok()) return Status(Code::corruption, "special tokens: " + types.status().message());
    if (types->size() != tokens->size())
      return Status(Code::corruption, "special tokens: tokenizer.ggml.token_type has " +
                                          std::to_string(types->size()) + " entries but tokenizer.ggml.tokens has " +
                                          std::to_string(tokens->size()));
    for (size_t i = 0; i < tokens->size(); ++i)
      if ((*types)[i] == 3 || (*types)[i] == 4) (*map)[(*tokens)[i]] = int32_t(i);  // control, user-defined
  }
  return SpecialTokenLookup([map](std::string_view text) -> int32_t {
    auto it = map->find(std::string(text));
    return it == map->end() ? -1 : it->second;
  });
}

Result<GenerateRequest> tokenize_chat(const std::vector<ChatPiece>& pieces, const ChatTemplateInfo& info,
                                      const Tokenizer& tokenizer, const SpecialTokenLookup& special,
                                      std::vector<RgbImage> images, int32_t image_tokens) {
  if (!images.empty() && image_tokens < 1)
    return bad("the prompt has images but this server has no vision encoder (--mmproj)");
  // Special pieces the vocabulary has become ids; the rest merges into text runs.
  struct Run {
    int32_t id = -1;  // >= 0: one token
    std::string text;
  };
  std::vector<Run> runs;
  for (const ChatPiece& p : pieces) {
    int32_t id = -1;
    if (p.special) {
      if (!info.bos_text.empty() && p.text == info.bos_text) id = tokenizer.bos();
      else if (!info.eos_text.empty() && p.text == info.eos_text) id = tokenizer.eos();
      else if (special) id = special(p.text);
    }
    if (id >= 0) runs.push_back({id, {}});
    else if (!runs.empty() && runs.back().id < 0) runs.back().text += p.text;
    else runs.push_back({-1, p.text});
  }
  GenerateRequest r;
  if (!info.adds_bos_text()) {  // BOS by the tokenizer's rule (an empty text gives just that)
    const std::vector<int32_t> bos = tokenizer.encode("", true);
    if (!bos.empty() && bos[0] == tokenizer.bos()) r.prompt.push_back(bos[0]);
  }
  size_t next_image = 0;
  for (Run& run : runs) {
    if (run.id >= 0) {
      r.prompt.push_back(run.id);
      continue;
    }
    const size_t markers = count_markers(run.text);
    if (markers == 0) {
      const std::vector<int32_t> ids = tokenizer.encode(run.text, false);
      r.prompt.insert(r.prompt.end(), ids.begin(), ids.end());
      continue;
    }
    if (next_image + markers > images.size())
      return bad("the chat prompt has more " + std::string(kImageMarker) + " markers than its " +
                 std::to_string(images.size()) + " images");
    std::vector<RgbImage> mine(std::make_move_iterator(images.begin() + ptrdiff_t(next_image)),
                               std::make_move_iterator(images.begin() + ptrdiff_t(next_image + markers)));
    next_image += markers;
    auto part = build_image_prompt(tokenizer, run.text, std::move(mine), image_tokens, false);
    if (!part.ok()) return part.status();
    const int32_t offset = int32_t(r.prompt.size());
    r.prompt.insert(r.prompt.end(), part->prompt.begin(), part->prompt.end());
    for (PromptImage& im : part->images) {
      im.position += offset;
      r.images.push_back(std::move(im));
    }
  }
  if (next_image != images.size())
    return bad("the chat prompt has " + std::to_string(next_image) + " " + std::string(kImageMarker) +
               " markers but " + std::to_string(images.size()) + " images");
  return r;
}

}  // namespace cleave::server
