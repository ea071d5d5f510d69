// fastcollate._C, the one file of pybind code: importing the module registers the dispatcher ops
// (ops/ops.cpp, ops/cpu/, ops/cuda/) and exposes the batch assembler (collate/), the staging ring and the
// shared slots (memory/) to the Python layer. The files it binds hold no pybind of their own.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collate/arrow_gather.h"
#include "collate/batch_indices.h"
#include "collate/collator.h"
#include "collate/column_gather.h"
#include "collate/contract_fields.h"
#include "collate/contract_rules.h"
#include "collate/field_spec.h"
#include "collate/node.h"
#include "collate/plan.h"
#include "fill/gather_kernels.h"
#include "memory/copy_kernels.h"
#include "memory/mapped_reads.h"
#include "memory/shared_slots.h"
#include "memory/staging_ring.h"

namespace fastcollate {

namespace py = pybind11;

namespace {

const py::call_guard<py::gil_scoped_release> release_gil;

// The names fastcollate.contract.Field.kind takes.
constexpr std::pair<FieldKind, const char*> kKindNames[] = {
    {FieldKind::Tensor, "tensor"},
    {FieldKind::Number, "number"},
    {FieldKind::Text, "text"},
};

const char* kind_name(FieldKind kind) {
  for (const auto& [each, name] : kKindNames) {
    if (each == kind) {
      return name;
    }
  }
  return "tensor";
}

FieldKind kind_from_name(const std::string& name) {
  for (const auto& [kind, each] : kKindNames) {
    if (name == each) {
      return kind;
    }
  }
  TORCH_CHECK(false, "FieldSpec.kind must be 'tensor', 'number' or 'text', got '", name, "'");
}

// has_<value> = True declares the value with `placeholder` until it is set; False drops it.
template <typename T>
void declare(std::optional<T>& value, bool declared, T placeholder) {
  if (!declared) {
    value.reset();
  } else if (!value) {
    value = placeholder;
  }
}

// ---- the memory side: build facts, the staging ring, the shared slots ----

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
      .def_readonly("registered_bytes", &Stats::registered_bytes)
      .def_readonly("loaders", &Stats::loaders)
      .def_readonly("bound", &Stats::bound);
  py::class_<SharedSlots, std::shared_ptr<SharedSlots>>(m, "SharedSlots")
      .def_static("create", &SharedSlots::create, py::arg("capacity"))
      .def_static("attach", &SharedSlots::attach, py::arg("fd"), "Takes over `fd`")
      .def_property_readonly("fd", &SharedSlots::fd)
      .def_property_readonly("token", [](const SharedSlots& pool) { return static_cast<int64_t>(pool.token()); })
      .def_property_readonly("owner_pid", &SharedSlots::owner_pid)
      .def_property_readonly("capacity", &SharedSlots::capacity)
      .def(
          "claim",
          [](SharedSlots& pool, int64_t nbytes, int64_t bound, uint64_t loader, int64_t loader_workers) -> py::object {
            at::Tensor buffer;
            ClaimRefusal refusal;
            {
              py::gil_scoped_release no_gil;  // the first claim of a slot maps and faults in its pages
              buffer = pool.claim(nbytes, bound, loader, loader_workers, refusal);
            }
            return py::make_tuple(buffer.defined() ? py::cast(buffer) : py::none(), refusal.cause, refusal.detail);
          },
          py::arg("nbytes"), py::arg("bound"), py::arg("loader") = 0, py::arg("loader_workers") = 0)
      .def("count_fresh_fallback", &SharedSlots::count_fresh_fallback)
      .def(
          "written_fields",
          [](SharedSlots& pool) {
            py::dict out;
            for (const auto& [where, fields] : pool.written_fields()) {
              py::list listed;
              for (const auto& field : fields) {
                listed.append(py::make_tuple(field.offset, field.nbytes, field.key));
              }
              out[py::make_tuple(where.first, where.second)] = listed;
            }
            return out;
          },
          "{(slot, sequence number): [(offset, nbytes, key), ...]}: the fields of this process's last write "
          "into each slot")
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
  m.def(
      "received_slot_of",
      [](const at::Tensor& tensor) -> py::object {
        const std::vector<int64_t> where = received_slot_of(tensor);
        return where.empty() ? py::object(py::none()) : py::object(py::make_tuple(where[0], where[1], where[2]));
      },
      py::arg("tensor"), "(pool token, slot, sequence number) of a tensor received over a slot; None for any other");
}

// ---- the collate side: contract fields, plans, the walk's collator, the column gather ----

// _C.FieldSpec. Its Python attributes are those contract.py has always set (kind as a string, has_dtype
// and dtype, has_shape and shape, has_range with low and high, padded and pad_value): setting a value
// declares it, has_* = False drops it.
void bind_field_spec(py::module_& m) {
  py::class_<FieldSpec>(m, "FieldSpec")
      .def(py::init<>())
      .def_readwrite("path", &FieldSpec::path)
      .def_property(
          "kind", [](const FieldSpec& spec) { return kind_name(spec.kind); },
          [](FieldSpec& spec, const std::string& name) { spec.kind = kind_from_name(name); })
      .def_property(
          "has_dtype", [](const FieldSpec& spec) { return spec.dtype.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.dtype, declared, at::kFloat); })
      .def_property(
          "dtype", [](const FieldSpec& spec) { return spec.dtype.value_or(at::kFloat); },
          [](FieldSpec& spec, at::ScalarType dtype) { spec.dtype = dtype; })
      .def_readwrite("cast_from", &FieldSpec::cast_from)
      .def_property(
          "has_shape", [](const FieldSpec& spec) { return spec.shape.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.shape, declared, std::vector<int64_t>{}); })
      .def_property(
          "shape", [](const FieldSpec& spec) { return spec.shape.value_or(std::vector<int64_t>{}); },
          [](FieldSpec& spec, std::vector<int64_t> shape) { spec.shape = std::move(shape); })
      .def_readwrite("dim_names", &FieldSpec::dim_names)
      .def_readwrite("expand_from", &FieldSpec::expand_from)
      .def_property(
          "has_range", [](const FieldSpec& spec) { return spec.range.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.range, declared, ValueRange{}); })
      .def_property(
          "low", [](const FieldSpec& spec) { return spec.range.value_or(ValueRange{}).low; },
          [](FieldSpec& spec, double low) { spec.range = ValueRange{low, spec.range.value_or(ValueRange{}).high}; })
      .def_property(
          "high", [](const FieldSpec& spec) { return spec.range.value_or(ValueRange{}).high; },
          [](FieldSpec& spec, double high) { spec.range = ValueRange{spec.range.value_or(ValueRange{}).low, high}; })
      .def_property(
          "padded", [](const FieldSpec& spec) { return spec.padded(); },
          [](FieldSpec& spec, bool padded) { declare(spec.pad_value, padded, 0.0); })
      .def_property(
          "pad_value", [](const FieldSpec& spec) { return spec.pad_value.value_or(0.0); },
          [](FieldSpec& spec, double value) { spec.pad_value = value; })
      .def_readwrite("mask_name", &FieldSpec::mask_name)
      .def_readwrite("mask_dtype", &FieldSpec::mask_dtype)
      .def_readwrite("lengths_name", &FieldSpec::lengths_name)
      .def_readwrite("pad_to_multiple_of", &FieldSpec::pad_to_multiple_of)
      .def_readwrite("pad_left", &FieldSpec::pad_left)
      .def_readwrite("packed", &FieldSpec::packed)
      .def_property(
          "has_separator", [](const FieldSpec& spec) { return spec.separator.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.separator, declared, 0.0); })
      .def_property(
          "separator", [](const FieldSpec& spec) { return spec.separator.value_or(0.0); },
          [](FieldSpec& spec, double value) { spec.separator = value; })
      .def_readwrite("position_ids_name", &FieldSpec::position_ids_name)
      .def_readwrite("position_ids_start", &FieldSpec::position_ids_start)
      .def_readwrite("cu_seq_lens_names", &FieldSpec::cu_seq_lens_names)
      .def_readwrite("max_length_names", &FieldSpec::max_length_names)
      .def_readwrite("seq_idx_name", &FieldSpec::seq_idx_name)
      .def_readwrite("max_tokens", &FieldSpec::max_tokens)
      .def_readwrite("drop_names", &FieldSpec::drop_names)
      .def_readwrite("copy_of", &FieldSpec::copy_of);
}

