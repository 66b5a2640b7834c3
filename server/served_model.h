// What the server needs to know of the model it serves, read from the GGUF
// files once at start: name, context, vocabulary, tokenizer, chat template
// (the --chat-template name, else the one the GGUF carries, recognised by
// its text; refused at start when not recognised) and the vision encoder's
// image size in tokens.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "server/server.h"

namespace cleave::server {

struct ServedModelArgs {
  std::shared_ptr<const GgufFile> model;
  std::shared_ptr<const GgufFile> mmproj;  // null: text only
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string name;            // empty: general.name, else the file's stem
  std::string model_path;      // for the default name
  std::string chat_template;   // empty: from the GGUF (chatml when it has none)
  int32_t context = 0;         // 0: the model's
  int32_t prefill_chunk = 512;
};

// invalid_argument naming the template (and every known name) when the
// GGUF's template is not recognised or --chat-template is unknown; the
// model's and mmproj's own errors.
Result<ServedModel> describe_served_model(const ServedModelArgs& args);

}  // namespace cleave::server
