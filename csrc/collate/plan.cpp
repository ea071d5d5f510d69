// The plan's second step: views over the batch buffer, the copy jobs that fill it, and the output
// structure. The walk (collator.h) or the column gather (column_gather.h) makes the plan.
#include "collate/plan.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "collate/contract_rules.h"
#include "collate/node.h"
#include "memory/padded_rows.h"

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

// Copies into a padded field: each sample at the start of its row (right padding) or at its end (left
// padding) in every named dim, the rest the pad value (padded_rows.h). When only dim 0 of a contiguous
// sample varies its bytes are one span of the row: one memcpy and one fill. The mask (1 of its dtype at
// real positions, 0 at padding) is written the same way, unless an earlier field of the same parent
// writes it (a shared mask: node.mask is null).
void add_padded_jobs(Node& node, CopyJobs& jobs) {
  const size_t element_size = c10::elementSize(node.dtype);
  const size_t var_dims = node.var_dims.size();
  const size_t count = node.inputs.size();
  if (count == 0) {
    return;
  }
  const size_t row_elements = static_cast<size_t>(node.out.numel()) / count;
  const auto row_tail_shape = node.out.sizes().slice(2);
  const int64_t padded = node.out.dim() > 1 ? node.out.size(1) : 0;  // dim 0's padded length
  const size_t step_elements = padded > 0 ? row_elements / static_cast<size_t>(padded) : 0;
  auto* out = static_cast<unsigned char*>(node.out.data_ptr());
  Node* mask = node.mask.get();
  const at::ScalarType mask_dtype = mask ? mask->dtype : at::kBool;
  const size_t mask_element_size = c10::elementSize(mask_dtype);
  const uint64_t mask_one = mask ? element_pattern(1, mask_dtype) : 0;  // 1, 1.0f, ...: bytes differ by dtype
  const size_t mask_row_elements = mask ? static_cast<size_t>(mask->out.numel()) / count : 0;
  auto* mask_bytes = mask ? static_cast<unsigned char*>(mask->out.data_ptr()) : nullptr;
  at::Tensor one;  // the ATen path's source for real mask positions, made once for the batch
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& value = node.inputs[i];
    unsigned char* row = out + i * row_elements * element_size;
    unsigned char* mask_row = mask ? mask_bytes + i * mask_row_elements * mask_element_size : nullptr;
    const bool one_span = node.var_dims == std::vector<int64_t>{0} && value.scalar_type() == node.dtype &&
                          copyable_as_is(value) && value.sizes().slice(1) == row_tail_shape;
    if (one_span) {
      // Pointer arithmetic, not select(): two dispatcher calls per sample would cost more than its bytes.
      const int64_t length = value.size(0);
      const PaddedRow span = padded_row(length, padded, node.pad_left);
      unsigned char* values = add_row_padding(jobs, row, span, step_elements, element_size, node.pad_pattern);
      jobs.add_memcpy(value.const_data_ptr(), values, static_cast<size_t>(value.numel()) * element_size);
      if (mask) {
        add_mask_row(jobs, mask_row, span, length, mask_element_size, mask_one);
      }
      continue;
    }
    // Pad the whole row, then copy the sample into its corner (fills run before copies): its first
    // positions of each named dim, or its last ones when padded on the left. Fixed dims stay whole (a
    // declared expand broadcasts).
    jobs.fills.push_back({row, row_elements, element_size, node.pad_pattern});
    at::Tensor target = node.out.select(0, static_cast<int64_t>(i));
    at::Tensor mask_target = mask ? mask->out.select(0, static_cast<int64_t>(i)) : at::Tensor();
    for (size_t k = 0; k < var_dims; ++k) {
      const int64_t dim = node.var_dims[k];
      const int64_t size = value.size(dim);
      const int64_t start = padded_row(size, target.size(dim), node.pad_left).start;
      target = target.narrow(dim, start, size);
      if (mask) {
        mask_target = mask_target.narrow(static_cast<int64_t>(k), start, size);
      }
    }
    jobs.tensor_copies.push_back({value, target});
    if (mask) {
      jobs.fills.push_back({mask_row, mask_row_elements, mask_element_size, 0});
      if (!one.defined()) {
        one = at::ones({}, at::TensorOptions().dtype(mask_dtype));
      }
      jobs.tensor_copies.push_back({one, mask_target});
    }
  }
}

