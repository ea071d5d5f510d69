// Byte-moving kernels: the only code that touches batch memory, run with the GIL released.
#include "memory/copy_kernels.h"

#include "memory/mapped_reads.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define FASTCOLLATE_STREAMING_STORES 1
#endif

namespace fastcollate {

namespace {

// Below this many bytes a batch is copied on the calling thread: waking workers costs more.
constexpr size_t kParallelThresholdBytes = 1 << 20;
// Large samples are split so that, say, 4 huge images still keep every thread busy.
constexpr size_t kChunkBytes = 1 << 20;
// How many rows ahead a row's first line is prefetched.
constexpr size_t kRowPrefetchAhead = 8;
// From this many bytes a batch is written with non-temporal (streaming) stores: it cannot stay in the
// caches anyway, and plain stores would first read every destination line from memory (a third more
// traffic). Measured on the development VM: a 38.5 MB batch of 150 KB rows, 4.0 -> 2.9 ms on one thread.
constexpr size_t kStreamingThresholdBytes = 8 << 20;
// Rows shorter than this are left to memcpy even then: there is too little to gain per call.
constexpr size_t kStreamingMinRowBytes = 4 << 10;

// memcpy, or with `streaming` a copy whose stores bypass the caches. Call finish_streaming() on the same
// thread before the data is handed on: streaming stores are not ordered with the thread's other stores.
void copy_bytes(void* dst, const void* src, size_t n, bool streaming) {
#ifdef FASTCOLLATE_STREAMING_STORES
  if (streaming && n >= kStreamingMinRowBytes) {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;  // _mm_stream_si128 wants 16
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    std::memcpy(d, s, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void finish_streaming(bool streaming) {
#ifdef FASTCOLLATE_STREAMING_STORES
  if (streaming) {
    _mm_sfence();
  }
#endif
}

// `count` copies of the low sizeof(Element) bytes of `pattern`. The size is a constant here, so each
// memcpy is one store, not a call per element. Measured on the int64 attention_mask of 256 BERT-style
// pairs (benchmarks/collate_cases.py hf_padded, warm, one thread): 0.38 -> 0.22 ms a batch (bool: 0.18).
template <typename Element>
void fill_elements(unsigned char* dst, size_t count, uint64_t pattern) {
  Element element;
  std::memcpy(&element, &pattern, sizeof(Element));
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * sizeof(Element), &element, sizeof(Element));
  }
}

void run_fill(const FillJob& job) {
  auto* dst = static_cast<unsigned char*>(job.dst);
  if (job.element_size == 1) {
    std::memset(dst, static_cast<int>(job.pattern & 0xff), job.count);
    return;
  }
  if (job.pattern == 0) {
    std::memset(dst, 0, job.count * job.element_size);
    return;
  }
  switch (job.element_size) {
    case 2:
      fill_elements<uint16_t>(dst, job.count, job.pattern);
      return;
    case 4:
      fill_elements<uint32_t>(dst, job.count, job.pattern);
      return;
    case 8:
      fill_elements<uint64_t>(dst, job.count, job.pattern);
      return;
    default:
      for (size_t i = 0; i < job.count; ++i) {
        std::memcpy(dst + i * job.element_size, &job.pattern, job.element_size);
      }
  }
}

// Copies rows [begin, end) of a rows job, each split into `pieces` equal parts (so that a few huge rows
// still spread over threads): unit u is piece u % pieces of row u / pieces. kWholeRows: pieces is 1, known
// here, so the piece arithmetic folds away: a batch of small fields is thousands of rows of a few bytes,
// and for 256 samples of 16 float32[8] fields that arithmetic and the reloads of job's fields are 17 of 37
// instructions a row besides the memcpy (callgrind).
template <bool kWholeRows>
void copy_row_units(const RowsJob& job, size_t pieces, size_t begin, size_t end, bool streaming) {
  if constexpr (kWholeRows) {
    pieces = 1;
  }
  // Locals: the copies may write anywhere, job's fields too as far as the compiler knows, so read through
  // job they would be loaded again after every row.
  const void* const* const sources = job.sources;
  unsigned char* const dst = job.dst;
  const size_t row_bytes = job.row_bytes;
  const size_t count = job.count;
  const size_t piece_bytes = (row_bytes + pieces - 1) / pieces;
  size_t row = begin / pieces;
  size_t part = begin % pieces;  // stepped below: no division per unit
  for (size_t unit = begin; unit < end; ++unit) {
    // Rows of small fields lie scattered over the heap, each a cache miss of its own: ask for a later
    // one's first line now (the hardware prefetcher follows a row once it has started).
    if (part == 0 && row + kRowPrefetchAhead < count && sources[row + kRowPrefetchAhead] != nullptr) {
      __builtin_prefetch(sources[row + kRowPrefetchAhead]);
    }
    if (const void* source = sources[row]) {
      const size_t offset = part * piece_bytes;
      const size_t n = std::min(piece_bytes, row_bytes - offset);
      copy_bytes(dst + row * row_bytes + offset, static_cast<const unsigned char*>(source) + offset, n, streaming);
    }
    if (++part == pieces) {
      part = 0;
      ++row;
    }
  }
}

void run_row_units(const RowsJob& job, size_t pieces, size_t begin, size_t end, bool streaming) {
  if (pieces == 1) {
    copy_row_units<true>(job, 1, begin, end, streaming);
  } else {
    copy_row_units<false>(job, pieces, begin, end, streaming);
  }
}

size_t pieces_per_row(const RowsJob& job) {
  return std::max<size_t>(1, job.row_bytes / kChunkBytes);
}

void run_count(const CountJob& job) {
  // Locals: through job, each store to an int64 could alias job.start or job.count (both int64-sized), so
  // the loop would reload them and not vectorise (measured: 177 -> ~25 us for 270k position ids).
  int64_t* const dst = job.dst;
  const int64_t start = job.start;
  const size_t count = job.count;
  for (size_t i = 0; i < count; ++i) {
    dst[i] = start + static_cast<int64_t>(i);
  }
}

// Fills and counts, before the copies (which may overwrite part of a fill). A packed batch writes as many
// bytes here as it copies (its position ids and seq_idx): large ones spread over the threads too.
void run_fills_and_counts(const std::vector<FillJob>& fills, const std::vector<CountJob>& counts) {
  size_t bytes = 0;
  for (const auto& job : fills) {
    bytes += job.count * job.element_size;
  }
  for (const auto& job : counts) {
    bytes += job.count * sizeof(int64_t);
  }
  const size_t units = fills.size() + counts.size();
  auto run_units = [&](size_t begin, size_t end) {
    for (size_t unit = begin; unit < end; ++unit) {
      if (unit < fills.size()) {
        run_fill(fills[unit]);
      } else {
        run_count(counts[unit - fills.size()]);
      }
    }
  };
  if (bytes < kParallelThresholdBytes || at::get_num_threads() <= 1) {
    run_units(0, units);
    return;
  }
  const size_t average = std::max<size_t>(1, bytes / std::max<size_t>(1, units));
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / average));
  at::parallel_for(0, static_cast<int64_t>(units), grain, [&](int64_t begin, int64_t end) {
    run_units(static_cast<size_t>(begin), static_cast<size_t>(end));
  });
}

}  // namespace

