// A worker claims a slot: the lowest free one below its loaders' bound, its region grown at the file's end
// when the batch outgrows it, and a storage over this process's mapping of it that frees the slot when
// the worker's own view dies; or why there is none (ClaimRefusal).
#include "memory/shared_slots.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "memory/shared_slots_layout.h"
#include "memory/slot_storages.h"

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

namespace {

// Mappings a writer keeps for slots no batch of its own uses now, so that a slot it writes again needs no
// new mapping (and no page-table faults). More would only cost address space: RLIMIT_AS counts every one.
constexpr size_t kWriterIdleMappings = 4;

at::Tensor bytes_over(at::Storage storage, int64_t nbytes) {
  at::Tensor view = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  view.set_(std::move(storage), /*storage_offset=*/0, {nbytes}, {1});
  return view;
}

// Grows the file to at least `target` bytes. Two writers may grow it at once: the shrink seal makes the
// smaller of two ftruncates fail (EPERM) rather than cut the other's region off, and that is success.
int grow_file(int fd, uint64_t target) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    struct stat info{};
    if (::fstat(fd, &info) != 0) {
      return errno;
    }
    if (static_cast<uint64_t>(info.st_size) >= target) {
      return 0;
    }
    if (::ftruncate(fd, static_cast<off_t>(target)) == 0) {
      return 0;
    }
    if (errno != EPERM && errno != EINTR) {
      return errno;
    }
  }
  return EPERM;
}

}  // namespace

void SharedSlots::trim_writer_mappings(size_t keep) {
  for (;;) {
    std::shared_ptr<Mapping>* oldest = nullptr;
    size_t idle = 0;
    for (auto& mapping : writer_maps_) {
      if (mapping && mapping.use_count() == 1) {  // only this cache holds it: no batch of ours is over it
        ++idle;
        if (oldest == nullptr || mapping->last_claim < (*oldest)->last_claim) {
          oldest = &mapping;
        }
      }
    }
    if (idle <= keep) {
      return;
    }
    oldest->reset();
  }
}

std::string SharedSlots::held_below(int64_t limit, int64_t wanted) const {
  int64_t lent = 0, kept = 0, delivered = 0, writing = 0;
  for (int64_t i = 0; i < limit; ++i) {
    const uint64_t word = header_->slot(i).word.load(std::memory_order_acquire);
    switch (state_of(word)) {
      case kFree:
        kept += writer_holds(word) ? 1 : 0;
        break;
      case kWriting:
        ++writing;
        break;
      case kDelivered:
        ++delivered;
        break;
      case kLent:
        ++lent;
        break;
    }
  }
  // Counted below `limit` only: slots above it may hold batches from when the bound was larger.
  return "all " + std::to_string(limit) + " shared slots" +
         (wanted > limit ? " of the pool (its loaders' bounds add up to " + std::to_string(wanted) + ")"
                         : std::string()) +
         " are held (" + std::to_string(lent) + " by batches the main process still holds, " + std::to_string(kept) +
         " by batches workers keep, " + std::to_string(delivered) + " sent and not yet received, " +
         std::to_string(writing) + " being written)";
}

