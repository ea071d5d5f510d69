// Slots shared between the main process and its DataLoader workers.
//
// The main process owns one memfd (no name in /dev/shm, mode 0600, sealed against shrinking) for each
// pool: a header page with one state word per slot, then the slots' regions, each appended when its slot
// is first written or outgrown, so the file is as large as the slots in use (a `ulimit -f` counts it). A worker claims
// a free slot with a compare-and-swap on its state word, writes the batch through its own long-lived mapping, and sends
// the main process only (slot, sequence number, views). The main process maps each slot once and lends every batch a
// storage over its mapping; when that storage dies the slot is free again. So per batch there is no new segment, no new
// mapping, no page fault after warm-up and no copy; with CUDA, the main process's mapping of each slot is registered
// (page-locked) once.
//
// A slot's state word (64 bits, in shared memory, changed only by compare-and-swap):
//   bits 0-1  state: free / being written / delivered (sent to the main process) / lent (held there)
//   bit  2    the writer still holds its own storage over the slot (a worker may keep a batch)
//   bits 3-31 the writer's pid
//   bits 32-63 the sequence number of the slot's current batch
// A slot may be claimed only when it is free and its writer's bit is clear, so neither a batch the
// consumer keeps nor one a worker keeps is ever overwritten.
//
// After the slot table, a registry of workers: each worker's pid, its loader's key and that loader's
// bound. A claim takes a slot below the sum of the bounds of the loaders with a worker registered, so
// loaders that share the pool (a train and an eval loader on one collate) each have their share.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fastcollate {

struct SharedSlotStats {
  int64_t capacity = 0;               // slots the pool's header has room for
  int64_t free = 0;                   // free, and no worker holds its own view
  int64_t writing = 0;                // claimed by a worker, being written
  int64_t delivered = 0;              // written and sent, not yet received
  int64_t lent = 0;                   // received: tensors in this process still use it
  int64_t kept_by_writers = 0;        // received and dropped here, but a worker still holds its own view
  int64_t slots_used = 0;             // slots some batch has been written into
  int64_t bytes_held = 0;             // memory the pool's file holds (touched pages, the header's included)
  int64_t file_bytes = 0;             // the file's size: what a file-size limit (ulimit -f) counts
  int64_t claims = 0;                 // batches written into a slot, by any worker
  int64_t fresh_fallbacks = 0;        // batches that got fresh shared memory because no slot was free
  int64_t reclaimed = 0;              // slots taken back from a writer that died
  int64_t receipts = 0;               // batches received by this process
  int64_t mappings = 0;               // slot mappings this process made (new slots and grown ones)
  int64_t registrations = 0;          // of those, registered with CUDA (page-locked)
  int64_t registration_failures = 0;  // mappings left pageable because page-locking them failed
  int64_t registered_bytes = 0;       // bytes of this process's mappings page-locked now
  int64_t loaders = 0;                // loaders with a registered worker alive (a claim registers its worker)
  int64_t bound = 0;                  // the sum of their bounds: the slots their workers may use at once
};

// Why claim() gave no slot: `cause` is "bound" (every slot below the bound is held, after taking back
// those of writers that died), "room" (the same, with the loaders' bounds adding up past the capacity:
// a larger bound cannot help), "file" (the pool's file could not grow: a file-size limit), "mapping"
// (mmap failed: an address-space limit) or "too large"; `detail` says it with the numbers.
struct ClaimRefusal {
  std::string cause;
  std::string detail;
};

// A field of a batch a worker wrote into a slot: where its bytes lie in the slot, and its key in the batch.
struct WrittenField {
  int64_t offset = 0;
  int64_t nbytes = 0;
  std::string key;
};

class SharedSlots : public std::enable_shared_from_this<SharedSlots> {
 public:
  // A new pool owned by this process, with room for `capacity` slots.
  static std::shared_ptr<SharedSlots> create(int64_t capacity);
  // The pool behind `fd` (a descriptor this call takes over), made by another process.
  static std::shared_ptr<SharedSlots> attach(int fd);
  ~SharedSlots();
  SharedSlots(const SharedSlots&) = delete;
  SharedSlots& operator=(const SharedSlots&) = delete;

