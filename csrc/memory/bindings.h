// The Python face of the memory side: the pybind code of the staging ring, the shared slots and the
// build's CUDA facts, kept here so that the ring and slot files hold no pybind. module.cpp calls these.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace fastcollate {

// _C.built_with_cuda, _C.built_cuda_version and _C.pinned_memory_available: what this build can pin.
void bind_build_info(pybind11::module_& m);
// _C.RingStats, _C.CompletionFlag and _C.StagingRing (the pybind handle fastcollate.StagingRing wraps).
void bind_staging_ring(pybind11::module_& m);
// _C.SharedSlotStats, _C.SharedSlots, _C.shared_slot_kind and _C.deliver_slot_tensor.
void bind_shared_slots(pybind11::module_& m);

}  // namespace fastcollate
