// The main process receives a batch from a slot: the slot moves from delivered to lent (once per batch),
// and each tensor of the batch is a view of one storage over this process's mapping of the slot, page-
// locked for DeviceLoader, that frees the slot when it dies.
#include "memory/shared_slots.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "memory/shared_slots_layout.h"
#include "memory/slot_storages.h"

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

at::Tensor SharedSlots::receive(int64_t slot, int64_t seq, int64_t nbytes, at::ScalarType dtype, int64_t offset,
                                at::IntArrayRef sizes, at::IntArrayRef strides, int64_t pin_device) {
  TORCH_CHECK(slot >= 0 && slot < capacity(), "fastcollate: a batch names shared slot ", slot, " of ", capacity());
  TORCH_CHECK(
      nbytes >= 0 && static_cast<uint64_t>(nbytes) <= header_->max_batch_bytes && sizes.size() == strides.size(),
      "fastcollate: a batch from a worker describes an impossible view of shared slot ", slot);
  int64_t extent = 1;  // elements the view reaches past its offset
  for (size_t d = 0; d < sizes.size(); ++d) {
    TORCH_CHECK(sizes[d] >= 0 && strides[d] >= 0, "fastcollate: a negative size or stride in a slot view");
    extent = sizes[d] == 0 ? 0 : (extent == 0 ? 0 : extent + (sizes[d] - 1) * strides[d]);
  }
  TORCH_CHECK(offset >= 0 && (offset + extent) * static_cast<int64_t>(c10::elementSize(dtype)) <= nbytes,
              "fastcollate: a view from a worker reaches past its batch in shared slot ", slot);
  const auto index = static_cast<size_t>(slot);
  std::lock_guard<std::mutex> lock(reader_mutex_);
  at::Storage storage;
  if (received_seq_[index] == seq && received_[index]) {
    if (auto alive = received_[index]->lock()) {
      storage = at::Storage(std::move(alive));  // another tensor of the batch received just now
    }
  }
  if (!storage) {
    auto& entry = header_->slot(slot);
    uint64_t current = entry.word.load(std::memory_order_acquire);
    do {
      // Only the message that sent a write names its slot (a worker sends a batch again the ordinary
      // way), so anything but delivered is a write the slot no longer holds: raise rather than hand out
      // bytes another batch may be overwriting.
      TORCH_CHECK(state_of(current) == kDelivered && seq_of(current) == static_cast<uint32_t>(seq),
                  "fastcollate: a batch from a DataLoader worker (shared slot ", slot, ", batch #", seq,
                  ") cannot be received: the slot ", describe_word(current),
                  ". A write is received at most once, and only while its slot holds it; this one was sent "
                  "twice, or its worker died and the slot was taken back.");
    } while (!entry.word.compare_exchange_weak(current, with_state(current, kLent), std::memory_order_acq_rel));
    std::shared_ptr<Mapping> mapping;
    try {
      TORCH_CHECK(static_cast<uint64_t>(nbytes) <= entry.region_bytes.load(std::memory_order_relaxed),
                  "fastcollate: a batch from a worker is larger than its shared slot ", slot);
      const int64_t made = mappings_.load();
      mapping = mapping_for(pin_device >= 0 ? pinned_maps_ : reader_maps_, slot, static_cast<size_t>(nbytes));
      TORCH_CHECK(mapping, "fastcollate: mapping shared slot ", slot, " (",
                  entry.region_bytes.load(std::memory_order_relaxed), " bytes) to receive a batch failed (",
                  std::strerror(errno), ")");
      if (mappings_.load() != made) {  // a new mapping: known to the fork handler
        received_mappings_.erase(std::remove_if(received_mappings_.begin(), received_mappings_.end(),
                                                [](const auto& weak) { return weak.expired(); }),
                                 received_mappings_.end());
        received_mappings_.push_back(mapping);
      }
      if (pin_device >= 0 && !mapping->registered.load() && !mapping->registration_failed) {
        try {
          register_host_memory(mapping->base, mapping->length, pin_device);
          mapping->device = pin_device;
          mapping->registered.store(true);
          ++registrations_;
        } catch (const std::exception&) {
          // The batch is fine, only not page-locked: DeviceLoader packs it into its pinned ring instead.
          mapping->registration_failed = true;
          ++registration_failures_;
        }
      }
    } catch (...) {
      release_reader(slot, static_cast<uint32_t>(seq));  // the batch is lost loudly, the slot kept
      throw;
    }
    ++mapping->lent_batches;
    auto* context = new LentBatch{shared_from_this(), mapping, slot, static_cast<uint32_t>(seq), ::getpid()};
    storage = at::Storage(at::Storage::use_byte_size_t(), nbytes,
                          at::DataPtr(mapping->base, context, &reader_released, at::Device(at::kCPU)),
                          /*allocator=*/nullptr, /*resizable=*/false);
    received_[index] = storage.getWeakStorageImpl();
    received_seq_[index] = seq;
    ++receipts_;
  }
  at::Tensor view = at::empty({0}, at::TensorOptions().dtype(dtype));
  view.set_(std::move(storage), offset, sizes, strides);
  return view;
}

}  // namespace fastcollate
