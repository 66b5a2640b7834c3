#include "model/expert_set.h"

#include <algorithm>

namespace cleave {

namespace {

int32_t last_layer_of(const ExpertSet& s, const LlamaConfig& c) {
  return s.last_layer < 0 ? c.n_layers - 1 : s.last_layer;
}

}  // namespace

bool ExpertSet::holds(const LlamaConfig& c, int32_t layer, int32_t expert) const {
  if (layer < first_layer || layer > last_layer_of(*this, c)) return false;
  if (expert < 0 || expert >= experts_per_layer(c)) return false;
  return experts.empty() || std::find(experts.begin(), experts.end(), expert) != experts.end();
}

Status ExpertSet::validate(const LlamaConfig& c) const {
  const int32_t last = last_layer_of(*this, c);
  if (first_layer < 0 || first_layer >= c.n_layers || last >= c.n_layers || last < first_layer)
    return Status(Code::invalid_argument,
                  "expert layers " + std::to_string(first_layer) + "-" + std::to_string(last) +
                      " are not a range inside the model's " + std::to_string(c.n_layers) + " layers");
  const int32_t n = experts_per_layer(c);
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] < 0 || experts[i] >= n)
      return Status(Code::invalid_argument,
                    "expert " + std::to_string(experts[i]) + " is not one of the model's " +
                        std::to_string(n) + (c.n_experts > 0 ? " experts" : " (a dense model's FFN is expert 0)"));
    if (std::find(experts.begin(), experts.begin() + ptrdiff_t(i), experts[i]) !=
        experts.begin() + ptrdiff_t(i))
      return Status(Code::invalid_argument, "expert " + std::to_string(experts[i]) + " is listed twice");
  }
  return Status::Ok();
}

std::string ExpertSet::describe() const {
  std::string s = "layers " + std::to_string(first_layer) + "-" +
                  (last_layer < 0 ? std::string("last") : std::to_string(last_layer)) + ", experts ";
  if (experts.empty()) return s + "all";
  s += "{";
  for (size_t i = 0; i < experts.size(); ++i) s += (i ? ", " : "") + std::to_string(experts[i]);
  return s + "}";
}

std::string ExpertSet::spec() const {
  std::string s;
  for (size_t i = 0; i < experts.size(); ++i) s += (i ? "," : "") + std::to_string(experts[i]);
  if (experts.empty()) s = "all";
  if (first_layer == 0 && last_layer < 0) return s;
  return s + "@" + std::to_string(first_layer) + "-" + (last_layer < 0 ? "" : std::to_string(last_layer));
}

Status check_expert_coverage(const LlamaConfig& c, std::span<const ExpertSet> sets) {
  for (int32_t l = 0; l < c.n_layers; ++l)
    for (int32_t e = 0; e < experts_per_layer(c); ++e) {
      bool held = false;
      for (const ExpertSet& s : sets) held = held || s.holds(c, l, e);
      if (!held)
        return Status(Code::not_found, "expert " + std::to_string(e) + " of layer " +
                                           std::to_string(l) + " has no host");
    }
  return Status::Ok();
}

namespace {

// A whole non-negative number of at most 9 digits, or -1.
int32_t parse_index(const std::string& s) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return int32_t(std::stoi(s));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t at = 0;
  for (;;) {
    const size_t next = s.find(sep, at);
    out.push_back(s.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) return out;
    at = next + 1;
  }
}

// "3" or "0-5" -> [first, last]; with open_end, "2-" -> [2, -1] too;
// false when it is none of these.
bool parse_range(const std::string& s, int32_t& first, int32_t& last, bool open_end = false) {
  const size_t dash = s.find('-');
  if (open_end && dash != std::string::npos && dash + 1 == s.size()) {
    first = parse_index(s.substr(0, dash));
    last = -1;
    return first >= 0;
  }
  first = parse_index(s.substr(0, dash));
  last = dash == std::string::npos ? first : parse_index(s.substr(dash + 1));
  return first >= 0 && last >= first;
}

}  // namespace

Result<std::vector<ExpertSet>> parse_expert_sets(const std::string& spec) {
  std::vector<ExpertSet> sets;
  if (spec.empty()) return Status(Code::invalid_argument, "--experts: no expert sets");
  for (const std::string& piece : split(spec, ';')) {
    auto bad = [&](const std::string& why) {
      return Status(Code::invalid_argument, "--experts: '" + piece + "': " + why);
    };
    ExpertSet set;
    const size_t at = piece.find('@');
    const std::string ids = piece.substr(0, at);
    if (at != std::string::npos &&
        !parse_range(piece.substr(at + 1), set.first_layer, set.last_layer, /*open_end=*/true))
      return bad("layers must be L, L-L (first <= last) or L- (to the last layer)");
    if (ids != "all") {
      if (ids.empty()) return bad("no experts (give ids, ranges or all)");
      for (const std::string& r : split(ids, ',')) {
        int32_t first = 0, last = 0;
        if (!parse_range(r, first, last) || last - first > 65535)
          return bad("'" + r + "' is not an expert id or range (E or E-E)");
        for (int32_t e = first; e <= last; ++e) set.experts.push_back(e);
      }
    }
    sets.push_back(std::move(set));
  }
  return sets;
}

}  // namespace cleave
