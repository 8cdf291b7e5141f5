// common/json.h: the values RFC 8259 allows, in document order, with their escapes and numbers; and
// every malformed document refused with the byte offset: trailing commas, duplicate keys, control
// characters in strings, bad escapes and surrogates, leading zeros, text after the value, nesting past
// 128; checked accessors naming what they read; mutated documents read or refused, never a crash.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>

#include "../../common/json.h"
#include "../mutate.h"
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
    const std::string e = error_of([&text = text] { parse_json(text, "the doc"); });
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

// Every value of `v` read by every accessor that may apply: numbers as int64 and double, strings,
// nested values; each read returns or refuses with a c10::Error.
void read_all(const JsonValue& v, int depth = 0) {
  ASSERT_LT(depth, 200) << "nesting past the parser's limit";
  switch (v.kind()) {
    case JsonValue::Kind::kNumber:
      error_of([&] { v.int64("n"); });
      error_of([&] { v.number("n"); });
      break;
    case JsonValue::Kind::kArray:
      for (const JsonValue& x : v.array("a")) read_all(x, depth + 1);
      break;
    case JsonValue::Kind::kObject:
      for (const auto& [key, x] : v.object("o")) {
        EXPECT_EQ(v.find(key), &x) << "the first member of a name (duplicates are refused)";
        read_all(x, depth + 1);
      }
      break;
    default:
      break;
  }
}

// Mutations of the documents ferry reads from others (a safetensors header, a Hugging Face index and
// config): each is read (and every value in it) or refused with a c10::Error naming the document; no
// other exception, no crash (the sanitizer build runs this too). 6,000 documents.
TEST(Json, MutatedDocumentsAreReadOrRefusedNeverACrash) {
  const std::string seeds[] = {
      R"({"__metadata__":{"format":"pt"},"a.weight":{"dtype":"BF16","shape":[4096,11008],"data_offsets":[0,90177536]},)"
      R"("b":{"dtype":"F32","shape":[],"data_offsets":[90177536,90177540]}})",
      R"({"metadata": {"total_size": 13476839424}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",)"
      R"( "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})",
      R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,)"
      R"( "tie_word_embeddings": false, "torch_dtype": "float16", "name": "caf\u00e9 \ud83d\ude00", "x": null})",
  };
  std::mt19937 rng(2026);
  int64_t read = 0, refused = 0;
  for (int i = 0; i < 6000; ++i) {
    const std::string doc = test::mutate(seeds[i % 3], rng);
    try {
      const JsonValue v = parse_json(doc, "mutated document");
      read_all(v);
      ++read;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("mutated document"), std::string::npos)
          << "iteration " << i << ": " << e.what_without_backtrace();
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ": not a c10::Error: " << e.what() << "\n" << doc;
    }
  }
  std::printf("mutated JSON: %lld read, %lld refused\n", static_cast<long long>(read), static_cast<long long>(refused));
  EXPECT_GT(read, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace ferry
