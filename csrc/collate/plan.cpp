// The plan's second step: views over the batch buffer, the copy jobs that fill it, and the output
// structure. The walk (collator.h) or the column gather (column_gather.h) makes the plan.
#include "collate/plan.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <iterator>
#include <optional>

#include "collate/contract_rules.h"
#include "collate/node.h"
#include "fill/packed_rows.h"
#include "fill/padded_rows.h"
#include "memory/shared_slots.h"

namespace fastcollate {

namespace {

at::Tensor view_over(const at::Storage& storage, size_t offset, at::ScalarType dtype,
                     const std::vector<int64_t>& shape) {
  const size_t element_size = c10::elementSize(dtype);
  TORCH_INTERNAL_ASSERT(offset % element_size == 0, "misaligned field offset");
  // Built directly on the storage, as ATen builds its own views: two dispatcher calls per field
  // (empty + set_) cost more than the copy for batches of many small fields.
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(dtype));
  view.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  view.unsafeGetTensorImpl()->set_storage_offset(static_cast<int64_t>(offset / element_size));
  return view;
}

// `batch_bytes` is the buffer's size when small fields get their own storage (needs_own_storage), else 0.
// Returns how many views of `storage` it made.
int64_t make_views(Node& node, const at::Storage& storage, size_t offset, int64_t batch_bytes) {
  int64_t views = 0;
  for (auto& child : node.children) {
    views += make_views(*child, storage, offset, batch_bytes);
  }
  if (node.kind == Node::Kind::Tensor || node.kind == Node::Kind::Numbers) {
    const int64_t field_bytes = c10::multiply_integers(node.shape) * static_cast<int64_t>(c10::elementSize(node.dtype));
    if (needs_own_storage(field_bytes, batch_bytes)) {
      // Its region of the buffer stays unused. empty_cpu, not at::empty: no dispatcher call per batch.
      node.out = at::detail::empty_cpu(node.shape, node.dtype);
    } else {
      node.out = view_over(storage, offset + node.offset, node.dtype, node.shape);
      ++views;
    }
  }
  if (node.padded) {
    if (node.mask) {
      views += make_views(*node.mask, storage, offset, batch_bytes);
    }
    views += make_views(*node.lengths, storage, offset, batch_bytes);
  }
  for (Node* beside : {node.position_ids.get(), node.seq_idx.get(), node.cu_seq_lens.get()}) {
    if (beside != nullptr) {
      views += make_views(*beside, storage, offset, batch_bytes);
    }
  }
  return views;
}

void write_numbers(Node& node) {
  void* dst = node.out.data_ptr();
  if (node.dtype == at::kBool) {
    auto* out = static_cast<bool*>(dst);
    for (size_t i = 0; i < node.ints.size(); ++i) {
      out[i] = node.ints[i] != 0;
    }
    return;
  }
  // Values were converted to the declared dtype's family when read; cast to its width here.
  AT_DISPATCH_V2(node.dtype, "write_numbers", AT_WRAP([&] {
                   auto* out = static_cast<scalar_t*>(dst);
                   if (!node.floats.empty()) {
                     for (size_t i = 0; i < node.floats.size(); ++i) {
                       out[i] = static_cast<scalar_t>(node.floats[i]);
                     }
                   } else {
                     for (size_t i = 0; i < node.ints.size(); ++i) {
                       out[i] = static_cast<scalar_t>(node.ints[i]);
                     }
                   }
                 }),
                 AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                 AT_EXPAND(AT_FLOAT8_TYPES));
}

// Copies into a padded field through its writer (fill/padded_rows.h): when only dim 0 of a contiguous
// sample varies, its bytes are one span of the row (one memcpy, one fill); else the sample goes into the
// corner of its padded row. The mask is written the same way, unless an earlier field of the same parent
// writes it (a shared mask: node.mask is null).
void add_padded_jobs(Node& node, CopyJobs& jobs) {
  const size_t count = node.inputs.size();
  if (count == 0) {
    return;
  }
  PaddedRows rows(node.out, static_cast<int64_t>(count), node.pad_pattern, node.pad_left);
  if (node.mask) {
    rows.with_mask(node.mask->out);
  }
  rows.with_lengths(node.lengths->out.data_ptr<int64_t>(), node.var_dims.size());
  const auto row_tail_shape = node.out.sizes().slice(2);
  const size_t element_size = c10::elementSize(node.dtype);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& value = node.inputs[i];
    const int64_t b = static_cast<int64_t>(i);
    const bool one_span = node.var_dims == std::vector<int64_t>{0} && value.scalar_type() == node.dtype &&
                          copyable_as_is(value) && value.sizes().slice(1) == row_tail_shape;
    if (one_span) {
      // Pointer arithmetic, not select(): two dispatcher calls per sample would cost more than its bytes.
      unsigned char* values = rows.add_row(jobs, b, value.size(0));
      jobs.add_memcpy(value.const_data_ptr(), values, static_cast<size_t>(value.numel()) * element_size);
    } else {
      rows.add_corner(jobs, b, value, node.var_dims);
    }
  }
}

