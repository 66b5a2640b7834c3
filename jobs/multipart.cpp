#include "jobs/multipart.h"

#include <cctype>

namespace cleave::jobs {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The value of `key` among "; key=value" parameters (quoted or not).
std::string param(std::string_view header, std::string_view key) {
  size_t pos = 0;
  while ((pos = header.find(';', pos)) != std::string_view::npos) {
    ++pos;
    std::string_view rest = trim(header.substr(pos));
    const size_t eq = rest.find('=');
    if (eq == std::string_view::npos) continue;
    if (lower(trim(rest.substr(0, eq))) != key) continue;
    std::string_view v = rest.substr(eq + 1);
    if (!v.empty() && v.front() == '"') {
      std::string out;
      for (size_t i = 1; i < v.size() && v[i] != '"'; ++i) {
        if (v[i] == '\\' && i + 1 < v.size()) ++i;
        out.push_back(v[i]);
      }
      return out;
    }
    return std::string(trim(v.substr(0, v.find(';'))));
  }
  return {};
}

Status bad(std::string what) { return Status(Code::invalid_argument, "multipart body: " + std::move(what)); }

}  // namespace

Result<std::string> multipart_boundary(std::string_view content_type) {
  const std::string type = lower(trim(content_type.substr(0, content_type.find(';'))));
  if (type != "multipart/form-data")
    return bad("Content-Type must be multipart/form-data, got \"" + std::string(content_type.substr(0, 100)) + "\"");
  std::string b = param(content_type, "boundary");
  if (b.empty() || b.size() > 70) return bad("the Content-Type needs a boundary of 1 to 70 characters");
  return b;
}

Result<std::vector<FormPart>> parse_multipart(std::string_view body, std::string_view boundary) {
  const std::string delim = "--" + std::string(boundary);
  std::vector<FormPart> parts;
  size_t pos = body.find(delim);
  if (pos == std::string_view::npos) return bad("no boundary delimiter");
  for (;;) {
    pos += delim.size();
    if (body.substr(pos, 2) == "--") return parts;  // the closing delimiter
    if (body.substr(pos, 2) != "\r\n") return bad("a delimiter is not followed by CRLF");
    pos += 2;
    const size_t head_end = body.find("\r\n\r\n", pos);
    if (head_end == std::string_view::npos) return bad("a part's headers do not end");
    FormPart part;
    std::string_view headers = body.substr(pos, head_end - pos);
    while (!headers.empty()) {
      const size_t eol = headers.find("\r\n");
      std::string_view line = headers.substr(0, eol);
      headers = eol == std::string_view::npos ? std::string_view() : headers.substr(eol + 2);
      const size_t colon = line.find(':');
      if (colon == std::string_view::npos) return bad("a part header has no ':'");
      const std::string name = lower(trim(line.substr(0, colon)));
      const std::string_view value = trim(line.substr(colon + 1));
      if (name == "content-disposition") {
        if (lower(value.substr(0, value.find(';'))) != "form-data")
          return bad("a part's Content-Disposition is not form-data");
        part.name = param(value, "name");
        part.filename = param(value, "filename");
      } else if (name == "content-type") {
        part.content_type = std::string(value);
      }
    }
    if (part.name.empty()) return bad("a part has no name (Content-Disposition: form-data; name=...)");
    const size_t data = head_end + 4;
    const size_t next = body.find("\r\n" + delim, data);
    if (next == std::string_view::npos) return bad("the body has no closing delimiter");
    part.data = std::string(body.substr(data, next - data));
    parts.push_back(std::move(part));
    pos = next + 2;
  }
}

}  // namespace cleave::jobs
