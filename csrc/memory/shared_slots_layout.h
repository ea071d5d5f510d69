// The shared-slots file's layout, which every process that maps it agrees on: the header, the slot table,
// the writer registry and the 64-bit state word that each slot's state machine lives in (its bits are
// described in shared_slots.h; the transitions, each a compare-and-swap on it, are in the pool's files,
// shared_slot_pool.cpp and slot_*.cpp, which alone include this file).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "memory/shared_slots.h"

namespace fastcollate {

namespace slot_layout {

constexpr uint64_t kMagic = 0x73746f6c73636621ULL;  // "!fcslots"
constexpr uint32_t kVersion = 3;
constexpr size_t kPage = 4096;
// The largest batch a slot takes (a larger one takes the fresh-shared-memory path).
constexpr uint64_t kMaxBatchBytes = uint64_t{1} << 38;  // 256 GiB
constexpr size_t kSlotsOffset = 128;
// Worker processes one pool can count (the registry after the slot table). A worker that finds no room
// counts itself in at each claim, so its loader's bound is still added to the registered sum.
constexpr int64_t kMaxWriters = 64;

enum State : uint64_t { kFree = 0, kWriting = 1, kDelivered = 2, kLent = 3 };
constexpr uint64_t kStateMask = 3;
constexpr uint64_t kWriterHolds = 4;
constexpr uint64_t kPidMask = (uint64_t{1} << 29) - 1;

inline State state_of(uint64_t word) {
  return static_cast<State>(word & kStateMask);
}
inline bool writer_holds(uint64_t word) {
  return (word & kWriterHolds) != 0;
}
inline int64_t pid_of(uint64_t word) {
  return static_cast<int64_t>((word >> 3) & kPidMask);
}
inline uint32_t seq_of(uint64_t word) {
  return static_cast<uint32_t>(word >> 32);
}
inline uint64_t make_word(State state, bool holds, int64_t pid, uint32_t seq) {
  return (uint64_t{seq} << 32) | ((static_cast<uint64_t>(pid) & kPidMask) << 3) | (holds ? kWriterHolds : 0) |
         static_cast<uint64_t>(state);
}
inline uint64_t with_state(uint64_t word, State state) {
  return (word & ~kStateMask) | static_cast<uint64_t>(state);
}

inline size_t round_up_page(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
}

inline std::string describe_word(uint64_t word) {
  std::ostringstream out;
  switch (state_of(word)) {
    case kFree:
      out << "is free";
      break;
    case kWriting:
      out << "is being written by pid " << pid_of(word);
      break;
    case kDelivered:
      out << "holds a batch sent by pid " << pid_of(word) << " and not yet received";
      break;
    case kLent:
      out << "holds a batch this process received";
      break;
  }
  out << " (batch #" << seq_of(word) << ")";
  return out.str();
}

}  // namespace slot_layout

struct SharedSlots::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t capacity;
  uint64_t max_batch_bytes;
  int64_t token;
  int64_t owner_pid;
  std::atomic<int64_t> claims;
  std::atomic<int64_t> fresh_fallbacks;
  std::atomic<int64_t> reclaimed;
  // Regions are appended at the file's end as slots are first written or outgrown, so the file is only
  // as large as the slots in use (a file-size limit, `ulimit -f`, counts its size, sparse or not).
  std::atomic<uint64_t> file_end;

  // A slot's region fields are written only by the writer that claimed it, before the compare-and-swap
  // that sends the batch, and read by the others after theirs.
  struct Slot {
    std::atomic<uint64_t> word;           // see shared_slots.h
    std::atomic<uint64_t> region_offset;  // where its region starts in the file (0: none yet)
    std::atomic<uint64_t> region_bytes;   // the region's size: the largest batch written, page-rounded, + 1/16
  };
  Slot& slot(int64_t index) {
    return reinterpret_cast<Slot*>(reinterpret_cast<char*>(this) + slot_layout::kSlotsOffset)[index];
  }

  // A worker process and the loader it serves, so that the pool's bound is the sum over the loaders with
  // a worker alive. Filled in while `pid` is -1, then published by storing the pid; 0 is an unused entry.
  struct Writer {
    std::atomic<int64_t> pid;
    std::atomic<uint64_t> loader;  // the loader's key: its DataLoader iterator's base seed
    std::atomic<int64_t> workers;  // that loader's num_workers
    std::atomic<int64_t> bound;    // the slots that loader's workers may use at once
  };
  Writer& writer(int64_t index) {
    return reinterpret_cast<Writer*>(reinterpret_cast<char*>(this) + slot_layout::kSlotsOffset +
                                     capacity * sizeof(Slot))[index];
  }
};
static_assert(sizeof(SharedSlots::Header) <= slot_layout::kSlotsOffset, "the slot table starts after the header");
namespace slot_layout {
// The header, the slot table and the writer registry: what create() maps and attach() maps again.
inline size_t header_bytes_for(int64_t capacity) {
  return round_up_page(kSlotsOffset + static_cast<size_t>(capacity) * sizeof(SharedSlots::Header::Slot) +
                       static_cast<size_t>(kMaxWriters) * sizeof(SharedSlots::Header::Writer));
}
}  // namespace slot_layout

static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "state words and the registry are shared between processes");

}  // namespace fastcollate
