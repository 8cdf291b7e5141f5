#include "chunk.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

namespace ferry {
namespace {

c10::DispatchKey backend_key(const c10::Device& device) {
  switch (device.type()) {
    case c10::DeviceType::CPU: return c10::DispatchKey::CPU;
    case c10::DeviceType::CUDA: return c10::DispatchKey::CUDA;
    default: TORCH_CHECK(false, "ferry: chunks live on cpu or cuda devices, got ", device);
  }
}

}  // namespace

Chunk::Chunk(ChunkId id, ChunkRole role, at::ScalarType dtype, int64_t numel, c10::Allocator* allocator,
             c10::Device device)
    : id_(id),
      role_(role),
      dtype_(dtype),
      numel_(numel),
      nbytes_(numel * static_cast<int64_t>(c10::elementSize(dtype))),
      allocator_(allocator),
      device_(device),
      device_storage_(c10::Storage::use_byte_size_t(), 0, at::DataPtr(nullptr, device), allocator,
                      /*resizable=*/true) {
  check_role_dtype(role, dtype);
  TORCH_CHECK(numel > 0, "ferry: a chunk needs at least one element, got ", numel);
  device_flat_ = device_view(0, {numel});
}

int64_t Chunk::storage_holders() const {
  // A view is a TensorImpl of its own holding the storage; payload() hands out device_flat_ or
  // host_flat_ themselves (a handle to this Chunk's TensorImpl). This Chunk's own: the device storage
  // handle and device_flat_'s; the host buffer's and host_flat_'s; one handle to each flat tensor.
  auto beyond = [](size_t count, int64_t own) { return static_cast<int64_t>(count) - own; };
  int64_t holders = beyond(device_storage_.use_count(), 2) + beyond(device_flat_.use_count(), 1);
  if (host_bytes_.defined()) holders += beyond(host_bytes_.storage().use_count(), 2) + beyond(host_flat_.use_count(), 1);
  return holders;
}

bool Chunk::has_device_memory() const { return device_storage_.nbytes() > 0 && !aliasing_host_; }

void Chunk::alias_host_buffer() {
  TORCH_INTERNAL_ASSERT(has_host_buffer() && !has_device_memory() && !pending_, "chunk ", id_,
                        " cannot alias its host buffer now");
  c10::StorageImpl* impl = device_storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(host_bytes_.data_ptr(), device_));  // non-owning
  impl->set_nbytes(static_cast<size_t>(nbytes_));
  aliasing_host_ = true;
}

void Chunk::allocate_device_memory() {
  TORCH_INTERNAL_ASSERT(!has_device_memory(), "chunk ", id_, " already has device memory");
  aliasing_host_ = false;  // the alias (if any) is replaced
  c10::StorageImpl* impl = device_storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(allocator_->allocate(static_cast<size_t>(nbytes_)));
  impl->set_nbytes(static_cast<size_t>(nbytes_));
}

void Chunk::free_device_memory() {
  TORCH_INTERNAL_ASSERT(has_device_memory(), "chunk ", id_, " has no device memory to free");
  clear_storage();  // the old DataPtr frees the memory
}

void Chunk::clear_storage() {
  c10::StorageImpl* impl = device_storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
  impl->set_nbytes(0);
  aliasing_host_ = false;
}

at::Tensor Chunk::device_view(int64_t offset, at::IntArrayRef shape) const {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  TORCH_INTERNAL_ASSERT(offset >= 0 && offset + numel <= numel_, "view [", offset, ", ", offset + numel,
                        ") outside chunk ", id_, " of ", numel_, " elements");
  // Built directly on the TensorImpl: set_() would check the bounds against the storage's current
  // size, which is 0 while the chunk is off the device.
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(device_storage_),
                                                   c10::DispatchKeySet(backend_key(device_)),
                                                   caffe2::TypeMeta::fromScalarType(dtype_));
  impl->set_sizes_contiguous(shape);
  impl->set_storage_offset(offset);
  return at::Tensor(std::move(impl));
}

void Chunk::attach_host_buffer(at::Tensor bytes) {
  TORCH_INTERNAL_ASSERT(!has_host_buffer(), "chunk ", id_, " already has a host buffer");
  TORCH_INTERNAL_ASSERT(bytes.numel() == nbytes_ && bytes.scalar_type() == at::kByte);
  host_bytes_ = std::move(bytes);
  host_flat_ = host_bytes_.view(dtype_);
}

at::Tensor Chunk::detach_host_buffer() {
  TORCH_INTERNAL_ASSERT(has_host_buffer(), "chunk ", id_, " has no host buffer");
  if (aliasing_host_) clear_storage();
  host_flat_ = at::Tensor();
  at::Tensor bytes = std::move(host_bytes_);
  host_bytes_ = at::Tensor();
  return bytes;
}

}  // namespace ferry
