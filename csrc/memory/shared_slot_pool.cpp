// The shared slots' pool: its file, made (create) or mapped from another process (attach), this process's
// mappings of its slots, what it reports (stats, describe_slot), and every pool of the process, for the
// fork handler that takes the batches a forked child inherits off their slots. Beside it: each slot's
// state machine (claim, delivery, receipt, reclaim: the memory/slot_*.cpp files), the file's layout and
// the state word's bits (shared_slots_layout.h), and the pool's Python face (bindings.cpp).
#include "memory/shared_slots.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <random>

#include "memory/shared_slots_layout.h"
#include "memory/slot_storages.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the pages fault in as written
#endif

namespace fastcollate {

using namespace slot_layout;  // the file's constants and state words, used throughout

namespace {

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

std::string SharedSlots::describe_slot(int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < capacity(), "SharedSlots: no slot ", slot);
  return describe_word(header_->slot(slot).word.load(std::memory_order_acquire));
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

}  // namespace fastcollate