void CopyJobs::add_rows(const void* const* sources, void* dst, size_t row_bytes, size_t count) {
  rows.push_back({sources, static_cast<unsigned char*>(dst), row_bytes, count});
  bytes += row_bytes * count;
}

void CopyJobs::add_memcpy(const void* src, void* dst, size_t n) {
  bytes += n;
  auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  while (n > kChunkBytes * 3 / 2) {
    memcpys.push_back({s, d, kChunkBytes});
    s += kChunkBytes;
    d += kChunkBytes;
    n -= kChunkBytes;
  }
  if (n > 0) {
    memcpys.push_back({s, d, n});
  }
}

void CopyJobs::run() const {
  if (!memcpys.empty() || !rows.empty()) {  // only these read sources (fills and counts write constants)
    arm_mapped_read_guard();
  }
  run_fills_and_counts(fills, counts);
  const bool streaming = bytes >= kStreamingThresholdBytes;
  if (bytes < kParallelThresholdBytes || at::get_num_threads() <= 1) {
    guard_mapped_reads([&] {
      for (const auto& job : memcpys) {
        copy_bytes(job.dst, job.src, job.bytes, streaming);
      }
      for (const auto& job : rows) {
        run_row_units(job, /*pieces=*/1, 0, job.count, streaming);
      }
    });
    finish_streaming(streaming);
  } else {
    // Every memcpy and every piece of a row is a unit of work, numbered across jobs; the grain is about
    // kChunkBytes of work per task, whatever the sample size.
    std::vector<size_t> first_unit(rows.size() + 1, memcpys.size());
    for (size_t j = 0; j < rows.size(); ++j) {
      first_unit[j + 1] = first_unit[j] + rows[j].count * pieces_per_row(rows[j]);
    }
    const size_t units = first_unit.back();
    const size_t average = std::max<size_t>(1, bytes / std::max<size_t>(1, units));
    const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / average));
    at::parallel_for(0, static_cast<int64_t>(units), grain, [&](int64_t begin64, int64_t end64) {
      guard_mapped_reads([&] {
        size_t begin = static_cast<size_t>(begin64);
        const size_t end = static_cast<size_t>(end64);
        for (; begin < end && begin < memcpys.size(); ++begin) {
          copy_bytes(memcpys[begin].dst, memcpys[begin].src, memcpys[begin].bytes, streaming);
        }
        // The rows job holding unit `begin`, then on through the following ones.
        size_t j =
            static_cast<size_t>(std::upper_bound(first_unit.begin(), first_unit.end(), begin) - first_unit.begin());
        for (; begin < end; ++j) {
          const size_t job_end = std::min(end, first_unit[j]);
          const size_t pieces = pieces_per_row(rows[j - 1]);
          run_row_units(rows[j - 1], pieces, begin - first_unit[j - 1], job_end - first_unit[j - 1], streaming);
          begin = job_end;
        }
      });
      finish_streaming(streaming);
    });
  }
  for (const auto& job : tensor_copies) {
    // copy_ broadcasts and casts; it parallelises internally when it is worth it. Its reads are not
    // guarded (ATen's frames cannot be left by a jump): a mapped source is checked before, not during.
    const_cast<at::Tensor&>(job.dst).copy_(job.src);
  }
}

