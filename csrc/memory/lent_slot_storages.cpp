// The storages lent over slots: their deleters, which free a slot's side when the last tensor over it
// dies, and what a tensor over one is (shared_slot_kind, deliver_slot_tensor, received_slot_of), told by
// its deleter.
#include "memory/shared_slots.h"

#include <unistd.h>

#include "memory/slot_storages.h"

namespace fastcollate {

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

std::vector<int64_t> received_slot_of(const at::Tensor& tensor) {
  const LentBatch* batch = lent_batch(tensor, &reader_released);
  if (batch == nullptr) {
    return {};
  }
  return {static_cast<int64_t>(batch->pool->token()), batch->slot, static_cast<int64_t>(batch->seq)};
}

}  // namespace fastcollate