void bind_contract_rules(py::module_& m) {
  m.def(
      "orders", [](at::ScalarType dtype) { return !range_dtype_rule(dtype).has_value(); }, py::arg("dtype"),
      "Whether dtype's values have an order, as a range needs.");
  m.attr("POSITION_IDS_START_BOUND") = kPositionStartBound;
  m.def(
      "value_fits", [](double value, at::ScalarType dtype) { return value_fits(value, dtype); }, py::arg("value"),
      py::arg("dtype"), "Whether value is one of dtype's (the rule for pad values and separators).");
  m.def(
      "keeps_values", [](at::ScalarType source, at::ScalarType target) { return keeps_values(source, target); },
      py::arg("source"), py::arg("target"),
      "Whether casting source to target keeps every value (a range checked after the cast holds for the source).");
  m.def(
      "check_contract", [](std::vector<FieldSpec> fields) { ContractFields("", std::move(fields), true); },
      py::arg("fields"),
      "Raises ValueError when the fields break a rule between fields (a shared mask, a copy, a dropped key).");
}

void bind_batch_plan(py::module_& m) {
  m.attr("SMALL_FIELD_BYTES") = kSmallFieldBytes;
  m.attr("FIELD_ALIGNMENT") = kFieldAlignment;
  m.attr("LARGE_BATCH_BYTES") = kLargeBatchBytes;
  py::class_<BatchPlan, std::shared_ptr<BatchPlan>>(m, "BatchPlan")
      .def_property_readonly("nbytes", &BatchPlan::nbytes)
      .def_property_readonly("views", &BatchPlan::views)
      .def_property_readonly("failed_key", [](const BatchPlan& plan) { return plan.failed_key; })
      .def_property_readonly("overflowed_ring", &BatchPlan::overflowed_ring)
      .def("execute", &BatchPlan::execute, py::arg("buffer"), py::arg("small_fields_apart") = true)
      .def("execute_in_ring", &BatchPlan::execute_in_ring, py::arg("ring"), py::arg("small_fields_apart") = true);
  py::class_<Collator>(m, "Collator")
      .def(py::init<std::string, std::vector<FieldSpec>, bool>(), py::arg("id_key"), py::arg("fields"),
           py::arg("has_contract"))
      .def("plan", &Collator::plan, py::arg("samples"));
}

