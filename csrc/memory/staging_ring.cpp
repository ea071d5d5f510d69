#include "memory/staging_ring.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "memory/copy_kernels.h"
#include "memory/shared_slots.h"

namespace fastcollate {

namespace {

void free_aligned(void* ptr) {
  std::free(ptr);
}

// The deleter of a storage lent over a slot: the slot is free again (its memory stays, kept by the ring,
// or freed here if the ring is already gone).
void return_slot(void* context) {
  auto* memory = static_cast<std::shared_ptr<SlotMemory>*>(context);
  (*memory)->lent.store(false, std::memory_order_release);
  delete memory;
}

at::Tensor bytes_view(const at::Storage& storage, int64_t nbytes) {
  at::Tensor view = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  view.set_(storage, /*storage_offset=*/0, {nbytes}, {1});
  return view;
}

}  // namespace

at::DataPtr allocate_aligned_host_memory(size_t bytes) {
  void* ptr = nullptr;
  const size_t size = std::max<size_t>(align_up(bytes), kFieldAlignment);
  TORCH_CHECK(posix_memalign(&ptr, 4096, size) == 0, "fastcollate: out of host memory allocating ", bytes, " bytes");
  return at::DataPtr(ptr, ptr, &free_aligned, at::Device(at::kCPU));
}

#ifndef FASTCOLLATE_WITH_CUDA
// The CUDA build defines these in csrc/memory/cuda/pinned_memory.cpp.
at::DataPtr allocate_host_memory(size_t bytes, bool pinned, int64_t /*device*/) {
  TORCH_CHECK(!pinned, "fastcollate was built without CUDA: pinned memory is not available");
  return allocate_aligned_host_memory(bytes);
}

bool pinned_memory_available() {
  return false;
}

PendingCopy record_on_stream(int64_t, int64_t) {
  TORCH_CHECK(false, "fastcollate was built without CUDA: there are no streams to wait for");
}

int64_t built_cuda_version() {
  return 0;
}

void register_host_memory(void*, size_t, int64_t) {
  TORCH_CHECK(false, "fastcollate was built without CUDA: shared slots cannot be page-locked");
}

void unregister_host_memory(void*, int64_t) {}
#endif

void CompletionFlag::set() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->set = true;
  }
  state_->changed.notify_all();
}

bool CompletionFlag::is_set() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->set;
}

void CompletionFlag::wait() const {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->changed.wait(lock, [this] { return state_->set; });
}

PendingCopy CompletionFlag::pending() const {
  CompletionFlag flag = *this;  // shares the state: the ring's copy sees set() from any thread
  return PendingCopy{[flag] { return flag.is_set(); }, [flag] { flag.wait(); }};
}

StagingRing::StagingRing(int64_t max_slots, bool pinned, int64_t device)
    : max_slots_(max_slots), pinned_(pinned), device_(device) {
  TORCH_CHECK(max_slots >= 0, "StagingRing: max_slots must be >= 0, got ", max_slots);
  TORCH_CHECK(!pinned || pinned_memory_available(),
              "StagingRing: pinned slots need a CUDA build of fastcollate and a visible GPU");
  counters_.max_slots = max_slots;
  counters_.pinned = pinned;
}

StagingRing::~StagingRing() {
  // A slot whose copy is still in flight must outlive that copy: wait for it rather than free memory
  // the DMA engine may be reading.
  for (auto& slot : slots_) {
    if (slot.pending.wait) {
      slot.pending.wait();
    }
  }
}

bool StagingRing::is_free(Slot& slot) const {
  if (slot.memory->lent.load(std::memory_order_acquire)) {
    return false;
  }
  if (slot.pending.done) {
    if (!slot.pending.done()) {
      return false;
    }
    slot.pending = PendingCopy{};
  }
  return true;
}

at::Storage StagingRing::allocate(size_t bytes) {
  return at::Storage(at::Storage::use_byte_size_t(), bytes, allocate_host_memory(bytes, pinned_, device_),
                     /*allocator=*/nullptr, /*resizable=*/false);
}

at::Storage StagingRing::lend(Slot& slot) {
  SlotMemory& memory = *slot.memory;
  auto context = std::make_unique<std::shared_ptr<SlotMemory>>(slot.memory);
  at::DataPtr data(memory.memory.get(), context.get(), &return_slot, at::Device(at::kCPU));
  context.release();  // the DataPtr's deleter owns it now
  memory.lent.store(true, std::memory_order_release);
  return at::Storage(at::Storage::use_byte_size_t(), memory.capacity, std::move(data), /*allocator=*/nullptr,
                     /*resizable=*/false);
}

int64_t StagingRing::slot_index(const at::Storage& storage) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (storage.data() == slots_[i].memory->memory.get()) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

size_t StagingRing::capacity_for(size_t wanted, bool growing) const {
  // A new slot is sized to the largest batch seen so far, not to this one: a short last batch would
  // otherwise make a small slot that the next epoch's first full batch must grow again. A slot that
  // grows gets 1/16 headroom, so batches whose padded size creeps up re-pin a few times, not on each
  // batch (pinning is slow and synchronises), while pinned bytes stay within 1.07x the largest batch.
  size_t capacity = std::max(wanted, largest_request_);
  if (growing) {
    capacity += capacity / 16;
  }
  return align_up(std::max<size_t>(capacity, 1));
}

