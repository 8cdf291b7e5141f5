#include "hostlist.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdint>

namespace ferry {
namespace {

bool all_digits(std::string_view s) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

int64_t value_of(std::string_view digits) {
  int64_t v = 0;
  for (char c : digits) v = v * 10 + (c - '0');
  return v;
}

}  // namespace

std::string first_host(std::string_view list, std::string_view what) {
  auto fail = [&](size_t at, const char* why) {
    TORCH_CHECK(false, "ferry config: ", what, "='", list, "' is not a SLURM host list: ", why, " at offset ", at,
                " (expected hosts separated by commas, each with optional [a-b,c] ranges, e.g. node[01-04,07])");
  };
  std::string first;
  bool in_first = true;      // still reading the list's first entry
  size_t entry_parts = 0;    // characters and bracket groups of the entry being read
  size_t i = 0;
  while (i < list.size()) {
    const char c = list[i];
    if (c == ',') {
      if (entry_parts == 0) fail(i, "an empty entry");
      in_first = false;
      entry_parts = 0;
      ++i;
      continue;
    }
    if (c == ']') fail(i, "a ']' without its '['");
    if (std::isspace(static_cast<unsigned char>(c)) || !std::isprint(static_cast<unsigned char>(c))) {
      fail(i, "a space or control character");
    }
    if (c != '[') {
      if (in_first) first += c;
      ++entry_parts;
      ++i;
      continue;
    }
    const size_t close = list.find(']', i + 1);
    if (close == std::string_view::npos) fail(i, "a '[' never closed");
    const std::string_view group = list.substr(i + 1, close - i - 1);
    if (group.find('[') != std::string_view::npos) fail(i, "a '[' inside another");
    if (group.empty()) fail(i, "an empty '[]'");
    // The ranges of the group: "a" or "a-b", separated by commas.
    size_t start = 0;
    bool first_range = true;
    while (start <= group.size()) {
      const size_t comma = group.find(',', start);
      const std::string_view range =
          group.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
      const size_t dash = range.find('-');
      const std::string_view lo = range.substr(0, dash);
      const std::string_view hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
      if (!all_digits(lo) || !all_digits(hi)) fail(i + 1 + start, "a range that is not 'a' or 'a-b' in decimal");
      if (value_of(lo) > value_of(hi)) fail(i + 1 + start, "a range that runs backwards");
      if (first_range && in_first) first += lo;
      first_range = false;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    ++entry_parts;
    i = close + 1;
  }
  if (entry_parts == 0) fail(list.size(), list.empty() ? "nothing" : "an empty last entry");
  return first;
}

}  // namespace ferry
