// Page-locked host memory for the staging ring, from the CUDA runtime. Only this file and the .cu files
// talk to CUDA directly, so the CPU build needs no toolkit.
#include <cuda_runtime_api.h>

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

}  // namespace fastcollate