  int fd() const { return fd_; }
  uint64_t token() const;     // the pool's random identity, the same in every process
  int64_t owner_pid() const;  // the process that made it
  int64_t capacity() const;

  // Writer side (a worker). A 1-D uint8 tensor of `nbytes` over the lowest free slot below the bound (one
  // this process maps and large enough first), or an undefined tensor and why in `refusal`. `bound` is
  // what the worker's loader may use. With `loader_workers` > 0 this process registers as a worker of
  // `loader` (its key) with `loader_workers` workers, and the claim's bound is the sum over the loaders
  // with a registered worker alive and its own (loaders_bound), so loaders sharing the pool do not crowd
  // each other out; with 0 it is `bound` itself.
  at::Tensor claim(int64_t nbytes, int64_t bound, uint64_t loader, int64_t loader_workers, ClaimRefusal& refusal);
  // Counts a batch that went to fresh shared memory because claim() found no slot.
  void count_fresh_fallback();
  // The fields of the batch this process wrote last into each slot, by (slot, sequence number): what a
  // worker that finds every slot held tells the main process, which alone knows which of them it kept.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<WrittenField>>> written_fields();
  void remember_written(int64_t slot, uint32_t seq, std::vector<WrittenField> fields);

  // Reader side (the main process). A tensor of `dtype`, `sizes`, `strides` at element `offset` over
  // the slot's batch `seq` of `nbytes`; the first view of a batch moves the slot from delivered to lent
  // (so a batch is received at most once: any other state or sequence number raises), the others share
  // its storage. With `pin_device` >= 0 the view is over a page-locked mapping of the slot (registered
  // once; kept apart from the pageable one, so a batch received outside DeviceLoader is never pinned);
  // if page-locking fails the view is over the pageable one, and the failure is counted.
  at::Tensor receive(int64_t slot, int64_t seq, int64_t nbytes, at::ScalarType dtype, int64_t offset,
                     at::IntArrayRef sizes, at::IntArrayRef strides, int64_t pin_device);

  // Frees every slot whose writer died while writing it or before it was received, and forgets dead
  // workers' registrations; returns how many slots.
  int64_t reclaim_dead_writers();
  // The loaders registered with a worker alive (or dead and not yet forgotten: reclaim_dead_writers), and
  // the sum of their bounds. Two loaders with one key (their iterators drew the same base seed) are told
  // apart by counting workers: one loader's bound for each `workers` of them. With `workers` > 0, one more
  // worker of `loader` is counted: one the registry had no room for.
  struct LoadersBound {
    int64_t loaders = 0;
    int64_t slots = 0;
  };
  LoadersBound loaders_bound(uint64_t loader = 0, int64_t workers = 0, int64_t bound = 0) const;
  SharedSlotStats stats() const;
  int64_t registration_failures() const { return registration_failures_.load(); }  // cheap: read per batch
  std::string describe_slot(int64_t slot) const;
  // In a forked child: moves the batches this process received and still holds onto private memory
  // (see the fork handler in shared_slot_pool.cpp).
  void privatize_received_batches();

  // State changes made by the storages lent over slots (see the state word above).
  // Writer: its batch is being sent. 1: the first message to name it; 0: delivered already (by the message
  // being pickled, or by an earlier one); -1: not this writer's current write, or received already.
  int mark_delivered(int64_t slot, uint32_t seq);
  // Writer: the message that marked the batch delivered was never sent (pickling it failed), so the slot
  // is back to being written, and free again once the writer's view dies.
  void undeliver(int64_t slot, uint32_t seq);
  void release_writer(int64_t slot, uint32_t seq);  // writer: its own view died
  void release_reader(int64_t slot, uint32_t seq);  // reader: the received batch died

  struct Header;
  struct Mapping;

