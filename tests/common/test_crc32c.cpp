// CRC-32C against published check values (the "123456789" check of the CRC catalogue and the iSCSI
// vectors of RFC 3720 B.4) and a bit-at-a-time reference written from the polynomial; extending over
// any split of a buffer equals one pass; the hardware and table paths give the same bits at every length
// and alignment; crc32c_hex writes 8 lowercase digits.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../common/crc32c.h"

namespace ferry {
namespace {

// CRC-32C one bit at a time from the reflected polynomial 0x82F63B78: the definition, not a table.
uint32_t crc32c_bitwise(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
  }
  return ~c;
}

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32c, KnownCheckValues) {
  EXPECT_EQ(crc32c_extend(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_extend_portable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_bitwise("123456789", 9), 0xE3069283u) << "the reference itself";
  EXPECT_EQ(crc32c_extend(0, "", 0), 0u) << "no bytes: the CRC of nothing";
  EXPECT_EQ(crc32c_extend(0x12345678u, "", 0), 0x12345678u) << "extending by nothing changes nothing";
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of ones, ascending, descending.
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<unsigned char>(i);
    down[i] = static_cast<unsigned char>(31 - i);
  }
  for (auto* f : {&crc32c_extend, &crc32c_extend_portable}) {
    EXPECT_EQ(f(0, zeros.data(), 32), 0x8A9136AAu);
    EXPECT_EQ(f(0, ones.data(), 32), 0x62A8AB43u);
    EXPECT_EQ(f(0, up.data(), 32), 0x46DD794Eu);
    EXPECT_EQ(f(0, down.data(), 32), 0x113FDB5Cu);
  }
  // RFC 3720 B.4's iSCSI SCSI Read (10) command PDU.
  const unsigned char pdu[48] = {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                                 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  EXPECT_EQ(crc32c_extend(0, pdu, sizeof(pdu)), 0xD9963A56u);
}

TEST(Crc32c, BothImplementationsEqualTheBitwiseDefinitionAtEveryLengthAndAlignment) {
  const auto data = random_bytes(4096 + 64, 1);
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{15}, size_t{16}, size_t{17},
                     size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{4096}}) {
      const unsigned char* p = data.data() + offset;
      const uint32_t want = crc32c_bitwise(p, n);
      EXPECT_EQ(crc32c_extend(0, p, n), want) << "offset " << offset << " length " << n;
      EXPECT_EQ(crc32c_extend_portable(0, p, n), want) << "offset " << offset << " length " << n;
    }
  }
  const std::string impl = crc32c_implementation();
  EXPECT_TRUE(impl == "hardware (sse4.2)" || impl == "portable (table)") << impl;
}

// Streaming: the CRC extended block by block over any split equals the CRC of the whole in one pass.
TEST(Crc32c, ExtendingOverSplitBuffersEqualsOnePass) {
  const auto data = random_bytes(300, 2);
  const uint32_t whole = crc32c_extend(0, data.data(), data.size());
  EXPECT_EQ(whole, crc32c_bitwise(data.data(), data.size()));
  for (size_t cut = 0; cut <= data.size(); ++cut) {
    const uint32_t head = crc32c_extend(0, data.data(), cut);
    EXPECT_EQ(crc32c_extend(head, data.data() + cut, data.size() - cut), whole) << "cut at " << cut;
    const uint32_t head_p = crc32c_extend_portable(0, data.data(), cut);
    EXPECT_EQ(crc32c_extend_portable(head_p, data.data() + cut, data.size() - cut), whole) << "cut at " << cut;
    // The two paths are interchangeable mid-stream.
    EXPECT_EQ(crc32c_extend_portable(head, data.data() + cut, data.size() - cut), whole) << "cut at " << cut;
  }
  // Many random splits into several pieces.
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    uint32_t crc = 0;
    size_t at = 0;
    while (at < data.size()) {
      const size_t n = std::min<size_t>(data.size() - at, rng() % 40);
      crc = crc32c_extend(crc, data.data() + at, n);
      at += n;
    }
    EXPECT_EQ(crc, whole) << "trial " << trial;
  }
  // A changed byte changes the CRC (one flipped bit anywhere is always detected by a CRC).
  auto flipped = data;
  flipped[123] ^= 0x10;
  EXPECT_NE(crc32c_extend(0, flipped.data(), flipped.size()), whole);
}

TEST(Crc32c, HexIsEightLowercaseDigits) {
  EXPECT_EQ(crc32c_hex(0xE3069283u), "e3069283");
  EXPECT_EQ(crc32c_hex(0), "00000000");
  EXPECT_EQ(crc32c_hex(0xABCDEF01u), "abcdef01");
  EXPECT_EQ(crc32c_hex(0xFFFFFFFFu), "ffffffff");
  EXPECT_EQ(crc32c_hex(0x1u), "00000001");
}

}  // namespace
}  // namespace ferry
