// A claimed slot's batch on its way to the main process and back to free: delivered when its message is
// sent, back to being written when that message was never sent, and free again once both the writer's
// view and the received batch have died (each a compare-and-swap on the slot's state word).
#include "memory/shared_slots.h"

#include <unistd.h>

#include "memory/shared_slots_layout.h"

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

int SharedSlots::mark_delivered(int64_t slot, uint32_t seq) {
  auto& word = header_->slot(slot).word;
  uint64_t current = word.load(std::memory_order_acquire);
  for (;;) {
    if (seq_of(current) != seq || pid_of(current) != (::getpid() & static_cast<int64_t>(kPidMask))) {
      return -1;
    }
    if (state_of(current) == kDelivered) {
      return 0;  // another tensor of the message that sent it, or a later message (the caller knows which)
    }
    if (state_of(current) != kWriting) {
      return -1;  // received already: this is the batch sent a second time
    }
    if (word.compare_exchange_weak(current, with_state(current, kDelivered), std::memory_order_acq_rel)) {
      return 1;
    }
  }
}

void SharedSlots::undeliver(int64_t slot, uint32_t seq) {
  TORCH_CHECK(slot >= 0 && slot < capacity(), "SharedSlots: no slot ", slot);
  auto& word = header_->slot(slot).word;
  uint64_t current = word.load(std::memory_order_acquire);
  while (state_of(current) == kDelivered && seq_of(current) == seq &&
         pid_of(current) == (::getpid() & static_cast<int64_t>(kPidMask))) {
    // Back to being written while the writer's view lives (it frees the slot when it dies); free at once
    // when that view is gone already (torch moved the storage to fresh shared memory earlier in the same
    // message, for a tensor subclass say).
    const uint64_t next = writer_holds(current) ? with_state(current, kWriting) : with_state(current, kFree);
    if (word.compare_exchange_weak(current, next, std::memory_order_acq_rel)) {
      return;
    }
  }
}

void SharedSlots::release_writer(int64_t slot, uint32_t seq) {
  auto& word = header_->slot(slot).word;
  uint64_t current = word.load(std::memory_order_acquire);
  for (;;) {
    if (seq_of(current) != seq || !writer_holds(current)) {
      return;  // taken back already
    }
    uint64_t next = current & ~kWriterHolds;
    if (state_of(current) == kWriting) {
      next = with_state(next, kFree);  // the batch was never sent: the slot is free
    }
    if (word.compare_exchange_weak(current, next, std::memory_order_acq_rel)) {
      return;
    }
  }
}

void SharedSlots::release_reader(int64_t slot, uint32_t seq) {
  auto& word = header_->slot(slot).word;
  uint64_t current = word.load(std::memory_order_acquire);
  for (;;) {
    if (seq_of(current) != seq || state_of(current) != kLent) {
      return;
    }
    if (word.compare_exchange_weak(current, with_state(current, kFree), std::memory_order_acq_rel)) {
      return;
    }
  }
}

}  // namespace fastcollate
