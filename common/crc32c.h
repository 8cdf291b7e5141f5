#pragma once
// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected; the checksum of iSCSI, ext4 metadata and
// Snappy/LevelDB), for checkpoint integrity. On x86-64 CPUs with SSE4.2 it runs on the crc32
// instruction (several GB/s per core); elsewhere on a slicing-by-8 table. Both give the same bits.
//
//   uint32_t crc = 0;
//   crc = crc32c_extend(crc, data, n);      // streaming: extend block by block
//   crc32c_extend(0, "123456789", 9) == 0xE3069283
#include <cstddef>
#include <cstdint>
#include <string>

namespace ferry {

// The CRC of the bytes so far, `crc` (0 for none), extended by `n` bytes at `data`.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// The same with the table implementation only (tests compare the two).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
// "hardware (sse4.2)" or "portable (table)".
const char* crc32c_implementation();
// 8 lowercase hex digits.
std::string crc32c_hex(uint32_t crc);

}  // namespace ferry
