// The shared slots' pool and each slot's state machine (the transitions, each a compare-and-swap on the
// slot's state word). Beside it: the shared file's layout and the word's bits (shared_slots_layout.h),
// whether a writer is alive (process_liveness.h), and the pool's Python face (bindings.cpp).
#include "memory/shared_slots.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <new>
#include <random>

#include "memory/process_liveness.h"
#include "memory/shared_slots_layout.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the pages fault in as written
#endif

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

}  // namespace

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

namespace {

// The context of a storage lent over a slot: one batch, in the writer or in the reader.
struct LentBatch {
  std::shared_ptr<SharedSlots> pool;
  std::shared_ptr<SharedSlots::Mapping> mapping;
  int64_t slot;
  uint32_t seq;
  pid_t pid;  // a forked child's copy of the storage must not change the slot's state
};

void writer_released(void* context);
void reader_released(void* context);

// Every pool of this process, for the fork handler below. Leaked: it must outlive static destruction.
std::mutex& pools_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<std::weak_ptr<SharedSlots>>& pools() {
  static auto* all = new std::vector<std::weak_ptr<SharedSlots>>;
  return *all;
}

// In a forked child: every received batch alive at the fork is moved onto private memory at the same
// address. The child inherits those batches (a dataset that kept one, a replay buffer) but holds none
// of their slots: once the parent drops its own, a worker may write the next batch there while the
// child still reads the kept one. With default_collate such a batch is shared memory the child keeps
// mapped; here it costs a copy of each batch alive at the fork, made by the child.
void copy_received_batches_in_child() {
  // Single-threaded now; a lock some parent thread held at the fork would never be released.
  for (const auto& weak : pools()) {
    if (auto pool = weak.lock()) {
      pool->privatize_received_batches();
    }
  }
}

void register_pool(const std::shared_ptr<SharedSlots>& pool) {
  static std::once_flag handler;
  std::call_once(handler, [] { ::pthread_atfork(nullptr, nullptr, &copy_received_batches_in_child); });
  std::lock_guard<std::mutex> lock(pools_mutex());
  auto& all = pools();
  all.erase(std::remove_if(all.begin(), all.end(), [](const auto& weak) { return weak.expired(); }), all.end());
  all.push_back(pool);
}

}  // namespace

void SharedSlots::privatize_received_batches() {
  for (const auto& weak : received_mappings_) {
    auto mapping = weak.lock();
    if (!mapping || mapping->lent_batches.load() == 0) {
      continue;
    }
    void* copy = ::mmap(nullptr, mapping->length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) {
      continue;  // no memory for it: the batch stays a view of the slot, as before
    }
    std::memcpy(copy, mapping->base, mapping->length);
    if (::mremap(copy, mapping->length, mapping->length, MREMAP_MAYMOVE | MREMAP_FIXED, mapping->base) == MAP_FAILED) {
      ::munmap(copy, mapping->length);
    }
  }
}

SharedSlots::SharedSlots(int fd, void* header, size_t header_bytes)
    : fd_(fd), header_(static_cast<Header*>(header)), header_bytes_(header_bytes) {
  const auto count = static_cast<size_t>(header_->capacity);
  writer_maps_.resize(count);
  written_.resize(count);
  reader_maps_.resize(count);
  pinned_maps_.resize(count);
  received_.resize(count);
  received_seq_.assign(count, -1);
}

SharedSlots::~SharedSlots() {
  ::munmap(header_, header_bytes_);
  ::close(fd_);
}

