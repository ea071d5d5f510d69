#include "memory/bindings.h"

#include <vector>

#include "memory/shared_slots.h"
#include "memory/staging_ring.h"

namespace fastcollate {

namespace py = pybind11;

namespace {
const py::call_guard<py::gil_scoped_release> release_gil;
}  // namespace

void bind_build_info(py::module_& m) {
#ifdef FASTCOLLATE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("pinned_memory_available", &pinned_memory_available,
        "True when this build can pin memory and a CUDA device is present");
  m.attr("built_cuda_version") = built_cuda_version();
}

void bind_staging_ring(py::module_& m) {
  py::class_<RingStats> stats(m, "RingStats");
  py::list fields;  // (name, C++ type, what it counts): fastcollate.staging builds its RingStats from it
#define FASTCOLLATE_BIND_RING_STATS_FIELD(type, name, what) \
  stats.def_readonly(#name, &RingStats::name, what);        \
  fields.append(py::make_tuple(#name, #type, what));
  FASTCOLLATE_RING_STATS_FIELDS(FASTCOLLATE_BIND_RING_STATS_FIELD)
#undef FASTCOLLATE_BIND_RING_STATS_FIELD
  stats.attr("fields") = py::tuple(fields);

  py::class_<CompletionFlag>(m, "CompletionFlag")
      .def(py::init<>())
      .def("set", &CompletionFlag::set)
      .def("is_set", &CompletionFlag::is_set);
  py::class_<StagingRing>(m, "StagingRing")
      .def(py::init<int64_t, bool, int64_t>(), py::arg("max_slots"), py::arg("pinned"), py::arg("device") = -1)
      // Every call that takes the ring's lock releases the GIL: acquire may wait there for a copy, and
      // whatever finishes that copy (a CUDA event; a CompletionFlag set from another Python thread)
      // must not wait for a GIL the waiting thread holds.
      .def("acquire", &StagingRing::acquire, py::arg("nbytes"), release_gil)
      .def(
          "pack",
          [](StagingRing& ring, const std::vector<at::Tensor>& tensors) {
            py::gil_scoped_release no_gil;
            return ring.pack(tensors);
          },
          py::arg("tensors"))
      .def("owns", &StagingRing::owns, py::arg("tensor"), release_gil)
      .def(
          "hold_until_stream_done",
          [](StagingRing& ring, const at::Tensor& buffer, int64_t stream, int64_t device) {
            return ring.hold_until_done(buffer, record_on_stream(stream, device));
          },
          py::arg("buffer"), py::arg("stream"), py::arg("device"), release_gil,
          "Keeps the slot under `buffer` busy until the work queued so far on `stream` (of CUDA device "
          "`device`) has finished")
      .def(
          "hold_until_flag_set",
          [](StagingRing& ring, const at::Tensor& buffer, const CompletionFlag& flag) {
            return ring.hold_until_done(buffer, flag.pending());
          },
          py::arg("buffer"), py::arg("flag"), release_gil, "Keeps the slot under `buffer` busy until `flag` is set")
      .def("trim", &StagingRing::trim, release_gil)
      .def("stats", &StagingRing::stats, release_gil);
}

void bind_shared_slots(py::module_& m) {
  using Stats = SharedSlotStats;
  py::class_<Stats>(m, "SharedSlotStats")
      .def_readonly("capacity", &Stats::capacity)
      .def_readonly("free", &Stats::free)
      .def_readonly("writing", &Stats::writing)
      .def_readonly("delivered", &Stats::delivered)
      .def_readonly("lent", &Stats::lent)
      .def_readonly("kept_by_writers", &Stats::kept_by_writers)
      .def_readonly("slots_used", &Stats::slots_used)
      .def_readonly("bytes_held", &Stats::bytes_held)
      .def_readonly("file_bytes", &Stats::file_bytes)
      .def_readonly("claims", &Stats::claims)
      .def_readonly("fresh_fallbacks", &Stats::fresh_fallbacks)
      .def_readonly("reclaimed", &Stats::reclaimed)
      .def_readonly("receipts", &Stats::receipts)
      .def_readonly("mappings", &Stats::mappings)
      .def_readonly("registrations", &Stats::registrations)
      .def_readonly("registration_failures", &Stats::registration_failures)
      .def_readonly("registered_bytes", &Stats::registered_bytes);
  py::class_<SharedSlots, std::shared_ptr<SharedSlots>>(m, "SharedSlots")
      .def_static("create", &SharedSlots::create, py::arg("capacity"))
      .def_static("attach", &SharedSlots::attach, py::arg("fd"), "Takes over `fd`")
      .def_property_readonly("fd", &SharedSlots::fd)
      .def_property_readonly("token", [](const SharedSlots& pool) { return static_cast<int64_t>(pool.token()); })
      .def_property_readonly("owner_pid", &SharedSlots::owner_pid)
      .def_property_readonly("capacity", &SharedSlots::capacity)
      .def(
          "claim",
          [](SharedSlots& pool, int64_t nbytes, int64_t bound) -> py::object {
            at::Tensor buffer;
            ClaimRefusal refusal;
            {
              py::gil_scoped_release no_gil;  // the first claim of a slot maps and faults in its pages
              buffer = pool.claim(nbytes, bound, refusal);
            }
            return py::make_tuple(buffer.defined() ? py::cast(buffer) : py::none(), refusal.cause, refusal.detail);
          },
          py::arg("nbytes"), py::arg("bound"))
      .def("count_fresh_fallback", &SharedSlots::count_fresh_fallback)
      .def("undeliver", &SharedSlots::undeliver, py::arg("slot"), py::arg("seq"))
      .def(
          "receive",
          [](SharedSlots& pool, int64_t slot, int64_t seq, int64_t nbytes, at::ScalarType dtype, int64_t offset,
             const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
             int64_t pin_device) { return pool.receive(slot, seq, nbytes, dtype, offset, sizes, strides, pin_device); },
          py::arg("slot"), py::arg("seq"), py::arg("nbytes"), py::arg("dtype"), py::arg("offset"), py::arg("sizes"),
          py::arg("strides"), py::arg("pin_device"), release_gil)
      .def("reclaim_dead_writers", &SharedSlots::reclaim_dead_writers, release_gil)
      .def("stats", &SharedSlots::stats, release_gil)
      .def_property_readonly("registration_failures", &SharedSlots::registration_failures)
      .def("describe_slot", &SharedSlots::describe_slot, py::arg("slot"));
  // Plain ints, so that Python compares them with ==, as it did the numbers they name.
  m.attr("SLOT_KIND_NONE") = static_cast<int64_t>(SlotKind::kNone);
  m.attr("SLOT_KIND_WRITING") = static_cast<int64_t>(SlotKind::kWriting);
  m.attr("SLOT_KIND_RECEIVED") = static_cast<int64_t>(SlotKind::kReceived);
  m.attr("SLOT_KIND_PAGE_LOCKED") = static_cast<int64_t>(SlotKind::kPageLocked);
  m.def(
      "shared_slot_kind", [](const at::Tensor& tensor) { return static_cast<int64_t>(shared_slot_kind(tensor)); },
      py::arg("tensor"),
      "SLOT_KIND_NONE: not a shared slot; SLOT_KIND_WRITING: a worker's view of the slot it writes; "
      "SLOT_KIND_RECEIVED: a batch received from a worker; SLOT_KIND_PAGE_LOCKED: the same, page-locked");
  m.def("deliver_slot_tensor", &deliver_slot_tensor, py::arg("tensor"));
}

}  // namespace fastcollate
