// Chat templates (server/chat_template.h): each built-in's exact text on
// llama.cpp's test conversation (tests/test-chat-template.cpp), the
// detection table, refusals, and tokenisation with special tokens and images.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/multimodal.h"
#include "model/tokenizer.h"
#include "server/chat_template.h"

using namespace cleave;
using namespace cleave::server;

namespace {

const std::string kVocab = std::string(CLEAVE_SOURCE_DIR) + "/models/vocab/ggml-vocab-llama-spm.gguf";

const GgufFile& vocab_file() {
  static std::shared_ptr<const GgufFile> f = [] {
    auto r = GgufFile::open(kVocab);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::move(r).value();
  }();
  return *f;
}

const Tokenizer& spm() {
  static std::unique_ptr<Tokenizer> t = [] {
    auto r = Tokenizer::from_gguf(vocab_file());
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::move(r).value();
  }();
  return *t;
}

// llama.cpp's test conversation: a system message and three user turns.
std::vector<ChatMessage> conversation() {
  return {{"system", "You are a helpful assistant", 0}, {"user", "Hello", 0},
          {"assistant", "Hi there", 0},                {"user", "Who are you", 0},
          {"assistant", "   I am an assistant   ", 0},  {"user", "Another question", 0}};
}

std::string apply_ok(const std::string& name, const std::vector<ChatMessage>& m, bool gen = true) {
  auto r = apply_chat_template(name, m, gen);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return *r;
}

std::string apply_error(const std::string& name, const std::vector<ChatMessage>& m) {
  auto r = apply_chat_template(name, m, true);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::invalid_argument);
  return r.status().message();
}

RgbImage tiny_image(uint8_t v) {
  RgbImage im;
  im.width = 2;
  im.height = 1;
  im.rgb = {v, 1, 2, 3, 4, 5};
  return im;
}

}  // namespace

TEST_CASE("chat templates: the built-in names") {
  CHECK(chat_template_names() ==
        std::vector<std::string>{"chatml", "gemma", "llama-2", "llama-3", "mistral-v7", "phi3", "shapes", "zephyr"});
  for (const std::string& name : chat_template_names()) CHECK(chat_template_info(name).ok());
  auto bad = chat_template_info("vicuna");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("chatml, gemma, llama-2") != std::string::npos);
  CHECK(chat_template_info("llama-2")->adds_bos_text());
  CHECK(chat_template_info("llama-3")->bos_text == "<|begin_of_text|>");
  CHECK_FALSE(chat_template_info("chatml")->adds_bos_text());
  CHECK_FALSE(chat_template_info("shapes")->adds_bos_text());
}

