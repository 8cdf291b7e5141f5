// common/json.h: the values RFC 8259 allows, in document order, with their escapes and numbers; and
// every malformed document refused with the byte offset: trailing commas, duplicate keys, control
// characters in strings, bad escapes and surrogates, leading zeros, text after the value, nesting past
// 128; checked accessors naming what they read.
#include <gtest/gtest.h>

#include <string>

#include "../../common/json.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

TEST(Json, ReadsEveryKindOfValueInOrder) {
  const JsonValue v = parse_json(
      R"( {"b": [1, -2, 3.5e2, 0, -0.25E-1], "a": {"x": true, "y": false, "z": null}, "s": "q\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"} )",
      "doc");
  const auto& m = v.object("doc");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].first, "b");
  EXPECT_EQ(m[1].first, "a");
  const auto& b = v.find("b")->array("b");
  EXPECT_EQ(b[0].int64("b0"), 1);
  EXPECT_EQ(b[1].int64("b1"), -2);
  EXPECT_DOUBLE_EQ(b[2].number("b2"), 350.0);
  EXPECT_EQ(b[3].int64("b3"), 0);
  EXPECT_DOUBLE_EQ(b[4].number("b4"), -0.025);
  EXPECT_TRUE(v.find("a")->find("x")->boolean("x"));
  EXPECT_FALSE(v.find("a")->find("y")->boolean("y"));
  EXPECT_TRUE(v.find("a")->find("z")->is_null());
  EXPECT_EQ(v.find("s")->string("s"), "q\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(v.find("nope"), nullptr);
  EXPECT_EQ(parse_json("9223372036854775807", "max").int64("max"), INT64_C(9223372036854775807));
  EXPECT_TRUE(parse_json("{}", "empty").object("empty").empty());
  EXPECT_TRUE(parse_json("[ ]", "empty").array("empty").empty());
}

TEST(Json, MalformedDocumentsAreRefusedWithTheOffset) {
  const std::pair<const char*, const char*> cases[] = {
      {"{\"a\": 1,}", "expected a member name"},
      {"[1, 2,]", "expected a value"},
      {"{\"a\": 1, \"a\": 2}", "appears twice"},
      {"\"a\tb\"", "control character"},
      {"\"\\x\"", "unknown escape"},
      {"\"\\ud800\"", "lone high surrogate"},
      {"\"\\udc00\"", "lone low surrogate"},
      {"\"\\u12\"", "4 hex digits"},
      {"01", "unexpected text after the value"},
      {"1.", "digits after '.'"},
      {"1e", "digits in the exponent"},
      {"{} x", "unexpected text after the value"},
      {"", "found the end"},
      {"\"abc", "does not end"},
      {"tru", "expected true"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ',' or ']'"},
  };
  for (const auto& [text, why] : cases) {
    const std::string e = error_of([&] { parse_json(text, "the doc"); });
    EXPECT_NE(e.find("the doc is not valid JSON"), std::string::npos) << text << ": " << e;
    EXPECT_NE(e.find(why), std::string::npos) << text << ": " << e;
    EXPECT_NE(e.find("at byte"), std::string::npos) << text << ": " << e;
  }
  EXPECT_NE(error_of([] { parse_json(std::string(200, '[') + std::string(200, ']'), "deep"); }).find("deeper than 128"),
            std::string::npos);
}

TEST(Json, AccessorsCheckWhatTheyRead) {
  const JsonValue v = parse_json(R"({"n": 1.5, "big": 99999999999999999999, "s": "x"})", "doc");
  EXPECT_NE(error_of([&] { v.find("n")->int64("n"); }).find("expected an integer that fits in 64 bits, got 1.5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { v.find("big")->int64("big"); }).find("fits in 64 bits"), std::string::npos);
  EXPECT_NE(error_of([&] { v.find("s")->array("field s"); }).find("field s: expected an array, got a string"),
            std::string::npos);
  EXPECT_NE(error_of([&] { v.array("doc"); }).find("got an object"), std::string::npos);
}

}  // namespace
}  // namespace ferry
