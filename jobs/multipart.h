// multipart/form-data bodies (RFC 7578), as the OpenAI clients upload files
// to POST /v1/files: the boundary from the Content-Type, then each part's
// headers (Content-Disposition: form-data; name="..."; filename="...") and
// bytes. Everything is checked: a missing or oversized boundary, a part
// without headers' end or without a name, a body without the closing
// delimiter are invalid_argument naming what is wrong.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cleave::jobs {

struct FormPart {
  std::string name;
  std::string filename;      // empty when the part is not a file
  std::string content_type;  // empty when not given
  std::string data;
};

// The boundary parameter of a multipart/form-data Content-Type.
Result<std::string> multipart_boundary(std::string_view content_type);
Result<std::vector<FormPart>> parse_multipart(std::string_view body, std::string_view boundary);

}  // namespace cleave::jobs