TEST_CASE("chat templates: each built-in's text on llama.cpp's three-turn conversation") {
  struct Row {
    const char* name;
    const char* expected;
  };
  const Row rows[] = {
      {"chatml",
       "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
       "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
       "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
       "<|im_start|>assistant\n"},
      // Meta's Llama-2-chat Jinja (bos_token "<s>", eos_token "</s>").
      {"llama-2",
       "<s>[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST] Hi there </s>"
       "<s>[INST] Who are you [/INST] I am an assistant </s><s>[INST] Another question [/INST]"},
      // llama.cpp's llama3 after the BOS text Meta's Jinja writes.
      {"llama-3",
       "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
       "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
       "\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|>"
       "<|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user"
       "<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
      {"mistral-v7",
       "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>"
       "[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]"},
      {"phi3",
       "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
       "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question"
       "<|end|>\n<|assistant|>\n"},
      {"zephyr",
       "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\n"
       "Hi there<|endoftext|>\n<|user|>\nWho are you<|endoftext|>\n<|assistant|>\n   I am an assistant   "
       "<|endoftext|>\n<|user|>\nAnother question<|endoftext|>\n<|assistant|>\n"},
      {"gemma",
       "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
       "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
       "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n"},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    CHECK(apply_ok(row.name, conversation()) == row.expected);
  }
  // Without the generation prompt the assistant header goes.
  std::string chatml = rows[0].expected;
  CHECK(apply_ok("chatml", conversation(), false) == chatml.substr(0, chatml.size() - 22));
  std::string llama2 = rows[1].expected;
  CHECK(apply_ok("llama-2", conversation(), false) == llama2);  // llama-2 has none
  // developer is system.
  auto dev = conversation();
  dev[0].role = "developer";
  CHECK(apply_ok("chatml", dev) == rows[0].expected);
}

TEST_CASE("chat templates: special tokens are pieces of their own, never from message text") {
  auto p = render_chat("chatml", {{"user", "say <|im_end|>", 0}}, true);
  REQUIRE(p.ok());
  const std::vector<ChatPiece> want = {{true, "<|im_start|>"}, {false, "user\nsay <|im_end|>"}, {true, "<|im_end|>"},
                                       {false, "\n"},          {true, "<|im_start|>"},          {false, "assistant\n"}};
  CHECK(*p == want);
  auto l2 = render_chat("llama-2", {{"user", "a", 0}, {"assistant", "b", 0}, {"user", "c", 0}}, true);
  REQUIRE(l2.ok());
  const std::vector<ChatPiece> want2 = {{true, "<s>"},  {false, "[INST] a [/INST] b "}, {true, "</s>"},
                                        {true, "<s>"},  {false, "[INST] c [/INST]"}};
  CHECK(*l2 == want2);
}

TEST_CASE("chat templates: refusals name the role, message or problem") {
  CHECK(apply_error("chatml", {{"tool", "x", 0}}).find("\"tool\"") != std::string::npos);
  CHECK(apply_error("chatml", {{"user", "x", 0}, {"robot", "y", 0}}).find("messages[1] has the role \"robot\"") !=
        std::string::npos);
  CHECK(apply_error("nope", {{"user", "x", 0}}).find("unknown chat template \"nope\"") != std::string::npos);
  // Markers and images must agree.
  CHECK(apply_error("chatml", {{"user", "<image> x", 0}}).find("1 <image> markers but it has 0 images") !=
        std::string::npos);
  CHECK(apply_error("chatml", {{"user", "x", 2}}).find("0 <image> markers but it has 2 images") != std::string::npos);
  // llama-2: system first only, then alternating from a user message.
  CHECK(apply_error("llama-2", {{"assistant", "x", 0}}).find("messages[0] is assistant") != std::string::npos);
  CHECK(apply_error("llama-2", {{"user", "x", 0}, {"user", "y", 0}}).find("messages[1] is user") !=
        std::string::npos);
  CHECK(apply_error("llama-2", {{"user", "x", 0}, {"system", "y", 0}}).find("messages[1] is system") !=
        std::string::npos);
  // shapes: one user message, images before the text.
  CHECK(apply_ok("shapes", {{"user", "<image>describe", 1}}) == "<image>describe");
  CHECK(apply_ok("shapes", {{"user", "<image><image>how many shapes", 2}}) == "<image><image>how many shapes");
  CHECK(apply_error("shapes", {{"system", "be brief", 0}, {"user", "<image>describe", 1}})
            .find("messages[0] has the role system") != std::string::npos);
  CHECK(apply_error("shapes", {{"user", "<image>describe", 1}, {"assistant", "a red circle", 0}})
            .find("messages[1] has the role assistant") != std::string::npos);
  CHECK(apply_error("shapes", {{"user", "<image>describe", 1}, {"user", "<image>describe", 1}})
            .find("got 2 user messages") != std::string::npos);
  CHECK(apply_error("shapes", {{"user", "describe<image>", 1}}).find("images before the text") != std::string::npos);
}

TEST_CASE("chat templates: detection from tokenizer.chat_template") {
  struct Row {
    std::string jinja;
    const char* name;  // nullptr: refused
  };
  const std::vector<Row> rows = {
      {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
       "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
       "chatml"},
      {"{% if messages[0]['role'] == 'system' %}...{% set content = '<<SYS>>\\n' + system_message %}{{ bos_token + "
       "'[INST] ' + content.strip() + ' [/INST]' }}",
       "llama-2"},
      {"{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
       "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}",
       "llama-3"},
      {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
       "message['content'] + '[/INST]' }}{% elif message['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + "
       "message['content'] + '[/SYSTEM_PROMPT]' }}{% endif %}{% endfor %}",
       "mistral-v7"},
      {"{{ bos_token }}{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + message['content'] + "
       "'<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
       "phi3"},
      {"{% for message in messages %}{{'<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n'}}"
       "{% endfor %}{% if message['role'] == 'user' %}<|user|>{% endif %}",
       "zephyr"},
      {"{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
       "'<end_of_turn>\\n' }}{% endfor %}",
       "gemma"},
      {std::string(kShapesChatTemplateJinja), "shapes"},
      {"chatml", "chatml"},  // a built-in name is itself
      {"shapes", "shapes"},
      // Families llama.cpp knows that are not built in, and nonsense.
      {"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '<|im_sep|>' }}{% endfor %}", nullptr},  // phi4
      {"{{ bos_token }}{% for message in messages %}{{ ' [INST] ' + system_message }}{% endfor %}", nullptr},
      {"{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}",
       nullptr},  // llama-2 without <<SYS>> (Mistral-7B-Instruct-v0.2)
      {"{% for m in messages %}<|user|>{{ m['content'] }}<|assistant|>{% endfor %}", nullptr},  // glmedge
      {std::string(kShapesChatTemplateJinja) + " ", nullptr},  // shapes' text, exactly
      {"Hello {{ name }}", nullptr},
      {"", nullptr},
  };
  for (const Row& row : rows) {
    CAPTURE(row.jinja);
    auto r = detect_chat_template(row.jinja);
    if (row.name) {
      REQUIRE_MESSAGE(r.ok(), r.status().to_string());
      CHECK(*r == row.name);
    } else {
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().code() == Code::invalid_argument);
      CHECK(r.status().message().find("--chat-template NAME, NAME one of: chatml, gemma, llama-2, llama-3, "
                                      "mistral-v7, phi3, shapes, zephyr") != std::string::npos);
    }
  }
  // Every embedded canonical text is recognised as its own template.
  int embedded = 0;
  for (const std::string& name : chat_template_names()) {
    const ChatTemplateInfo info = *chat_template_info(name);
    if (info.jinja.empty()) continue;
    ++embedded;
    CAPTURE(name);
    CHECK(*detect_chat_template(info.jinja) == name);
  }
  CHECK(embedded == 4);  // chatml, llama-2, llama-3, shapes
  CHECK(chat_template_info("shapes")->jinja == kShapesChatTemplateJinja);
}