void add_packing_key_jobs(Node& node, size_t count, CopyJobs& jobs);

// Copies into a packed row: sample i at token starts[i], its first token replaced by the separator when
// one is declared (a fill of that token, and the copy starts one token later: no order between them).
// The parent's first packed field also writes the position ids, seq_idx and cu_seq_lens beside it.
void add_packed_jobs(Node& node, CopyJobs& jobs) {
  const size_t count = node.inputs.size();
  const size_t element_size = c10::elementSize(node.dtype);
  const int64_t token_elements = c10::multiply_integers(node.out.sizes().slice(2));
  const size_t token_bytes = static_cast<size_t>(token_elements) * element_size;
  auto* out = static_cast<unsigned char*>(node.out.data_ptr());
  at::Tensor tokens;  // [total, *fixed dims], for the copies ATen makes: made only when one is needed
  for (size_t i = 0; i < count; ++i) {
    const int64_t length = node.starts[i + 1] - node.starts[i];
    if (length == 0) {
      continue;
    }
    unsigned char* row = out + static_cast<size_t>(node.starts[i]) * token_bytes;
    const int64_t skip = node.has_separator ? 1 : 0;
    if (node.has_separator) {
      jobs.fills.push_back({row, static_cast<size_t>(token_elements), element_size, node.separator_pattern});
    }
    if (length == skip) {
      continue;
    }
    if (const void* source = node.sources[i]) {
      jobs.add_memcpy(static_cast<const unsigned char*>(source) + skip * token_bytes, row + skip * token_bytes,
                      static_cast<size_t>(length - skip) * token_bytes);
    } else {
      if (!tokens.defined()) {
        tokens = node.out.select(0, 0);
      }
      jobs.tensor_copies.push_back(
          {node.inputs[i].narrow(0, skip, length - skip), tokens.narrow(0, node.starts[i] + skip, length - skip)});
    }
  }
  add_packing_key_jobs(node, count, jobs);
}

// The keys beside a packed row, from its starts: the position ids, seq_idx and cu_seq_lens (each null
// where not asked for).
void add_packing_key_jobs(Node& node, size_t count, CopyJobs& jobs) {
  if (node.position_ids) {
    auto* positions = node.position_ids->out.data_ptr<int64_t>();
    for (size_t i = 0; i < count; ++i) {
      jobs.counts.push_back({positions + node.starts[i], static_cast<size_t>(node.starts[i + 1] - node.starts[i]),
                             node.position_ids_start});
    }
  }
  if (node.seq_idx) {
    auto* seq_idx = static_cast<unsigned char*>(node.seq_idx->out.data_ptr());
    for (size_t i = 0; i < count; ++i) {
      const int32_t index = static_cast<int32_t>(i);
      uint64_t pattern = 0;
      std::memcpy(&pattern, &index, sizeof(index));  // FillJob reads an element's bytes from the pattern's first
      jobs.fills.push_back({seq_idx + node.starts[i] * sizeof(int32_t),
                            static_cast<size_t>(node.starts[i + 1] - node.starts[i]), sizeof(int32_t), pattern});
    }
  }
  if (node.cu_seq_lens) {
    write_numbers(*node.cu_seq_lens);
  }
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
    add_tensor_jobs(node, jobs);
  } else if (node.kind == Node::Kind::Numbers) {
    write_numbers(node);
  }
  if (node.padded) {
    write_numbers(*node.lengths);
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
  CopyJobs jobs;
  collect_jobs(*root, jobs);
  {
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
