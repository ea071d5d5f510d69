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
      .def_readonly("waits_for_copies", &fastcollate::RingStats::waits_for_copies)
      .def_readonly("in_use", &fastcollate::RingStats::in_use)
      .def_readonly("pinned", &fastcollate::RingStats::pinned);
  py::class_<fastcollate::HostRing>(m, "HostRing")
      .def(py::init<int64_t, bool>(), py::arg("max_slots"), py::arg("pinned"))
      .def("acquire", &fastcollate::HostRing::acquire, py::arg("nbytes"))
      .def(
          "pack",
          [](fastcollate::HostRing& ring, const std::vector<at::Tensor>& tensors) {
            py::gil_scoped_release no_gil;
            return ring.pack(tensors);
          },
          py::arg("tensors"))
      .def("owns", &fastcollate::HostRing::owns, py::arg("tensor"))
      .def(
          "hold_until_stream_done",
          [](fastcollate::HostRing& ring, const at::Tensor& buffer, int64_t stream) {
            return ring.hold_until(buffer, fastcollate::record_on_stream(stream));
          },
          py::arg("buffer"), py::arg("stream"),
          "Keeps the slot under `buffer` busy until the work queued so far on `stream` has finished")
      .def("trim", &fastcollate::HostRing::trim)
      .def("stats", &fastcollate::HostRing::stats);
}