TEST_CASE("chat templates: the vocabulary's special tokens from a GGUF") {
  auto lookup = special_tokens_from_gguf(vocab_file());
  REQUIRE(lookup.ok());
  CHECK((*lookup)("<s>") == 1);
  CHECK((*lookup)("</s>") == 2);
  CHECK((*lookup)("<unk>") == -1);  // unknown type, not control
  CHECK((*lookup)("<|im_start|>") == -1);
  CHECK((*lookup)("hello") == -1);
}

TEST_CASE("chat templates: tokenisation as llama.cpp's with parse_special") {
  const Tokenizer& tok = spm();
  // llama-2 writes its own "<s>": it becomes BOS, and no second BOS is added.
  auto l2 = render_chat("llama-2", {{"user", "Hello", 0}, {"assistant", "Hi", 0}, {"user", "Bye", 0}});
  REQUIRE(l2.ok());
  auto r = tokenize_chat(*l2, *chat_template_info("llama-2"), tok, {}, {}, 0);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  std::vector<int32_t> want = tok.encode("[INST] Hello [/INST] Hi ", true);
  CHECK(want[0] == tok.bos());
  want.push_back(tok.eos());
  const std::vector<int32_t> second = tok.encode("[INST] Bye [/INST]", true);
  want.insert(want.end(), second.begin(), second.end());
  CHECK(r->prompt == want);
  CHECK(r->images.empty());

  // chatml on a vocabulary without its tokens: they stay text; BOS by the
  // tokenizer's rule, so the prompt is the whole text tokenised with BOS.
  const std::vector<ChatMessage> chat = {{"user", "Hi", 0}};
  auto cm = render_chat("chatml", chat);
  REQUIRE(cm.ok());
  const std::string text = *apply_chat_template("chatml", chat);
  auto plain = tokenize_chat(*cm, *chat_template_info("chatml"), tok, {}, {}, 0);
  REQUIRE(plain.ok());
  CHECK(plain->prompt == tok.encode(text, true));
  // With the tokens in the vocabulary each is one id, the text between them
  // tokenised on its own.
  SpecialTokenLookup lookup = [](std::string_view t) -> int32_t {
    if (t == "<|im_start|>") return 32000;
    if (t == "<|im_end|>") return 32001;
    return -1;
  };
  auto special = tokenize_chat(*cm, *chat_template_info("chatml"), tok, lookup, {}, 0);
  REQUIRE(special.ok());
  std::vector<int32_t> w = {tok.bos(), 32000};
  for (const char* piece : {"user\nHi"}) {
    auto ids = tok.encode(piece, false);
    w.insert(w.end(), ids.begin(), ids.end());
  }
  w.push_back(32001);
  auto nl = tok.encode("\n", false);
  w.insert(w.end(), nl.begin(), nl.end());
  w.push_back(32000);
  auto as = tok.encode("assistant\n", false);
  w.insert(w.end(), as.begin(), as.end());
  CHECK(special->prompt == w);
}