std::shared_ptr<SharedSlots> SharedSlots::create(int64_t capacity) {
  TORCH_CHECK(capacity >= 1 && capacity <= 4096, "SharedSlots: capacity must be in [1, 4096], got ", capacity);
  const int fd = ::memfd_create("fastcollate-slots", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  TORCH_CHECK(fd >= 0, "fastcollate: memfd_create failed (", std::strerror(errno), ")");
  const size_t header_bytes = header_bytes_for(capacity);
  void* header = MAP_FAILED;
  // Sealed against shrinking: whoever holds the descriptor (a worker, a program it started) can no longer
  // truncate the file under a batch still in use, which would read zeros or raise SIGBUS. It can still
  // write any byte: the design trusts every process that holds the descriptor. F_SEAL_SEAL: no one can
  // add a seal later (F_SEAL_GROW would stop every slot from growing).
  if (::fchmod(fd, 0600) == 0 && ::ftruncate(fd, static_cast<off_t>(header_bytes)) == 0 &&
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) == 0) {
    header = ::mmap(nullptr, header_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (header == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(false, "fastcollate: could not make the shared slots' file (", std::strerror(error), ")");
  }
  auto* fields = new (header) Header{};
  fields->capacity = static_cast<uint32_t>(capacity);  // before writer(i), which is placed by it
  for (int64_t i = 0; i < capacity; ++i) {
    new (&fields->slot(i)) Header::Slot{};
  }
  for (int64_t i = 0; i < kMaxWriters; ++i) {
    new (&fields->writer(i)) Header::Writer{};
  }
  std::random_device entropy;
  fields->token = static_cast<int64_t>(((uint64_t{entropy()} << 32) | entropy()) >> 1);
  fields->owner_pid = ::getpid();
  fields->max_batch_bytes = kMaxBatchBytes;
  fields->file_end.store(header_bytes);
  fields->version = kVersion;
  fields->magic = kMagic;
  std::shared_ptr<SharedSlots> pool(new SharedSlots(fd, header, header_bytes));
  register_pool(pool);
  return pool;
}

std::shared_ptr<SharedSlots> SharedSlots::attach(int fd) {
  // spawnv_passfds and recvfds hand the descriptor over inheritable: a program this process starts
  // (os.system, a subprocess with close_fds=False) must not get every batch with it.
  (void)::fcntl(fd, F_SETFD, FD_CLOEXEC);
  void* first = ::mmap(nullptr, kPage, PROT_READ, MAP_SHARED, fd, 0);
  if (first == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(false, "fastcollate: could not map the shared slots' header (", std::strerror(error), ")");
  }
  const auto* peek = static_cast<const Header*>(first);
  const bool valid = peek->magic == kMagic && peek->version == kVersion && peek->capacity >= 1;
  const size_t header_bytes = header_bytes_for(peek->capacity);
  ::munmap(first, kPage);
  if (!valid) {
    ::close(fd);
    TORCH_CHECK(false, "fastcollate: the descriptor is not a shared-slots file of this version");
  }
  void* header = ::mmap(nullptr, header_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (header == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(false, "fastcollate: could not map the shared slots' header (", std::strerror(error), ")");
  }
  std::shared_ptr<SharedSlots> pool(new SharedSlots(fd, header, header_bytes));
  register_pool(pool);
  return pool;
}

uint64_t SharedSlots::token() const {
  return static_cast<uint64_t>(header_->token);
}

int64_t SharedSlots::owner_pid() const {
  return header_->owner_pid;
}

int64_t SharedSlots::capacity() const {
  return header_->capacity;
}

std::shared_ptr<SharedSlots::Mapping> SharedSlots::mapping_for(std::vector<std::shared_ptr<Mapping>>& maps,
                                                               int64_t slot, size_t bytes) {
  auto& entry = header_->slot(slot);
  const uint64_t offset = entry.region_offset.load(std::memory_order_relaxed);
  const uint64_t length = entry.region_bytes.load(std::memory_order_relaxed);
  auto& current = maps[static_cast<size_t>(slot)];
  if (current && current->offset == offset) {
    return current;
  }
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(offset));
  if (base == MAP_FAILED) {
    return nullptr;  // errno says why
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->base = base;
  mapping->length = length;
  mapping->offset = offset;
  mapping->pid = ::getpid();
  // Fault the pages in with one call instead of one fault per 4 KiB: the writer is about to write them,
  // the reader to read what was written. Advice only: an older kernel refuses it harmlessly.
  (void)::madvise(base, std::min<size_t>(round_up_page(bytes), length), MADV_POPULATE_WRITE);
  current = mapping;
  ++mappings_;
  return mapping;
}

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

namespace {

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

SharedSlotStats SharedSlots::stats() const {
  SharedSlotStats out;
  out.capacity = capacity();
  for (int64_t i = 0; i < capacity(); ++i) {
    const uint64_t word = header_->slot(i).word.load(std::memory_order_acquire);
    out.slots_used += header_->slot(i).region_bytes.load(std::memory_order_relaxed) > 0 ? 1 : 0;
    switch (state_of(word)) {
      case kFree:
        (writer_holds(word) ? out.kept_by_writers : out.free) += 1;
        break;
      case kWriting:
        out.writing += 1;
        break;
      case kDelivered:
        out.delivered += 1;
        break;
      case kLent:
        out.lent += 1;
        break;
    }
  }
  struct stat info{};
  if (::fstat(fd_, &info) == 0) {
    out.bytes_held = static_cast<int64_t>(info.st_blocks) * 512;
    out.file_bytes = static_cast<int64_t>(info.st_size);
  }
  out.claims = header_->claims.load(std::memory_order_relaxed);
  out.fresh_fallbacks = header_->fresh_fallbacks.load(std::memory_order_relaxed);
  out.reclaimed = header_->reclaimed.load(std::memory_order_relaxed);
  out.receipts = receipts_.load();
  out.mappings = mappings_.load();
  out.registrations = registrations_.load();
  out.registration_failures = registration_failures_.load();
  const LoadersBound loaders = loaders_bound();
  out.loaders = loaders.loaders;
  out.bound = std::min(loaders.slots, capacity());
  // Only the owner receives (and so page-locks). A worker forked while a thread here was receiving
  // inherits reader_mutex_ locked, so it must not take it: its inherited mappings are not locked in it.
  if (owner_pid() == ::getpid()) {
    std::lock_guard<std::mutex> lock(reader_mutex_);
    for (const auto& mapping : pinned_maps_) {
      if (mapping && mapping->registered.load() && mapping->pid == ::getpid()) {
        out.registered_bytes += static_cast<int64_t>(mapping->length);
      }
    }
  }
  return out;
}

void SharedSlots::remember_written(int64_t slot, uint32_t seq, std::vector<WrittenField> fields) {
  std::lock_guard<std::mutex> lock(writer_mutex_);
  written_[static_cast<size_t>(slot)] = {seq, std::move(fields)};
}

std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<WrittenField>>> SharedSlots::written_fields() {
  std::lock_guard<std::mutex> lock(writer_mutex_);
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<WrittenField>>> out;
  for (size_t slot = 0; slot < written_.size(); ++slot) {
    if (!written_[slot].second.empty()) {
      out.push_back({{static_cast<int64_t>(slot), static_cast<int64_t>(written_[slot].first)}, written_[slot].second});
    }
  }
  return out;
}

std::string SharedSlots::describe_slot(int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < capacity(), "SharedSlots: no slot ", slot);
  return describe_word(header_->slot(slot).word.load(std::memory_order_acquire));
}

namespace {

void writer_released(void* context) {
  auto* batch = static_cast<LentBatch*>(context);
  if (::getpid() == batch->pid) {
    batch->pool->release_writer(batch->slot, batch->seq);
  }
  delete batch;
}

void reader_released(void* context) {
  auto* batch = static_cast<LentBatch*>(context);
  --batch->mapping->lent_batches;
  if (::getpid() == batch->pid) {
    batch->pool->release_reader(batch->slot, batch->seq);
  }
  delete batch;
}

const LentBatch* lent_batch(const at::Storage& storage, void (*deleter)(void*)) {
  const auto& data = storage.data_ptr();
  return data.get_deleter() == deleter ? static_cast<const LentBatch*>(data.get_context()) : nullptr;
}

const LentBatch* lent_batch(const at::Tensor& tensor, void (*deleter)(void*)) {
  if (!tensor.defined() || !tensor.has_storage() || !tensor.device().is_cpu()) {
    return nullptr;
  }
  return lent_batch(tensor.storage(), deleter);
}

}  // namespace

SlotKind shared_slot_kind(const at::Tensor& tensor) {
  if (lent_batch(tensor, &writer_released) != nullptr) {
    return SlotKind::kWriting;
  }
  const LentBatch* received = lent_batch(tensor, &reader_released);
  if (received == nullptr) {
    return SlotKind::kNone;
  }
  return received->mapping->registered.load() ? SlotKind::kPageLocked : SlotKind::kReceived;
}

std::vector<int64_t> deliver_slot_tensor(const at::Tensor& tensor) {
  const LentBatch* batch = lent_batch(tensor, &writer_released);
  if (batch == nullptr || batch->pid != ::getpid()) {
    return {};
  }
  const int marked = batch->pool->mark_delivered(batch->slot, batch->seq);
  if (marked < 0) {
    return {};
  }
  return {static_cast<int64_t>(batch->pool->token()), batch->slot, static_cast<int64_t>(batch->seq),
          static_cast<int64_t>(tensor.storage().nbytes()), marked};
}

namespace {

// The write this process is making into a slot through `storage`; null for any other storage.
const LentBatch* own_write(const at::Storage& storage) {
  const LentBatch* batch = lent_batch(storage, &writer_released);
  return batch != nullptr && batch->pid == ::getpid() ? batch : nullptr;
}

}  // namespace

bool writes_a_slot(const at::Storage& storage) {
  return own_write(storage) != nullptr;
}

void remember_written_fields(const at::Storage& storage, std::vector<WrittenField> fields) {
  if (const LentBatch* batch = own_write(storage)) {
    batch->pool->remember_written(batch->slot, batch->seq, std::move(fields));
  }
}

std::vector<int64_t> received_slot_of(const at::Tensor& tensor) {
  const LentBatch* batch = lent_batch(tensor, &reader_released);
  if (batch == nullptr) {
    return {};
  }
  return {static_cast<int64_t>(batch->pool->token()), batch->slot, static_cast<int64_t>(batch->seq)};
}

}  // namespace fastcollate
