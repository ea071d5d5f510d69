// fastcollate._C: importing it registers the dispatcher ops (csrc/ops.cpp, csrc/cpu/, csrc/cuda/) and
// exposes the batch assembler, the staging ring and the shared slots to the Python layer. Each piece
// binds itself.
#include <torch/csrc/utils/pybind.h>

#include "memory/bindings.h"
#include "memory/mapped_reads.h"
#include "plan.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcollate native core: batch assembly, host staging ring, dispatcher ops";
  fastcollate::bind_build_info(m);
  fastcollate::bind_batch_plan(m);
  m.attr("MAPPED_READ_FAULT") = fastcollate::kMappedReadFault;
  fastcollate::bind_staging_ring(m);
  fastcollate::bind_shared_slots(m);
}