uint64_t element_pattern(const at::Scalar& value, at::ScalarType dtype) {
  TORCH_CHECK(c10::elementSize(dtype) <= 8, "fastcollate: padding dtype ", dtype, " has elements over 8 bytes");
  uint64_t pattern = 0;
  // Converted as torch.full((), value) converts it, but with no tensor and no dispatcher call: this runs for
  // every batch, and a cold dispatcher call costs more than a small batch's copies. torch checks the value
  // against the dtype (300 is no int8, -1 is 255 in uint8), except that float16, bfloat16 and float8 (the
  // dtypes computed in float) take any double, out of range as inf or their largest value.
  AT_DISPATCH_V2(dtype, "element_pattern", AT_WRAP([&] {
                   scalar_t element;
                   if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float> && !std::is_same_v<scalar_t, float>) {
                     const double wide = value.to<double>();
                     const bool beyond_float = std::abs(wide) > std::numeric_limits<float>::max();  // not NaN
                     element = static_cast<scalar_t>(beyond_float
                                                         ? std::copysign(std::numeric_limits<float>::infinity(), wide)
                                                         : static_cast<float>(wide));
                   } else {
                     element = value.to<scalar_t>();
                   }
                   std::memcpy(&pattern, &element, sizeof(scalar_t));
                 }),
                 AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16, at::kComplexHalf, at::kComplexFloat,
                 AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES), AT_EXPAND(AT_FLOAT8_TYPES));
  return pattern;
}

std::vector<at::Tensor> guarded_copies(const std::vector<at::Tensor>& sources) {
  std::vector<at::Tensor> copies;
  copies.reserve(sources.size());
  CopyJobs jobs;
  for (const at::Tensor& source : sources) {
    TORCH_CHECK(source.device().is_cpu() && copyable_as_is(source),
                "guarded_copies: each source must be a contiguous CPU tensor, got one of shape ", source.sizes(),
                " and strides ", source.strides(), " on ", source.device());
    at::Tensor copy = at::empty(source.sizes(), source.options());
    if (source.nbytes() > 0) {
      jobs.add_memcpy(source.const_data_ptr(), copy.mutable_data_ptr(), source.nbytes());
    }
    copies.push_back(std::move(copy));
  }
  jobs.run();
  return copies;
}

}  // namespace fastcollate
