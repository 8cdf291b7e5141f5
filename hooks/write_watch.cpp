// WriteWatch (see write_watch.h).
#include "write_watch.h"

namespace ferry {

void WriteWatch::remember(const std::vector<at::Tensor>& params) {
  const size_t n = params.size();
  storage_.resize(n);
  offset_.resize(n);
  version_.resize(n);
  for (size_t p = 0; p < n; ++p) {
    const at::Tensor& t = params[p];
    storage_[p] = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    offset_[p] = t.storage_offset();
    version_[p] = t._version();
  }
}

std::vector<WriteWatch::Written> WriteWatch::find(const std::vector<at::Tensor>& params, at::ScalarType dtype,
                                                  const c10::Device& device) const {
  std::vector<Written> written;
  for (size_t p = 0; p < params.size(); ++p) {
    const at::Tensor& t = params[p];
    const bool replaced = !t.has_storage() || t.storage().unsafeGetStorageImpl() != storage_[p] ||
                          t.storage_offset() != offset_[p] || t.scalar_type() != dtype || t.device() != device ||
                          !t.is_contiguous();
    if (!replaced && t._version() == version_[p]) continue;
    written.push_back({static_cast<int64_t>(p), replaced});
  }
  return written;
}

log::Level WriteWatch::count_take() { return takes_++ == 0 ? log::Level::kInfo : log::Level::kDebug; }

}  // namespace ferry
