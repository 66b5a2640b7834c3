// Chat templates: a conversation (system / user / assistant messages, with
// `<image>` markers where images go) -> the prompt text a chat model was
// trained on, and that text -> prompt tokens with the template's special
// tokens as single ids. Built in, no Jinja engine: a GGUF's
// tokenizer.chat_template is recognised by distinctive substrings, as
// llama.cpp's llm_chat_detect_template did before it embedded Jinja, and
// mapped to one of these.
//
//   chatml      <|im_start|>ROLE\nCONTENT<|im_end|>\n ... <|im_start|>assistant\n
//   llama-2     <s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nUSER [/INST] ASSISTANT </s><s>[INST] ...
//               (Meta's Llama-2-chat Jinja: the system message only first,
//               then user / assistant alternating; user and assistant text
//               stripped; no generation prompt)
//   llama-3     <|begin_of_text|><|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>
//               ... <|start_header_id|>assistant<|end_header_id|>\n\n (content trimmed)
//   mistral-v7  [SYSTEM_PROMPT] SYS[/SYSTEM_PROMPT][INST] USER[/INST] ASSISTANT</s>
//   phi3        <|ROLE|>\nCONTENT<|end|>\n ... <|assistant|>\n
//   zephyr      <|ROLE|>\nCONTENT<|endoftext|>\n ... <|assistant|>\n
//   gemma       <start_of_turn>user\n[SYS\n\n]CONTENT<end_of_turn>\n ... <start_of_turn>model\n
//               (system merged into the next user turn, content trimmed)
//   shapes      the project's VLM (models/shapes/README.md): the image(s),
//               then the prompt words; one user message, nothing else
// Every template but llama-2 and llama-3 writes no BOS: the tokenizer's
// rule (tokenizer.ggml.add_bos_token) adds it. The outputs of chatml,
// mistral-v7, phi3, zephyr, gemma and llama-3 (but for its BOS text) are
// llama.cpp's llm_chat_apply_template's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/image.h"
#include "model/request.h"
#include "model/tokenizer.h"

namespace cleave {
class GgufFile;
}

namespace cleave::server {

struct ChatMessage {
  std::string role;  // "system", "developer" (taken as system, as OpenAI does), "user", "assistant"
  // The message's text with one `<image>` (kImageMarker) per image, where the
  // image goes; a marker never comes from the user's own text.
  std::string text;
  int32_t n_images = 0;
};

struct ChatTemplateInfo {
  std::string_view name;
  // The BOS text the template writes itself ("<s>", "<|begin_of_text|>"),
  // tokenised as the tokenizer's BOS; the prompt then gets no other BOS.
  // Empty: the template writes none and the tokenizer's rule adds it.
  std::string_view bos_text;
  std::string_view eos_text;  // the template's EOS text, tokenised as the tokenizer's EOS
  // The canonical tokenizer.chat_template Jinja text (what a GGUF would
  // carry); empty when cleave does not embed one.
  std::string_view jinja;
  bool adds_bos_text() const { return !bos_text.empty(); }
};

// The shapes template as Jinja, to embed as a GGUF's tokenizer.chat_template;
// detect_chat_template() recognises exactly this text. Adjacent text parts
// are joined with "\n" (as the OpenAI parser joins them).
inline constexpr std::string_view kShapesChatTemplateJinja =
    "{%- if messages | length != 1 or messages[0]['role'] != 'user' -%}"
    "{{- raise_exception('the shapes template takes exactly one user message: images, then text') -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(text=false) -%}"
    "{%- for part in messages[0]['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    "{%- if ns.text -%}{{- raise_exception('the shapes template takes the images before the text') -}}{%- endif -%}"
    "<image>"
    "{%- elif part['type'] == 'text' -%}"
    "{%- if ns.text -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set ns.text = true -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}";

// The built-in names, sorted.
std::vector<std::string> chat_template_names();

// invalid_argument listing the names for one that is not built in.
Result<ChatTemplateInfo> chat_template_info(std::string_view name);

// The built-in template a GGUF's tokenizer.chat_template text stands for (a
// built-in name is taken as itself). invalid_argument listing the names
// ("--chat-template NAME") when the text is empty or not recognised (also
// for families llama.cpp knows that are not built in here: mistral v1/v3,
// llama-2 without <<SYS>>, phi4, ...).
Result<std::string> detect_chat_template(std::string_view gguf_template);

// A rendered conversation: text, and the template's own special tokens.
// Special tokens never come from message text, so a user who types
// "<|im_start|>" gets that text, not the token.
struct ChatPiece {
  bool special = false;
  std::string text;
  bool operator==(const ChatPiece&) const = default;
};

// invalid_argument naming the problem: an unknown template name or role
// (naming it), a message whose `<image>` markers are not n_images, and
// conversations the template cannot express (llama-2: a system message
// after the first or roles not alternating user / assistant; shapes:
// anything but one user message whose images come before its text). The
// generation prompt (the assistant turn's header) is added when asked and
// the template has one.
Result<std::vector<ChatPiece>> render_chat(std::string_view name, const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt = true);
// The same pieces as one text.
Result<std::string> apply_chat_template(std::string_view name, const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt = true);

// A special token's id from its text; -1 when the vocabulary has none.
using SpecialTokenLookup = std::function<int32_t(std::string_view text)>;

// The control and user-defined tokens of a GGUF's vocabulary
// (tokenizer.ggml.tokens with tokenizer.ggml.token_type 3 or 4).
// corruption when the arrays do not fit; a file without token types has
// none.
Result<SpecialTokenLookup> special_tokens_from_gguf(const GgufFile& file);

// Prompt tokens of rendered pieces, as llama.cpp tokenises a chat prompt
// with parse_special: BOS by the tokenizer's rule unless the template
// writes its own, each special piece one id (bos_text -> tokenizer.bos(),
// eos_text -> eos(), others through `special`, which may be empty; one the
// vocabulary lacks stays text), the text between them tokenised without BOS
// (SentencePiece gives each run its leading space, as llama.cpp does after
// a special token); a text run with `<image>` markers goes through
// build_image_prompt (model/multimodal.h) with the next of `images`
// (image_tokens placeholders each). invalid_argument when the markers and
// images differ in number, or images come with image_tokens < 1.
Result<GenerateRequest> tokenize_chat(const std::vector<ChatPiece>& pieces, const ChatTemplateInfo& info,
                                      const Tokenizer& tokenizer, const SpecialTokenLookup& special,
                                      std::vector<RgbImage> images, int32_t image_tokens);

}  // namespace cleave::server
