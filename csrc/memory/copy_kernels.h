// Byte-moving kernels shared by the dispatcher ops (csrc/ops/cpu/), the batch assembler's walk and the staging
// ring: plain jobs that run with the GIL released, split across torch's intra-op threads when the batch is large
// enough to pay for it. They sit with the memory side, below both ops/ and the collate files, because every
// one of those moves bytes through them (and their reads from mapped files go through mapped_reads.h).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastcollate {

// Every field of a batch starts at a multiple of this many bytes inside its buffer, so each view is
// aligned for any dtype and for vectorised copies, and a whole batch can still move as one block.
constexpr size_t kFieldAlignment = 64;

inline size_t align_up(size_t n) {
  return (n + kFieldAlignment - 1) / kFieldAlignment * kFieldAlignment;
}

// Whether a tensor's bytes are its values in row-major order, so that a memcpy copies it: contiguous, and
// no lazy conjugate or negative bit that a copy would have to apply.
inline bool copyable_as_is(const at::Tensor& tensor) {
  return tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg();
}

// One contiguous source range to one contiguous destination range.
struct MemcpyJob {
  const void* src;
  void* dst;
  size_t bytes;
};

// `count` rows of `row_bytes` laid out back to back at dst, row i copied from sources[i]; a null source
// is a row some other job fills. The sources array must outlive run().
struct RowsJob {
  const void* const* sources;
  unsigned char* dst;
  size_t row_bytes;
  size_t count;
};

// Fills `count` elements of `element_size` bytes at dst with one element's byte pattern.
struct FillJob {
  void* dst;
  size_t count;
  size_t element_size;
  uint64_t pattern;  // the element's bytes (element_size <= 8)
};

// Writes start, start + 1, ... into `count` int64 elements at dst (a packed batch's position ids).
struct CountJob {
  int64_t* dst;
  size_t count;
  int64_t start;
};

// A copy that needs ATen: non-contiguous or channels-last input, a declared cast, a declared broadcast.
struct TensorCopyJob {
  at::Tensor src;
  at::Tensor dst;
};

// The copies that fill one batch. Run order: fills and counts, then memcpys and tensor copies (which may
// overwrite part of a fill, as padded rows do).
struct CopyJobs {
  std::vector<FillJob> fills;
  std::vector<CountJob> counts;
  std::vector<MemcpyJob> memcpys;
  std::vector<RowsJob> rows;
  std::vector<TensorCopyJob> tensor_copies;
  size_t bytes = 0;

  // Adds a memcpy, split into chunks so a few huge samples still spread over threads.
  void add_memcpy(const void* src, void* dst, size_t bytes);
  // Adds the rows of one stacked field (see RowsJob).
  void add_rows(const void* const* sources, void* dst, size_t row_bytes, size_t count);
  // Runs every job. Call without the GIL: it touches no Python object.
  void run() const;
  bool empty() const {
    return fills.empty() && counts.empty() && memcpys.empty() && rows.empty() && tensor_copies.empty();
  }
};

// The bytes of `value` converted to `dtype`, for FillJob::pattern.
uint64_t element_pattern(const at::Scalar& value, at::ScalarType dtype);

// Copies of `sources` (each contiguous, on the CPU) in fresh memory, read under the mapped-read guard: the
// rows a dataset hands out one sample at a time lie in files that may shrink while they are copied, and a
// read past a file's new end must be an error, not SIGBUS. Call without the GIL.
std::vector<at::Tensor> guarded_copies(const std::vector<at::Tensor>& sources);

}  // namespace fastcollate
