// Page-locked host memory from the CUDA runtime: the staging ring's pinned slots and the page-locking of
// the shared slots' mappings (declared in staging_ring.h and shared_slots.h). It is the memory side's CUDA
// half, not a dispatcher op, so it lives in memory/cuda/ rather than ops/cuda/. Only this file and the .cu
// files talk to CUDA directly, so the CPU build needs no toolkit.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>
#include <type_traits>

#include "memory/shared_slots.h"
#include "memory/staging_ring.h"

namespace fastcollate {

namespace {

// The device to make current for a runtime call (an OptionalCUDAGuard restores the previous one), so
// that the call creates no context on GPU 0 for a process that works on another GPU; -1: the current.
std::optional<c10::DeviceIndex> device_or_current(int64_t device) {
  return device < 0 ? std::nullopt : std::optional<c10::DeviceIndex>(static_cast<c10::DeviceIndex>(device));
}

// Runs a freeing call with `device` current. Frees run from deleters and destructors, on any thread
// (a finalizer, DataLoader's pin thread), possibly at exit: with no device current there, the runtime
// would make a context on GPU 0 for them. They must not throw: if the guard cannot be set (the runtime
// is shutting down), the call runs without it.
template <typename Call>
void on_device_noexcept(int64_t device, Call call) noexcept {
  try {
    const c10::cuda::OptionalCUDAGuard guard(device_or_current(device));
    call();
    return;
  } catch (...) {
  }
  call();
}

// A pinned allocation and the device whose context made it (the DataPtr's context).
struct PinnedBlock {
  void* ptr;
  int64_t device;
};

void free_pinned(void* context) {
  auto* block = static_cast<PinnedBlock*>(context);
  on_device_noexcept(block->device, [block] {
    if (cudaFreeHost(block->ptr) != cudaSuccess) {
      cudaGetLastError();  // at exit the runtime may be gone already; nothing to do then
    }
  });
  delete block;
}

}  // namespace

at::DataPtr allocate_host_memory(size_t bytes, bool pinned, int64_t device) {
  if (!pinned) {
    return allocate_aligned_host_memory(bytes);
  }
  const c10::cuda::OptionalCUDAGuard guard(device_or_current(device));
  void* ptr = nullptr;
  const cudaError_t status = cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
  if (status != cudaSuccess) {
    // Read the error back: left set, it would surface as a stale failure at the next kernel launch
    // check anywhere in the process.
    cudaGetLastError();
    TORCH_CHECK(false, "fastcollate: pinning ", bytes, " bytes of host memory failed (", cudaGetErrorString(status),
                "). Pinned memory is limited by RAM and the memlock limit (ulimit -l); lower DeviceLoader's depth "
                "or the batch size, or free pinned memory held elsewhere (e.g. DataLoader(pin_memory=True)).");
  }
  // The device current now (the guard's, or the caller's): freed with it current, whichever thread
  // drops the last reference.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  return at::DataPtr(ptr, new PinnedBlock{ptr, current}, &free_pinned, at::Device(at::kCPU));
}

bool pinned_memory_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls are not confused by it
    return false;
  }
  return count > 0;
}

PendingCopy record_on_stream(int64_t stream, int64_t device) {
  // An event must be made and recorded on its stream's device.
  const c10::cuda::OptionalCUDAGuard guard(device_or_current(device));
  cudaEvent_t raw = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  std::shared_ptr<std::remove_pointer_t<cudaEvent_t>> event(raw, [](cudaEvent_t e) { cudaEventDestroy(e); });
  C10_CUDA_CHECK(cudaEventRecord(event.get(), reinterpret_cast<cudaStream_t>(stream)));
  return PendingCopy{[event] {
                       const cudaError_t status = cudaEventQuery(event.get());
                       if (status == cudaErrorNotReady) {
                         cudaGetLastError();  // not-ready is not an error; don't leave it set
                         return false;
                       }
                       C10_CUDA_CHECK(status);
                       return true;
                     },
                     // Runs from the ring's destructor, possibly at exit: it must not throw.
                     [event] { cudaEventSynchronize(event.get()); }};
}

void register_host_memory(void* ptr, size_t bytes, int64_t device) {
  const c10::cuda::OptionalCUDAGuard guard(device_or_current(device));
  // Portable: pinned for every device's context, whichever GPU the copy is made to.
  const cudaError_t status = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (status != cudaSuccess) {
    cudaGetLastError();  // read back, so it does not surface at the next kernel launch check
    TORCH_CHECK(false, "fastcollate: page-locking a shared slot of ", bytes, " bytes failed (",
                cudaGetErrorString(status),
                "). Pinned memory is limited by RAM and the memlock limit (ulimit -l); "
                "lower max_shared_slots or the batch size, or set FASTCOLLATE_SHARED_SLOTS=0.");
  }
}

void unregister_host_memory(void* ptr, int64_t device) {
  on_device_noexcept(device, [ptr] {
    if (cudaHostUnregister(ptr) != cudaSuccess) {
      cudaGetLastError();  // at exit the runtime may be gone already; nothing to do then
    }
  });
}

int64_t built_cuda_version() {
  return CUDART_VERSION;
}

}  // namespace fastcollate
