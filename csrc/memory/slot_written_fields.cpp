// The fields of the batch a worker wrote last into each slot: what a worker that finds every slot held
// tells the main process, which alone knows which of them it kept.
#include "memory/shared_slots.h"

#include <unistd.h>

#include <mutex>

#include "memory/slot_storages.h"

namespace fastcollate {

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

}  // namespace fastcollate