at::Tensor SharedSlots::claim(int64_t nbytes, int64_t bound, uint64_t loader, int64_t loader_workers,
                              ClaimRefusal& refusal) {
  TORCH_CHECK(nbytes >= 0, "SharedSlots.claim: nbytes must be >= 0, got ", nbytes);
  const size_t need = round_up_page(static_cast<size_t>(nbytes));
  if (need > header_->max_batch_bytes) {
    refusal = {"too large", "a batch of " + std::to_string(nbytes) + " bytes is larger than a slot takes"};
    return {};
  }
  const int64_t me = ::getpid();
  std::lock_guard<std::mutex> lock(writer_mutex_);
  const bool counted = loader_workers > 0 && register_writer(loader, loader_workers, bound);
  int64_t chosen = -1;
  uint32_t seq = 0;
  int64_t wanted = bound;
  int64_t limit = bound;
  for (int attempt = 0; attempt < 2 && chosen < 0; ++attempt) {
    // Read at each claim: another loader's workers may have started or ended since. A worker the registry
    // had no room for counts itself in, so its loader still has its share.
    if (loader_workers > 0) {
      wanted = (counted ? loaders_bound() : loaders_bound(loader, loader_workers, bound)).slots;
    }
    limit = std::clamp<int64_t>(wanted, 1, capacity());
    // Lowest index first, so the slots in use stay as few as the batches in flight. Among the free ones:
    // first those this process already maps and that are large enough (no new mapping), then those large
    // enough (a slot grows only when a larger batch arrives), then any.
    for (int pass = 0; pass < 3 && chosen < 0; ++pass) {
      for (int64_t i = 0; i < limit && chosen < 0; ++i) {
        auto& entry = header_->slot(i);
        uint64_t word = entry.word.load(std::memory_order_acquire);
        if (state_of(word) != kFree || writer_holds(word)) {
          continue;
        }
        const bool large_enough = entry.region_bytes.load(std::memory_order_relaxed) >= need;
        const auto& mapped = writer_maps_[static_cast<size_t>(i)];
        if ((pass == 0 &&
             !(large_enough && mapped && mapped->offset == entry.region_offset.load(std::memory_order_relaxed))) ||
            (pass == 1 && !large_enough)) {
          continue;
        }
        const uint32_t next_seq = seq_of(word) + 1;
        if (entry.word.compare_exchange_strong(word, make_word(kWriting, true, me, next_seq),
                                               std::memory_order_acq_rel)) {
          chosen = i;
          seq = next_seq;
        }
      }
    }
    if (chosen < 0 && (attempt > 0 || reclaim_dead_writers() == 0)) {
      break;
    }
  }
  if (chosen < 0) {
    refusal = {wanted > capacity() ? "room" : "bound", held_below(limit, wanted)};
    return {};
  }
  auto& entry = header_->slot(chosen);
  auto give_back = [&] { entry.word.store(make_word(kFree, false, 0, seq), std::memory_order_release); };
  const uint64_t old_bytes = entry.region_bytes.load(std::memory_order_relaxed);
  if (old_bytes < need) {
    // A new region at the file's end; the old one's pages go back (no one uses them: the slot is ours).
    const uint64_t bytes = std::min<uint64_t>(round_up_page(need + need / 16), header_->max_batch_bytes);
    uint64_t offset = header_->file_end.fetch_add(bytes);
    if (const int error = grow_file(fd_, offset + bytes); error != 0) {
      uint64_t end = offset + bytes;
      header_->file_end.compare_exchange_strong(end, offset);  // unless another region followed meanwhile
      give_back();
      refusal = {"file", "the pool's file could not grow to " + std::to_string(offset + bytes) + " bytes (" +
                             std::strerror(error) + (error == EFBIG ? ": a file-size limit, ulimit -f" : "") + ")"};
      return {};
    }
    if (old_bytes > 0) {
      (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(entry.region_offset.load(std::memory_order_relaxed)),
                        static_cast<off_t>(old_bytes));
    }
    entry.region_offset.store(offset, std::memory_order_relaxed);
    entry.region_bytes.store(bytes, std::memory_order_relaxed);
  }
  std::shared_ptr<Mapping> mapping = mapping_for(writer_maps_, chosen, need);
  if (!mapping) {
    trim_writer_mappings(0);  // the address space may be short (RLIMIT_AS): give back what is idle, once
    mapping = mapping_for(writer_maps_, chosen, need);
  }
  if (!mapping) {
    const int error = errno;
    give_back();
    refusal = {"mapping", "mapping a slot of " + std::to_string(entry.region_bytes.load(std::memory_order_relaxed)) +
                              " bytes failed (" + std::strerror(error) +
                              (error == ENOMEM ? ": the address space is short, ulimit -v" : "") + ")"};
    return {};
  }
  mapping->last_claim = static_cast<uint64_t>(header_->claims.fetch_add(1, std::memory_order_relaxed)) + 1;
  trim_writer_mappings(kWriterIdleMappings);
  auto* context = new LentBatch{shared_from_this(), mapping, chosen, seq, static_cast<pid_t>(me)};
  at::Storage storage(at::Storage::use_byte_size_t(), nbytes,
                      at::DataPtr(mapping->base, context, &writer_released, at::Device(at::kCPU)),
                      /*allocator=*/nullptr, /*resizable=*/false);
  return bytes_over(std::move(storage), nbytes);
}

void SharedSlots::count_fresh_fallback() {
  header_->fresh_fallbacks.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace fastcollate
