// This process's side of a slot, shared by the files of the shared slots' pool (shared_slots.h): its
// mapping of a slot's region, and the storages lent over it: one batch, in its writer (claim) or in the
// reader (receive), whose deleter changes the slot's state when the last tensor over it dies.
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "memory/shared_slots.h"

namespace fastcollate {

// One process's mapping of a slot's region; unmapped (and unregistered) when the last batch over it dies.
struct SharedSlots::Mapping {
  void* base = nullptr;
  size_t length = 0;
  uint64_t offset = 0;                   // the region it maps: a slot that moved needs a new mapping
  uint64_t last_claim = 0;               // the writer's claim count when it last wrote here (least recent goes)
  std::atomic<int64_t> lent_batches{0};  // received batches over it alive in this process
  pid_t pid = 0;                         // a forked child inherits the mapping but not the CUDA registration
  std::atomic<bool> registered{false};   // read without the lock by shared_slot_kind
  bool registration_failed = false;      // tried once: not again on every batch
  int64_t device = -1;                   // the CUDA device it was registered with: unregistered there too
  ~Mapping() {
    if (registered.load() && ::getpid() == pid) {
      unregister_host_memory(base, device);
    }
    ::munmap(base, length);
  }
};

// The context of a storage lent over a slot: one batch, in the writer or in the reader.
struct LentBatch {
  std::shared_ptr<SharedSlots> pool;
  std::shared_ptr<SharedSlots::Mapping> mapping;
  int64_t slot;
  uint32_t seq;
  pid_t pid;  // a forked child's copy of the storage must not change the slot's state
};

// The deleters of the storages lent over slots (a LentBatch each): the writer's view died, or the
// received batch did. Which of the two a storage has tells what it is (shared_slot_kind).
void writer_released(void* context);
void reader_released(void* context);

// The batch a storage (or a CPU tensor's storage) is lent over, when its deleter is `deleter`; else null.
const LentBatch* lent_batch(const at::Storage& storage, void (*deleter)(void*));
const LentBatch* lent_batch(const at::Tensor& tensor, void (*deleter)(void*));

}  // namespace fastcollate
