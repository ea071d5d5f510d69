// Slots taken back from writers that died: a batch a dead worker was writing, or sent and not yet
// received, never will be. Their registrations in the pool's registry of workers are forgotten too.
#include "memory/shared_slots.h"

#include "memory/process_liveness.h"
#include "memory/shared_slots_layout.h"

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

int64_t SharedSlots::reclaim_dead_writers() {
  int64_t reclaimed = 0;
  for (int64_t i = 0; i < capacity(); ++i) {
    auto& word = header_->slot(i).word;
    uint64_t current = word.load(std::memory_order_acquire);
    for (;;) {
      const State state = state_of(current);
      const bool unsent = state == kWriting || state == kDelivered;
      if ((!unsent && !writer_holds(current)) || pid_of(current) == 0 || !process_is_gone(pid_of(current))) {
        break;
      }
      // The writer died: its own view of the slot went with it, and a batch it wrote but that was not
      // received never will be (DataLoader drops a dead worker's queue). A batch received stays lent.
      const uint64_t next = make_word(unsent ? kFree : state, false, 0, seq_of(current));
      if (word.compare_exchange_weak(current, next, std::memory_order_acq_rel)) {
        reclaimed += unsent ? 1 : 0;
        break;
      }
    }
  }
  header_->reclaimed.fetch_add(reclaimed, std::memory_order_relaxed);
  for (int64_t i = 0; i < kMaxWriters; ++i) {
    auto& pid = header_->writer(i).pid;
    int64_t current = pid.load(std::memory_order_acquire);
    if (current > 0 && process_is_gone(current)) {
      pid.compare_exchange_strong(current, 0, std::memory_order_acq_rel);  // not an entry being filled in
    }
  }
  return reclaimed;
}

}  // namespace fastcollate