 private:
  SharedSlots(int fd, void* header, size_t header_bytes);
  // This process's mapping of the slot's current region, from `maps` or made now (faulting in `bytes`);
  // null, with errno set, when mmap fails.
  std::shared_ptr<Mapping> mapping_for(std::vector<std::shared_ptr<Mapping>>& maps, int64_t slot, size_t bytes);
  // Unmaps the least recently written idle writer mappings past `keep` (caller holds writer_mutex_).
  void trim_writer_mappings(size_t keep);
  // Registers this process as a worker of `loader` in the header's registry, once (caller holds
  // writer_mutex_); false when the registry has no room, even after forgetting dead workers.
  bool register_writer(uint64_t loader, int64_t workers, int64_t bound);
  // Why a claim found no slot below `limit` (the bound it used; `wanted` before the capacity clamped it):
  // what holds those slots.
  std::string held_below(int64_t limit, int64_t wanted) const;

  int fd_;
  Header* header_;
  size_t header_bytes_;
  // This process's mappings and receipts (the header is lock-free). The writer's side has its own lock,
  // which the main process never takes: a worker forked while a main-process thread is receiving
  // inherits `reader_mutex_` locked, and must not need it.
  mutable std::mutex reader_mutex_;  // mutable: stats() reads the pinned mappings under it
  std::mutex writer_mutex_;
  std::vector<std::shared_ptr<Mapping>> writer_maps_;
  std::vector<std::pair<uint32_t, std::vector<WrittenField>>> written_;  // by slot, under writer_mutex_
  struct Registration {
    int64_t pid = 0;  // the process that registered: a forked child registers itself
    uint64_t loader = 0;
    int64_t workers = 0;
    int64_t bound = 0;
  } registered_;  // under writer_mutex_
  std::vector<std::shared_ptr<Mapping>> reader_maps_;
  std::vector<std::shared_ptr<Mapping>> pinned_maps_;
  std::vector<std::weak_ptr<Mapping>> received_mappings_;  // every reader mapping made, for the fork handler
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>>
      received_;  // the live storage of each slot's batch
  std::vector<int64_t> received_seq_;
  std::atomic<int64_t> receipts_{0};
  std::atomic<int64_t> mappings_{0};
  std::atomic<int64_t> registrations_{0};
  std::atomic<int64_t> registration_failures_{0};
};

// What a tensor's storage is, by its deleter. Exported to Python once, as _C.SLOT_KIND_NONE and the others
// (bindings.cpp), which worker_slots.py compares _C.shared_slot_kind with: the values are the module's API.
enum class SlotKind : int64_t {
  kNone = 0,        // not a slot
  kWriting = 1,     // a worker's view of the slot it is writing
  kReceived = 2,    // a batch received from a worker
  kPageLocked = 3,  // the same, over the slot's page-locked mapping (DeviceLoader's)
};
SlotKind shared_slot_kind(const at::Tensor& tensor);
// For a worker's view of a slot it wrote: marks the slot delivered (it is about to be sent) and returns
// (pool token, slot, sequence number, storage bytes, first) where first is 1 when this call marked it and
// 0 when it was delivered already. Empty when the tensor is not such a view, or its batch was received
// already (a worker's collate sending a batch it kept a second time): the caller then sends the tensor the
// ordinary way, as it must for a batch an earlier message delivered.
std::vector<int64_t> deliver_slot_tensor(const at::Tensor& tensor);
// For a worker's storage over the slot it writes: remembers `fields` as that write's (written_fields);
// nothing for any other storage. `fields` is made only when this says the storage is such a slot.
bool writes_a_slot(const at::Storage& storage);
void remember_written_fields(const at::Storage& storage, std::vector<WrittenField> fields);
// For a tensor received over a slot: (pool token, slot, sequence number); empty for any other tensor.
std::vector<int64_t> received_slot_of(const at::Tensor& tensor);

// Page-locks (and unlocks) host memory this process mapped, for CUDA copies. CUDA builds only.
void register_host_memory(void* ptr, size_t bytes, int64_t device);
void unregister_host_memory(void* ptr, int64_t device);  // `device`: the one it was registered with

}  // namespace fastcollate
