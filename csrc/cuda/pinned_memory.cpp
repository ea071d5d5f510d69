// Page-locked host memory for the staging ring, from the CUDA runtime. Only this file and the .cu files
// talk to CUDA directly, so the CPU build needs no toolkit.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <type_traits>

#include "host_ring.h"

namespace fastcollate {

namespace {

void free_pinned(void* ptr) {
  cudaFreeHost(ptr);
}

}  // namespace

at::DataPtr allocate_host_memory(size_t bytes, bool pinned) {
  if (!pinned) {
    return allocate_aligned_host_memory(bytes);
  }
  void* ptr = nullptr;
  const cudaError_t status = cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
  TORCH_CHECK(status == cudaSuccess, "fastcollate: cudaHostAlloc of ", bytes, " bytes failed: ",
              cudaGetErrorString(status));
  return at::DataPtr(ptr, ptr, &free_pinned, at::Device(at::kCPU));
}

bool pinned_memory_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls are not confused by it
    return false;
  }
  return count > 0;
}

PendingCopy record_on_stream(int64_t stream) {
  cudaEvent_t raw = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  std::shared_ptr<std::remove_pointer_t<cudaEvent_t>> event(raw, [](cudaEvent_t e) { cudaEventDestroy(e); });
  C10_CUDA_CHECK(cudaEventRecord(event.get(), reinterpret_cast<cudaStream_t>(stream)));
  return PendingCopy{
      [event] {
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

}  // namespace fastcollate
