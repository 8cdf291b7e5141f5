#pragma once
// A strict JSON reader for the small documents ferry reads from others: a safetensors header, a Hugging
// Face folder's model.safetensors.index.json and config.json. RFC 8259 values; an object keeps its
// members in document order and refuses a duplicate key (a file that names a tensor twice is an
// error, not "the last one wins"); numbers keep their text and are read as an int64 (exactly, or an
// error) or a double when asked. Errors are c10::Errors naming what was read and the byte offset.
//
// Contract: parse_json copies what it keeps; values are immutable; nesting deeper than 128 is refused.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {

class JsonValue {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  using Members = std::vector<std::pair<std::string, JsonValue>>;

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  // Checked accessors: each fails, naming `what` and the kind found, on another kind.
  bool boolean(const std::string& what) const;
  const std::string& string(const std::string& what) const;
  int64_t int64(const std::string& what) const;  // an integer literal that fits (no fraction or exponent)
  double number(const std::string& what) const;
  const std::vector<JsonValue>& array(const std::string& what) const;
  const Members& object(const std::string& what) const;
  // An object's member, or null if absent (or not an object).
  const JsonValue* find(const std::string& key) const;

  static const char* kind_name(Kind kind);

 private:
  friend class JsonParser;
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  std::string text_;  // a string's value, or a number's literal
  std::vector<JsonValue> items_;
  Members members_;
};

// The one JSON value of `text` (whitespace around it allowed, nothing else). `what` names the document
// in errors ("safetensors header of model.safetensors").
JsonValue parse_json(std::string_view text, const std::string& what);

}  // namespace ferry
