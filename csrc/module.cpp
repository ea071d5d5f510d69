// fastcollate._C: importing it registers the dispatcher ops (csrc/ops.cpp) and exposes the batch
// assembler and the host ring to the Python layer.
#include <torch/csrc/utils/pybind.h>

#include "batch_plan.h"
#include "host_ring.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcollate native core: batch assembly, host staging ring, dispatcher ops";
#ifdef FASTCOLLATE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("pinned_memory_available", &fastcollate::pinned_memory_available,
        "True when this build can pin memory and a CUDA device is present");
  fastcollate::bind_batch_plan(m);

  py::class_<fastcollate::RingStats>(m, "RingStats")
      .def_readonly("slots", &fastcollate::RingStats::slots)
      .def_readonly("max_slots", &fastcollate::RingStats::max_slots)
      .def_readonly("bytes_held", &fastcollate::RingStats::bytes_held)
      .def_readonly("slot_allocations", &fastcollate::RingStats::slot_allocations)
      .def_readonly("reuses", &fastcollate::RingStats::reuses)
      .def_readonly("overflow_allocations", &fastcollate::RingStats::overflow_allocations)
      .def_readonly("in_use", &fastcollate::RingStats::in_use)
      .def_readonly("pinned", &fastcollate::RingStats::pinned);
  py::class_<fastcollate::HostRing>(m, "HostRing")
      .def(py::init<int64_t, bool>(), py::arg("max_slots"), py::arg("pinned"))
      .def("acquire", &fastcollate::HostRing::acquire, py::arg("nbytes"))
      .def("trim", &fastcollate::HostRing::trim)
      .def("stats", &fastcollate::HostRing::stats);
}
