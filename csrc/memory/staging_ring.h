// StagingRing: a bounded set of reusable host buffers ("slots") that batches are assembled into in the
// main process (fastcollate.StagingRing wraps it).
// Reuse removes the page faults that fresh output memory costs on every batch; a slot is handed out
// again only when no tensor outside the ring still points into it, so a batch a user kept is never
// overwritten. With CUDA, slots are pinned and also wait for their copy's event.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace fastcollate {

// The ring's counters, listed once: the struct below, its binding and Python's fastcollate.RingStats (made
// from _C.RingStats.fields) all follow this list. X(type, name, what it counts).
#define FASTCOLLATE_RING_STATS_FIELDS(X)                                                       \
  X(int64_t, slots, "slots the ring holds now")                                                \
  X(int64_t, max_slots, "the bound")                                                           \
  X(int64_t, bytes_held, "sum of slot capacities")                                             \
  X(int64_t, slot_allocations, "new slots and grown slots, since creation")                    \
  X(int64_t, regrowths, "of those, slots reallocated larger (a re-pin when pinned)")           \
  X(int64_t, reuses, "acquisitions served by an existing slot without allocating")             \
  X(int64_t, overflow_allocations, "buffers handed out past the bound (not kept by the ring)") \
  X(int64_t, waits_for_copies, "acquisitions that waited for a device copy to free a slot")    \
  X(int64_t, in_use, "slots some tensor or unfinished device copy still uses")                 \
  X(bool, pinned, "whether the slots are page-locked")

struct RingStats {
#define FASTCOLLATE_RING_STATS_MEMBER(type, name, what) type name{};
  FASTCOLLATE_RING_STATS_FIELDS(FASTCOLLATE_RING_STATS_MEMBER)
#undef FASTCOLLATE_RING_STATS_MEMBER
};

// A device copy that may still be reading a slot.
struct PendingCopy {
  std::function<bool()> done;  // non-blocking query
  std::function<void()> wait;  // blocks until done
};

// A copy made by other means than a CUDA stream, finished when someone calls set(). It is what a CUDA
// event is to the ring, without a GPU: the tests use it to hold a slot as an unfinished copy would.
class CompletionFlag {
 public:
  void set();
  bool is_set() const;
  void wait() const;
  PendingCopy pending() const;

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    bool set = false;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// A slot's memory. It outlives the ring while a batch still uses it, and each storage lent over it marks
// it unused when that storage dies. (Counting references to one long-lived storage instead cannot work:
// since torch 2.10 a storage's Python wrapper, made by `tensor.untyped_storage()`, is kept alive by any
// other C++ reference to the storage, the ring's own included, so the count never fell back to one.)
struct SlotMemory {
  at::DataPtr memory;
  size_t capacity = 0;
  std::atomic<bool> lent{false};  // a storage over it is alive
};

class StagingRing {
 public:
  // `pinned`: page-locked memory from the CUDA runtime (needs a CUDA build and a driver), allocated with
  // `device` (a CUDA device index) current, so no context is made on another GPU; -1: the current one.
  StagingRing(int64_t max_slots, bool pinned, int64_t device = -1);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // A 1-D uint8 tensor of exactly `nbytes` over a free slot (reused, grown, or new), or over a fresh
  // buffer outside the ring when all `max_slots` are busy; and whether it is such a fresh buffer.
  std::pair<at::Tensor, bool> acquire(int64_t nbytes);
  // The same, as a storage lent over the slot (at least `nbytes` long, data at offset 0; the slot is free
  // again when it dies); `overflowed` says whether it is a fresh buffer past the bound.
  at::Storage acquire_storage(int64_t nbytes, bool& overflowed);
  // Marks the slot under `buffer` busy until `copy.done()` (a CUDA copy still reading it). Returns false
  // for a buffer outside the ring (an overflow one): its owner must keep it alive through the copy.
  bool hold_until_done(const at::Tensor& buffer, PendingCopy copy);
  // Copies `tensors` (CPU) into one slot at aligned offsets, with the GIL released by the caller's
  // binding; returns the slot's bytes and each tensor's byte offset in it. Lets a batch that arrived in
  // shared memory from a worker cross to the device as one copy.
  std::pair<at::Tensor, std::vector<int64_t>> pack(const std::vector<at::Tensor>& tensors);
  // True when `tensor` points into one of this ring's slots.
  bool owns(const at::Tensor& tensor) const;
  // Drops every slot nothing references; returns how many bytes were freed.
  int64_t trim();
  RingStats stats() const;

 private:
  struct Slot {
    std::shared_ptr<SlotMemory> memory;
    PendingCopy pending;  // empty functions when no copy is reading the slot
  };
  bool is_free(Slot& slot) const;
  at::Storage lend(Slot& slot);
  int64_t slot_index(const at::Storage& storage) const;  // -1: not one of the ring's slots
  at::Storage acquire_locked(int64_t nbytes, bool& overflowed);
  at::Storage allocate(size_t bytes);
  size_t capacity_for(size_t wanted, bool growing) const;

  mutable std::mutex mutex_;  // two threads may collate or pack at once
  std::vector<Slot> slots_;
  int64_t max_slots_;
  bool pinned_;
  int64_t device_;
  size_t largest_request_ = 0;  // the high-water mark that new slots are sized to
  RingStats counters_;
};

// Host memory for slots: page-locked when `pinned` (CUDA builds only, with CUDA device `device` current,
// -1 for the current one), else page-aligned memory.
at::DataPtr allocate_host_memory(size_t bytes, bool pinned, int64_t device);
at::DataPtr allocate_aligned_host_memory(size_t bytes);
// True when this build can pin memory and a CUDA driver and device are present.
bool pinned_memory_available();
// A PendingCopy that is done once all work queued so far on `stream` (a cudaStream_t of CUDA device
// `device`) has finished. CUDA builds only.
PendingCopy record_on_stream(int64_t stream, int64_t device);
// The CUDA runtime version this build was compiled against (e.g. 13000), or 0 for a CPU-only build.
int64_t built_cuda_version();

}  // namespace fastcollate