void bind_column_gather(py::module_& m) {
  m.def("indices_of_list", &indices_of_list, py::arg("list"),
        "A list of Python ints as an int64 tensor, or None when an element is not an int within int64.");
  m.def("first_index_outside", &first_index_outside, py::arg("indices"), py::arg("length"),
        "The batch position of the first index outside [0, length), or -1.");
  m.def("wrap_negative_indices", &wrap_negative_indices, py::arg("indices"), py::arg("length"),
        "Indices in [-length, 0) become index + length, in place; returns the batch position of the first "
        "index outside [-length, length), or -1.");
  m.def("guarded_copies", &guarded_copies, py::arg("sources"), release_gil,
        "Copies of contiguous CPU tensors, read under the mapped-read guard (a read fault is an error).");
  py::enum_<GatheredColumn::Kind>(m, "GatheredKind")
      .value("IDS", GatheredColumn::Kind::Ids)
      .value("ROWS", GatheredColumn::Kind::Rows)
      .value("RAGGED", GatheredColumn::Kind::Ragged)
      .value("PACKED", GatheredColumn::Kind::Packed);
  // rows, values and offsets: lists, one tensor for each chunk of the column (one for a column in one array).
  py::class_<GatheredColumn>(m, "GatheredColumn")
      .def(py::init([](GatheredColumn::Kind kind, std::string key, std::optional<std::vector<at::Tensor>> rows,
                       std::optional<std::vector<at::Tensor>> values, std::optional<std::vector<at::Tensor>> offsets,
                       at::ScalarType dtype, std::optional<FieldSpec> field) {
             GatheredColumn column;
             column.kind = kind;
             column.key = std::move(key);
             column.rows = rows.value_or(std::vector<at::Tensor>{});
             column.values = values.value_or(std::vector<at::Tensor>{});
             column.offsets = offsets.value_or(std::vector<at::Tensor>{});
             column.dtype = dtype;
             column.field = std::move(field);
             return column;
           }),
           py::arg("kind"), py::arg("key"), py::arg("rows") = py::none(), py::arg("values") = py::none(),
           py::arg("offsets") = py::none(), py::arg("dtype"), py::arg("field") = py::none());
  py::class_<ColumnGather>(m, "ColumnGather")
      .def(py::init<std::vector<GatheredColumn>, int64_t, std::string, bool, std::optional<at::Tensor>>(),
           py::arg("columns"), py::arg("length"), py::arg("id_key"), py::arg("ids_are_indices"),
           py::arg("rows_of") = py::none())
      .def("plan", &ColumnGather::plan, py::arg("indices"));
  py::class_<ArrowGather>(m, "ArrowGather")
      .def(py::init<std::vector<GatheredColumn>, std::vector<std::string>,
                    std::vector<std::optional<std::vector<int64_t>>>, const py::capsule&, std::string,
                    std::string>(),
           py::arg("columns"), py::arg("sources"), py::arg("tensor_dims"), py::arg("schema"), py::arg("id_key"),
           py::arg("who"))
      .def("plan", &ArrowGather::plan, py::arg("stream"), py::arg("in_place") = false);
}

}  // namespace

}  // namespace fastcollate

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcollate native core: batch assembly, host staging ring, dispatcher ops";
  fastcollate::bind_build_info(m);
  fastcollate::bind_field_spec(m);
  fastcollate::bind_contract_rules(m);
  // The ring first: the plan's signatures then name _C.StagingRing.
  fastcollate::bind_staging_ring(m);
  fastcollate::bind_shared_slots(m);
  fastcollate::bind_batch_plan(m);
  fastcollate::bind_column_gather(m);
  m.attr("MAPPED_READ_FAULT") = fastcollate::kMappedReadFault;
}
