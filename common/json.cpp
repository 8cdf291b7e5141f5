#include "json.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <set>

namespace ferry {

const char* JsonValue::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kNull: return "null";
    case Kind::kBool: return "a boolean";
    case Kind::kNumber: return "a number";
    case Kind::kString: return "a string";
    case Kind::kArray: return "an array";
    case Kind::kObject: return "an object";
  }
  return "?";
}

namespace {
void expect_kind(const JsonValue& v, JsonValue::Kind want, const std::string& what) {
  TORCH_CHECK(v.kind() == want, "ferry: ", what, ": expected ", JsonValue::kind_name(want), ", got ",
              JsonValue::kind_name(v.kind()));
}
}  // namespace

bool JsonValue::boolean(const std::string& what) const {
  expect_kind(*this, Kind::kBool, what);
  return bool_;
}

const std::string& JsonValue::string(const std::string& what) const {
  expect_kind(*this, Kind::kString, what);
  return text_;
}

int64_t JsonValue::int64(const std::string& what) const {
  expect_kind(*this, Kind::kNumber, what);
  const bool integer = text_.find_first_of(".eE") == std::string::npos;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text_.c_str(), &end, 10);
  TORCH_CHECK(integer && errno == 0 && end != nullptr && *end == '\0', "ferry: ", what,
              ": expected an integer that fits in 64 bits, got ", text_);
  return static_cast<int64_t>(v);
}

double JsonValue::number(const std::string& what) const {
  expect_kind(*this, Kind::kNumber, what);
  return std::strtod(text_.c_str(), nullptr);
}

const std::vector<JsonValue>& JsonValue::array(const std::string& what) const {
  expect_kind(*this, Kind::kArray, what);
  return items_;
}

const JsonValue::Members& JsonValue::object(const std::string& what) const {
  expect_kind(*this, Kind::kObject, what);
  return members_;
}

const JsonValue* JsonValue::find(const std::string& key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  JsonValue document() {
    JsonValue v = value(0);
    space();
    if (i_ != s_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  std::string_view s_;
  const std::string& what_;
  size_t i_ = 0;

  [[noreturn]] void fail(const std::string& why) const {
    TORCH_CHECK(false, "ferry: ", what_, " is not valid JSON: ", why, " at byte ", i_);
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) fail("expected " + std::string(word));
    i_ += word.size();
  }

  JsonValue value(int depth) {
    if (depth > 128) fail("nested deeper than 128");
    space();
    if (i_ >= s_.size()) fail("expected a value, found the end");
    JsonValue v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind_ = JsonValue::Kind::kObject;
      std::set<std::string> keys;
      if (eat('}')) return v;
      do {
        space();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a member name");
        std::string key = string();
        if (!keys.insert(key).second) fail("the member name \"" + key + "\" appears twice");
        if (!eat(':')) fail("expected ':'");
        v.members_.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      if (!eat('}')) fail("expected ',' or '}'");
    } else if (c == '[') {
      ++i_;
      v.kind_ = JsonValue::Kind::kArray;
      if (eat(']')) return v;
      do {
        v.items_.push_back(value(depth + 1));
      } while (eat(','));
      if (!eat(']')) fail("expected ',' or ']'");
    } else if (c == '"') {
      v.kind_ = JsonValue::Kind::kString;
      v.text_ = string();
    } else if (c == 't' || c == 'f') {
      v.kind_ = JsonValue::Kind::kBool;
      v.bool_ = c == 't';
      literal(c == 't' ? "true" : "false");
    } else if (c == 'n') {
      literal("null");
    } else {
      v.kind_ = JsonValue::Kind::kNumber;
      v.text_ = number();
    }
    return v;
  }

  std::string number() {
    const size_t start = i_;
    auto digits = [&] {
      const size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      return i_ > from;
    };
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
    } else if (!digits()) {
      fail("expected a value");
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      if (!digits()) fail("expected digits after '.'");
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!digits()) fail("expected digits in the exponent");
    }
    return std::string(s_.substr(start, i_ - start));
  }

  unsigned hex4() {
    if (i_ + 4 > s_.size()) fail("a \\u escape needs 4 hex digits");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<unsigned>(h - 'A' + 10);
      else fail("a \\u escape needs 4 hex digits");
    }
    return v;
  }

  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("a string does not end");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("a string does not end");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {  // a surrogate pair
            if (s_.substr(i_, 2) != "\\u") fail("a lone high surrogate");
            i_ += 2;
            const unsigned low = hex4();
            if (low < 0xdc00 || low >= 0xe000) fail("a high surrogate without its low half");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail("a lone low surrogate");
          }
          utf8(out, cp);
          break;
        }
        default: fail(std::string("an unknown escape \\") + e);
      }
    }
  }
};

JsonValue parse_json(std::string_view text, const std::string& what) { return JsonParser(text, what).document(); }

}  // namespace ferry