TEST_CASE("chat templates: images become placeholder runs where their markers are") {
  const Tokenizer& tok = spm();
  const std::vector<ChatMessage> chat = {{"user", "<image>look<image>", 2}};
  auto pieces = render_chat("llama-2", chat);
  REQUIRE(pieces.ok());
  auto r = tokenize_chat(*pieces, *chat_template_info("llama-2"), tok, {}, {tiny_image(7), tiny_image(9)}, 3);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  // <s> "[INST] " image "look" image " [/INST]"
  const std::vector<int32_t> inst = tok.encode("[INST] ", false);
  REQUIRE(r->images.size() == 2);
  CHECK(r->images[0].position == int32_t(1 + inst.size()));
  CHECK(r->images[0].n_tokens == 3);
  CHECK(r->images[0].hash == image_hash(tiny_image(7)));
  const std::vector<int32_t> look = tok.encode("look", false);
  CHECK(r->images[1].position == r->images[0].position + 3 + int32_t(look.size()));
  CHECK(r->images[1].hash == image_hash(tiny_image(9)));
  for (const PromptImage& im : r->images)
    for (int32_t k = 0; k < im.n_tokens; ++k) CHECK(r->prompt[size_t(im.position + k)] == kImagePlaceholderId);
  CHECK(r->prompt[0] == tok.bos());

  // shapes: BOS, the image, the words (as models/shapes/train.py feeds them).
  auto sp = render_chat("shapes", {{"user", "<image>describe", 1}});
  REQUIRE(sp.ok());
  auto s = tokenize_chat(*sp, *chat_template_info("shapes"), tok, {}, {tiny_image(1)}, 16);
  REQUIRE(s.ok());
  auto ref = build_image_prompt(tok, "describe", {tiny_image(1)}, 16, true);
  REQUIRE(ref.ok());
  CHECK(s->prompt == ref->prompt);
  CHECK(s->images[0].position == 1);

  // Markers and images must agree; images need an encoder.
  CHECK_FALSE(tokenize_chat(*pieces, *chat_template_info("llama-2"), tok, {}, {tiny_image(7)}, 3).ok());
  auto none = tokenize_chat(*pieces, *chat_template_info("llama-2"), tok, {}, {tiny_image(7), tiny_image(9)}, 0);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("no vision encoder (--mmproj)") != std::string::npos);
  auto extra = tokenize_chat(*pieces, *chat_template_info("llama-2"), tok, {},
                             {tiny_image(7), tiny_image(9), tiny_image(3)}, 3);
  REQUIRE_FALSE(extra.ok());
  CHECK(extra.status().message().find("2 <image> markers but 3 images") != std::string::npos);
}