// The keys beside a packed row, from its starts (fill/packed_rows.h): the position ids, seq_idx and
// cu_seq_lens (each null where not asked for).
void add_packing_key_jobs(Node& node, size_t count, CopyJobs& jobs) {
  add_packing_keys(jobs, node.starts.data(), count,
                   node.position_ids ? node.position_ids->out.data_ptr<int64_t>() : nullptr, node.position_ids_start,
                   node.seq_idx ? node.seq_idx->out.data_ptr<int32_t>() : nullptr);
  if (node.cu_seq_lens) {
    write_cu_seq_lens(node.cu_seq_lens->out.data_ptr<int32_t>(), node.starts.data(), count);
  }
}

// Copies into a packed row through its writer (fill/packed_rows.h): sample i at token starts[i], its first
// token the separator when one is declared. The parent's first packed field also writes the keys beside.
void add_packed_jobs(Node& node, CopyJobs& jobs) {
  const size_t count = node.inputs.size();
  if (node.out.numel() > 0) {
    const PackedRows rows(node.out.select(0, 0), node.starts.data());
    const std::optional<uint64_t> separator =
        node.has_separator ? std::optional<uint64_t>(node.separator_pattern) : std::nullopt;
    for (size_t i = 0; i < count; ++i) {
      rows.add_row(jobs, i, node.sources[i], node.inputs[i], separator);
    }
  }
  add_packing_key_jobs(node, count, jobs);
}

void add_tensor_jobs(Node& node, CopyJobs& jobs) {
  if (node.gathered) {
    if (node.max_length >= 0) {
      add_packing_key_jobs(node, node.starts.size() - 1, jobs);
    }
    return;
  }
  if (node.padded) {
    add_padded_jobs(node, jobs);
    return;
  }
  if (node.packed) {
    add_packed_jobs(node, jobs);
    return;
  }
  const size_t count = node.inputs.size();
  const size_t row_bytes = count == 0 ? 0 : static_cast<size_t>(node.out.nbytes()) / count;
  if (row_bytes == 0) {
    return;
  }
  // One job for the field's plain rows (no per-row bookkeeping: batches of many small fields are bound
  // by it); the rest go through ATen.
  jobs.add_rows(node.sources.data(), node.out.data_ptr(), row_bytes, count);
  for (size_t i = 0; i < count; ++i) {
    if (node.sources[i] == nullptr) {
      jobs.tensor_copies.push_back({node.inputs[i], node.out.select(0, static_cast<int64_t>(i))});
    }
  }
}

void collect_jobs(Node& node, CopyJobs& jobs) {
  for (auto& child : node.children) {
    collect_jobs(*child, jobs);
  }
  if (node.kind == Node::Kind::Tensor) {
    add_tensor_jobs(node, jobs);  // a padded field's lengths too: its writer's, or the gather's
  } else if (node.kind == Node::Kind::Numbers) {
    write_numbers(node);
  }
}

// A field made as a view of `storage` (make_views), as the worker writing a shared slot remembers it.
void add_view(const Node& node, const at::Storage& storage, const std::string& key, std::vector<WrittenField>& out) {
  if (node.out.defined() && node.out.storage().unsafeGetStorageImpl() == storage.unsafeGetStorageImpl()) {
    out.push_back({node.out.storage_offset() * static_cast<int64_t>(node.out.element_size()),
                   static_cast<int64_t>(node.out.nbytes()), key});
  }
}

// The batch's fields that are views of `storage`, with the keys build_output gives them.
void view_fields(const Node& node, const at::Storage& storage, std::vector<WrittenField>& out) {
  for (const auto& child : node.children) {
    view_fields(*child, storage, out);
  }
  if (node.kind == Node::Kind::Tensor || node.kind == Node::Kind::Numbers) {
    add_view(node, storage, node.path, out);
  }
  const std::string parent = parent_path(node.path);
  if (node.padded) {
    if (node.mask) {
      add_view(*node.mask, storage, child_path(parent, node.mask_name), out);
    }
    if (!node.lengths_name.empty()) {
      add_view(*node.lengths, storage, child_path(parent, node.lengths_name), out);
    }
  }
  if (node.position_ids) {
    add_view(*node.position_ids, storage, child_path(parent, node.position_ids_name), out);
  }
  if (node.seq_idx) {
    add_view(*node.seq_idx, storage, child_path(parent, node.seq_idx_name), out);
  }
  if (node.cu_seq_lens && !node.cu_seq_lens_names.empty()) {
    add_view(*node.cu_seq_lens, storage, child_path(parent, node.cu_seq_lens_names[0]), out);
  }
}

