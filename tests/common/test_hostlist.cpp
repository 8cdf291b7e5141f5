// SLURM's compressed host lists (common/hostlist.h): the first host of lists written by hand and of
// random lists built from their parts (the expected first host known by construction); malformed lists
// and random mutations of valid ones are read or refused with a c10::Error naming the variable, never
// a crash.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "../../common/hostlist.h"
#include "../mutate.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

TEST(Hostlist, FirstHostOfListsAsSlurmWritesThem) {
  EXPECT_EQ(first_host("gpu-a1", "L"), "gpu-a1");
  EXPECT_EQ(first_host("node[01-04,07],gpu1", "L"), "node01");
  EXPECT_EQ(first_host("node[7,01-04]", "L"), "node7") << "the first value as written, not the smallest";
  EXPECT_EQ(first_host("gpu1,node[1-2]", "L"), "gpu1");
  EXPECT_EQ(first_host("node[008-010]", "L"), "node008") << "zero padding kept";
  EXPECT_EQ(first_host("rack[2-3]-n[05,07]-ib", "L"), "rack2-n05-ib") << "each group's first value, suffix kept";
  EXPECT_EQ(first_host("127.0.0.[1-4]", "L"), "127.0.0.1");
  EXPECT_EQ(first_host("n[5]", "L"), "n5");
}

TEST(Hostlist, MalformedListsFailNamingTheVariableAndWhy) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "nothing at offset 0"},
      {"node1,", "an empty last entry at offset 6"},
      {",node1", "an empty entry at offset 0"},
      {"a,,b", "an empty entry at offset 2"},
      {"node[1-4", "a '[' never closed at offset 4"},
      {"node1]", "a ']' without its '[' at offset 5"},
      {"node[1-2]]", "a ']' without its '[' at offset 9"},
      {"node[]", "an empty '[]' at offset 4"},
      {"node[[1]]", "a '[' inside another at offset 4"},
      {"node[4-1]", "a range that runs backwards at offset 5"},
      {"node[a-b]", "a range that is not 'a' or 'a-b' in decimal at offset 5"},
      {"node[1,]", "a range that is not 'a' or 'a-b' in decimal at offset 7"},
      {"node[1-2-3]", "a range that is not 'a' or 'a-b' in decimal at offset 5"},
      {"node[1234567890123456789]", "a range that is not 'a' or 'a-b' in decimal at offset 5"},
      {"node 1", "a space or control character at offset 4"},
      {std::string("node\n1"), "a space or control character at offset 4"},
  };
  for (const auto& c : cases) {
    const std::string& list = c.first;  // not a structured binding: C++17 lambdas cannot capture one
    const std::string& why = c.second;
    const std::string e = error_of([&] { first_host(list, "SLURM_STEP_NODELIST"); });
    EXPECT_NE(e.find("SLURM_STEP_NODELIST='" + list + "' is not a SLURM host list: " + why), std::string::npos)
        << "'" << list << "': " << e;
  }
}

// Lists built from random parts: prefixes, bracket groups of random ranges (zero-padded or not), more
// entries after the first. The first host is known from the parts.
TEST(Hostlist, RandomListsGiveTheFirstHostTheyWereBuiltWith) {
  std::mt19937 rng(97);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  auto name = [&] {
    static const std::string chars = "abcdefghijklmnopqrstuvwxyz0123456789-._";
    std::string s(1, "abcdefghij"[pick(10)]);
    for (int k = pick(6); k > 0; --k) s += chars[pick(static_cast<int>(chars.size()))];
    return s;
  };
  auto number = [&](int value, int width) {
    std::string s = std::to_string(value);
    return std::string(static_cast<size_t>(std::max(0, width - static_cast<int>(s.size()))), '0') + s;
  };
  // A bracket group; its first value goes to `first`.
  auto group = [&](std::string* first) {
    const int width = pick(4);
    std::string g = "[";
    for (int r = 0, n = 1 + pick(3); r < n; ++r) {
      const int lo = pick(200), hi = lo + pick(3) * pick(50);
      const std::string range = hi == lo ? number(lo, width) : number(lo, width) + "-" + number(hi, width);
      if (r == 0) *first = number(lo, width);
      g += (r ? "," : "") + range;
    }
    return g + "]";
  };
  auto entry = [&](std::string* host) {
    std::string text, first;
    for (int part = 0, parts = 1 + pick(3); part < parts; ++part) {
      if (part > 0 || pick(2) == 0) {
        const std::string n = name();
        text += n;
        *host += n;
      }
      if (pick(2) == 0) {
        text += group(&first);
        *host += first;
      }
    }
    if (text.empty()) {
      text = name();
      *host = text;
    }
    return text;
  };
  for (int i = 0; i < 2000; ++i) {
    std::string expected, ignored;
    std::string list = entry(&expected);
    for (int k = pick(4); k > 0; --k) list += "," + entry(&ignored);
    EXPECT_EQ(first_host(list, "L"), expected) << list;
  }
}

TEST(Hostlist, MutatedListsAreReadOrRefusedNeverACrash) {
  std::mt19937 rng(7);
  const std::string base = "gpu-node[001-016,020,100-127],login[1-2],rack[2-3]n[05,07]";
  int read = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string list = test::mutate(base, rng);
    try {
      const std::string host = first_host(list, "SLURM_JOB_NODELIST");
      EXPECT_FALSE(host.empty()) << list;
      EXPECT_EQ(host.find_first_of("[],"), std::string::npos) << list << " -> " << host;
      ++read;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("SLURM_JOB_NODELIST='"), std::string::npos);
      ++refused;
    }
  }
  EXPECT_GT(read, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace ferry
