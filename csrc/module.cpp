// fastcollate._C: importing it registers the dispatcher ops (csrc/ops.cpp) and exposes the batch
// assembler and the host ring to the Python layer.
#include <torch/csrc/utils/pybind.h>

#include "batch_plan.h"
#include "host_ring.h"
#include "shared_slots.h"

namespace py = pybind11;

namespace {
const py::call_guard<py::gil_scoped_release> release_gil;
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcollate native core: batch assembly, host staging ring, dispatcher ops";
#ifdef FASTCOLLATE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("pinned_memory_available", &fastcollate::pinned_memory_available,
        "True when this build can pin memory and a CUDA device is present");
  m.attr("built_cuda_version") = fastcollate::built_cuda_version();
  fastcollate::bind_batch_plan(m);
  fastcollate::bind_shared_slots(m);

  py::class_<fastcollate::RingStats>(m, "RingStats")
      .def_readonly("slots", &fastcollate::RingStats::slots)
      .def_readonly("max_slots", &fastcollate::RingStats::max_slots)
      .def_readonly("bytes_held", &fastcollate::RingStats::bytes_held)
      .def_readonly("slot_allocations", &fastcollate::RingStats::slot_allocations)
      .def_readonly("regrowths", &fastcollate::RingStats::regrowths)
      .def_readonly("reuses", &fastcollate::RingStats::reuses)
      .def_readonly("overflow_allocations", &fastcollate::RingStats::overflow_allocations)
      .def_readonly("waits_for_copies", &fastcollate::RingStats::waits_for_copies)
      .def_readonly("in_use", &fastcollate::RingStats::in_use)
      .def_readonly("pinned", &fastcollate::RingStats::pinned);
  py::class_<fastcollate::CompletionFlag>(m, "CompletionFlag")
      .def(py::init<>())
      .def("set", &fastcollate::CompletionFlag::set)
      .def("is_set", &fastcollate::CompletionFlag::is_set);
  py::class_<fastcollate::HostRing>(m, "HostRing")
      .def(py::init<int64_t, bool, int64_t>(), py::arg("max_slots"), py::arg("pinned"), py::arg("device") = -1)
      // Every call that takes the ring's lock releases the GIL: acquire may wait there for a copy, and
      // whatever finishes that copy (a CUDA event; a CompletionFlag set from another Python thread)
      // must not wait for a GIL the waiting thread holds.
      .def("acquire", &fastcollate::HostRing::acquire, py::arg("nbytes"), release_gil)
      .def(
          "pack",
          [](fastcollate::HostRing& ring, const std::vector<at::Tensor>& tensors) {
            py::gil_scoped_release no_gil;
            return ring.pack(tensors);
          },
          py::arg("tensors"))
      .def("owns", &fastcollate::HostRing::owns, py::arg("tensor"), release_gil)
      .def(
          "hold_until_stream_done",
          [](fastcollate::HostRing& ring, const at::Tensor& buffer, int64_t stream, int64_t device) {
            return ring.hold_until(buffer, fastcollate::record_on_stream(stream, device));
          },
          py::arg("buffer"), py::arg("stream"), py::arg("device"), release_gil,
          "Keeps the slot under `buffer` busy until the work queued so far on `stream` (of CUDA device "
          "`device`) has finished")
      .def(
          "hold_until_flag",
          [](fastcollate::HostRing& ring, const at::Tensor& buffer, const fastcollate::CompletionFlag& flag) {
            return ring.hold_until(buffer, flag.pending());
          },
          py::arg("buffer"), py::arg("flag"), release_gil, "Keeps the slot under `buffer` busy until `flag` is set")
      .def("trim", &fastcollate::HostRing::trim, release_gil)
      .def("stats", &fastcollate::HostRing::stats, release_gil);
}