py::object build_output(Node& node) {
  const PythonRefs& refs = python_refs();
  switch (node.kind) {
    case Node::Kind::Tensor:
    case Node::Kind::Numbers:
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(node.out)));
    case Node::Kind::Ready:
      return node.ready;
    case Node::Kind::Dict:
    case Node::Kind::Mapping: {
      py::dict values;
      for (size_t k = 0; k < node.keys.size(); ++k) {
        Node& child = *node.children[k];
        values[node.keys[k]] = build_output(child);
        if (child.padded) {
          if (child.mask) {  // else an earlier field's (a shared mask)
            values[py::str(child.mask_name)] = build_output(*child.mask);
          }
          if (!child.lengths_name.empty()) {
            values[py::str(child.lengths_name)] = build_output(*child.lengths);
          }
        }
      }
      // The keys beside packed rows go after the fields, in DataCollatorWithFlattening's order.
      for (auto& each : node.children) {
        Node& child = *each;
        if (!child.packed || child.max_length < 0) {
          continue;
        }
        if (child.position_ids) {
          values[py::str(child.position_ids_name)] = build_output(*child.position_ids);
        }
        if (child.seq_idx) {
          values[py::str(child.seq_idx_name)] = build_output(*child.seq_idx);
        }
        if (child.cu_seq_lens) {
          // One tensor under both keys: q's and k's offsets are equal in self-attention.
          py::object offsets = build_output(*child.cu_seq_lens);
          for (const auto& name : child.cu_seq_lens_names) {
            values[py::str(name)] = offsets;
          }
        }
        for (const auto& name : child.max_length_names) {
          values[py::str(name)] = py::int_(child.max_length);
        }
      }
      return node.kind == Node::Kind::Dict ? py::object(values) : refs.rebuild_mapping(node.elem, values);
    }
    case Node::Kind::List:
    case Node::Kind::NamedTuple:
    case Node::Kind::Sequence: {
      py::list values(node.children.size());
      for (size_t k = 0; k < node.children.size(); ++k) {
        values[k] = build_output(*node.children[k]);
      }
      if (node.kind == Node::Kind::List) {
        return std::move(values);
      }
      if (node.kind == Node::Kind::NamedTuple) {
        return py::type::of(node.elem)(*values);
      }
      return refs.rebuild_sequence(node.elem, values);
    }
  }
  throw std::logic_error("unreachable");
}

}  // namespace

size_t BatchPlan::reserve(size_t bytes) {
  const size_t offset = total_bytes_;
  total_bytes_ += align_up(bytes);
  return offset;
}

py::object BatchPlan::execute(const at::Tensor& buffer, bool small_fields_apart) {
  TORCH_CHECK(
      buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
      "BatchPlan.execute: buffer must be a 1-D contiguous uint8 CPU tensor");
  TORCH_CHECK(buffer.numel() >= nbytes(), "BatchPlan.execute: buffer holds ", buffer.numel(),
              " bytes, the batch needs ", nbytes());
  TORCH_CHECK(buffer.storage_offset() % static_cast<int64_t>(kFieldAlignment) == 0,
              "BatchPlan.execute: buffer must start at a multiple of ", kFieldAlignment, " bytes in its storage");
  return execute_into(buffer.storage(), static_cast<size_t>(buffer.storage_offset()), small_fields_apart);
}

py::object BatchPlan::execute_into(const at::Storage& storage, size_t offset, bool small_fields_apart) {
  TORCH_CHECK(!executed_, "BatchPlan.execute: a plan runs once");
  TORCH_INTERNAL_ASSERT(offset % kFieldAlignment == 0 && storage.nbytes() >= offset + total_bytes_);
  executed_ = true;
  // Whatever happens, the plan lets go of the buffer's views and the samples when it is done: a failed
  // batch's error (and its traceback, which holds this plan) must not keep a ring slot or a shared slot.
  struct Release {
    BatchPlan& plan;
    ~Release() {
      plan.fill_gathered = nullptr;
      plan.root.reset();
      plan.keepalive.clear();
      plan.held.clear();
      plan.converted.clear();
      plan.batch = py::none();
    }
  } release{*this};
  views_ = make_views(*root, storage, offset, small_fields_apart ? static_cast<int64_t>(total_bytes_) : 0);
  if (writes_a_slot(storage)) {
    std::vector<WrittenField> fields;
    view_fields(*root, storage, fields);
    remember_written_fields(storage, std::move(fields));
  }
  CopyJobs jobs;
  collect_jobs(*root, jobs);
  if (!jobs.empty()) {  // else releasing the GIL would only queue this thread behind the others for it
    py::gil_scoped_release no_gil;  // the copy touches no Python object; other threads run meanwhile
    jobs.run();
  }
  if (fill_gathered) {
    fill_gathered();
  }
  return build_output(*root);
}

py::tuple BatchPlan::execute_in_ring(StagingRing& ring, bool small_fields_apart) {
  bool overflowed = false;
  at::Storage slot;
  {
    py::gil_scoped_release no_gil;  // acquire may wait for a device copy to free a slot
    slot = ring.acquire_storage(nbytes(), overflowed);
  }
  overflowed_ring_ = overflowed;
  py::object out = execute_into(slot, 0, small_fields_apart);
  return py::make_tuple(out, overflowed, views());
}

}  // namespace fastcollate
