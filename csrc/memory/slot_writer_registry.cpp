// The pool's registry of workers (after the slot table in its header): each worker's pid, its loader's key
// and that loader's bound, so that a claim takes a slot below the sum of the bounds of the loaders with a
// worker alive, and loaders that share the pool each have their share.
#include "memory/shared_slots.h"

#include <unistd.h>

#include <algorithm>
#include <array>

#include "memory/shared_slots_layout.h"

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

bool SharedSlots::register_writer(uint64_t loader, int64_t workers, int64_t bound) {
  const int64_t me = ::getpid();
  const Registration wanted{me, loader, workers, bound};
  if (registered_.pid == me && registered_.loader == loader && registered_.workers == workers &&
      registered_.bound == bound) {
    return true;  // the per-batch case
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    Header::Writer* entry = nullptr;
    for (int64_t i = 0; i < kMaxWriters && entry == nullptr; ++i) {
      if (header_->writer(i).pid.load(std::memory_order_acquire) == me) {
        entry = &header_->writer(i);  // this process's, with other values; or a dead worker's, its pid reused
        entry->pid.store(-1, std::memory_order_release);
      }
    }
    for (int64_t i = 0; i < kMaxWriters && entry == nullptr; ++i) {
      int64_t unused = 0;
      if (header_->writer(i).pid.compare_exchange_strong(unused, -1, std::memory_order_acq_rel)) {
        entry = &header_->writer(i);
      }
    }
    if (entry != nullptr) {
      entry->loader.store(loader, std::memory_order_relaxed);
      entry->workers.store(workers, std::memory_order_relaxed);
      entry->bound.store(bound, std::memory_order_relaxed);
      entry->pid.store(me, std::memory_order_release);
      registered_ = wanted;
      return true;
    }
    if (attempt == 0) {
      reclaim_dead_writers();  // forgets the registrations of workers that died
    }
  }
  return false;
}

SharedSlots::LoadersBound SharedSlots::loaders_bound(uint64_t loader, int64_t workers, int64_t bound) const {
  struct Entry {
    uint64_t loader;
    int64_t workers;
    int64_t bound;
    bool counted;
  };
  std::array<Entry, kMaxWriters + 1> entries;
  size_t count = 0;
  if (workers > 0) {
    entries[count++] = {loader, workers, bound, false};
  }
  for (int64_t i = 0; i < kMaxWriters; ++i) {
    const auto& writer = header_->writer(i);
    if (writer.pid.load(std::memory_order_acquire) > 0) {
      entries[count++] = {writer.loader.load(std::memory_order_relaxed),
                          std::max<int64_t>(writer.workers.load(std::memory_order_relaxed), 1),
                          writer.bound.load(std::memory_order_relaxed), false};
    }
  }
  LoadersBound out;
  for (size_t i = 0; i < count; ++i) {
    if (entries[i].counted) {
      continue;
    }
    int64_t members = 0;
    for (size_t j = i; j < count; ++j) {
      if (entries[j].loader == entries[i].loader && entries[j].workers == entries[i].workers &&
          entries[j].bound == entries[i].bound) {
        entries[j].counted = true;
        ++members;
      }
    }
    const int64_t loaders = (members + entries[i].workers - 1) / entries[i].workers;
    out.loaders += loaders;
    out.slots += loaders * entries[i].bound;
  }
  return out;
}

}  // namespace fastcollate