std::pair<at::Tensor, bool> StagingRing::acquire(int64_t nbytes) {
  bool overflowed = false;
  at::Tensor buffer = bytes_view(acquire_storage(nbytes, overflowed), nbytes);
  return {buffer, overflowed};
}

at::Storage StagingRing::acquire_storage(int64_t nbytes, bool& overflowed) {
  std::lock_guard<std::mutex> lock(mutex_);
  return acquire_locked(nbytes, overflowed);
}

at::Storage StagingRing::acquire_locked(int64_t nbytes, bool& overflowed) {
  TORCH_CHECK(nbytes >= 0, "StagingRing.acquire: nbytes must be >= 0, got ", nbytes);
  const size_t wanted = static_cast<size_t>(nbytes);
  // Best fit among free slots that are large enough; else the largest free slot, grown.
  Slot* best = nullptr;
  Slot* largest_free = nullptr;
  for (auto& slot : slots_) {
    if (!is_free(slot)) {
      continue;
    }
    const size_t capacity = slot.memory->capacity;
    if (capacity >= wanted && (best == nullptr || capacity < best->memory->capacity)) {
      best = &slot;
    }
    if (largest_free == nullptr || capacity > largest_free->memory->capacity) {
      largest_free = &slot;
    }
  }
  if (best != nullptr) {
    counters_.reuses += 1;
    return lend(*best);
  }
  if (largest_free == nullptr && static_cast<int64_t>(slots_.size()) >= max_slots_) {
    // A slot that only a device copy still reads will be free shortly: waiting for that copy beats
    // allocating (pinned allocation is slow) and cannot deadlock, the copy is already queued.
    for (auto& slot : slots_) {
      if (!slot.memory->lent.load(std::memory_order_acquire) && slot.pending.wait) {
        slot.pending.wait();
        slot.pending = PendingCopy{};
        counters_.waits_for_copies += 1;
        return acquire_locked(nbytes, overflowed);
      }
    }
    counters_.overflow_allocations += 1;
    overflowed = true;
    return allocate(align_up(std::max<size_t>(wanted, 1)));  // not kept: sized to this batch alone
  }
  const bool growing = largest_free != nullptr;
  const size_t capacity = capacity_for(wanted, growing);
  auto memory = std::make_shared<SlotMemory>();
  memory->memory = allocate_host_memory(capacity, pinned_, device_);  // first: a failure leaves the ring as it was
  memory->capacity = capacity;
  largest_request_ = std::max(largest_request_, wanted);
  if (!growing) {
    slots_.push_back(Slot{});
    largest_free = &slots_.back();
  }
  largest_free->memory = std::move(memory);  // a grown slot's old block is freed here (nothing uses it)
  counters_.slot_allocations += 1;
  counters_.regrowths += growing ? 1 : 0;
  return lend(*largest_free);
}

bool StagingRing::hold_until_done(const at::Tensor& buffer, PendingCopy copy) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t index = buffer.has_storage() ? slot_index(buffer.storage()) : -1;
  if (index < 0) {
    return false;
  }
  slots_[static_cast<size_t>(index)].pending = std::move(copy);
  return true;
}

std::pair<at::Tensor, std::vector<int64_t>> StagingRing::pack(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> offsets;
  size_t total = 0;
  for (const auto& tensor : tensors) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.layout() == at::kStrided,
                "StagingRing.pack: tensors must be dense CPU tensors, got ", tensor.device(), " ", tensor.layout());
    offsets.push_back(static_cast<int64_t>(total));
    total += align_up(tensor.nbytes());
  }
  at::Tensor buffer = acquire(static_cast<int64_t>(total)).first;
  auto* base = static_cast<unsigned char*>(buffer.data_ptr());
  CopyJobs jobs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& tensor = tensors[i];
    if (copyable_as_is(tensor)) {
      jobs.add_memcpy(tensor.const_data_ptr(), base + offsets[i], tensor.nbytes());
    } else {
      at::Tensor target = at::empty({0}, tensor.options().memory_format(at::MemoryFormat::Contiguous));
      target.set_(buffer.storage(), static_cast<int64_t>(offsets[i] / tensor.element_size()), tensor.sizes(),
                  c10::contiguous_strides(tensor.sizes()));
      jobs.tensor_copies.push_back({tensor, target});
    }
  }
  jobs.run();
  return {buffer, offsets};
}

bool StagingRing::owns(const at::Tensor& tensor) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tensor.has_storage() && slot_index(tensor.storage()) >= 0;
}

int64_t StagingRing::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t freed = 0;
  std::vector<Slot> kept;
  for (auto& slot : slots_) {
    if (is_free(slot)) {
      freed += static_cast<int64_t>(slot.memory->capacity);
    } else {
      kept.push_back(std::move(slot));
    }
  }
  slots_ = std::move(kept);
  return freed;
}

RingStats StagingRing::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RingStats out = counters_;
  out.slots = static_cast<int64_t>(slots_.size());
  out.bytes_held = 0;
  out.in_use = 0;
  for (const auto& slot : slots_) {
    out.bytes_held += static_cast<int64_t>(slot.memory->capacity);
    const bool copy_running = slot.pending.done && !slot.pending.done();
    out.in_use += (slot.memory->lent.load(std::memory_order_acquire) || copy_running) ? 1 : 0;
  }
  return out;
}

}  // namespace fastcollate
