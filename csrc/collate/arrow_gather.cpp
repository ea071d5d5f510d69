#include "collate/arrow_gather.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "collate/arrow_arrays.h"
#include "collate/arrow_c_data.h"
#include "collate/arrow_tensors.h"
#include "collate/python_refs.h"

namespace fastcollate {

namespace {

using Kind = GatheredColumn::Kind;

// The record batches read from one stream. The tensors over their buffers do not own them: the batch's
// ColumnGather keeps this alive until its copy has run, then Arrow's release callbacks free them.
struct StreamArrays {
  std::vector<std::unique_ptr<ArrowArray>> batches;
  StreamArrays() = default;
  StreamArrays(const StreamArrays&) = delete;
  StreamArrays& operator=(const StreamArrays&) = delete;
  ~StreamArrays() {
    for (auto& batch : batches) {
      if (batch->release != nullptr) {
        batch->release(batch.get());
      }
    }
  }
};

struct SchemaHolder {
  ArrowSchema schema{};
  ~SchemaHolder() {
    if (schema.release != nullptr) {
      schema.release(&schema);
    }
  }
};

// Every row of `array` (a plain column's chunk, laid out as `layout`) as a GatheredColumn holds them.
ColumnChunk plain_rows(const ArrowArray* array, const Layout& layout) {
  ColumnChunk chunk;
  if (layout.offsets_width == 0) {
    auto [leaf, first] = leaf_start(array, 0, layout.fixed.size(), layout.fixed);
    std::vector<int64_t> shape{array->length};
    shape.insert(shape.end(), layout.fixed.begin(), layout.fixed.end());
    chunk.rows = view_of(leaf, first, std::move(shape), layout.dtype);
    return chunk;
  }
  const ArrowArray* values = array->children[0];
  chunk.offsets = at::empty({array->length + 1}, at::kLong);
  int64_t* out = chunk.offsets.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i <= array->length; ++i) {
    out[i] = offset_at(array, layout.offsets_width, i);
  }
  auto [leaf, first] = leaf_start(values, 0, layout.fixed.size(), layout.fixed);
  std::vector<int64_t> shape{values->length};
  shape.insert(shape.end(), layout.fixed.begin(), layout.fixed.end());
  chunk.values = view_of(leaf, first, std::move(shape), layout.dtype);
  return chunk;
}

}  // namespace

ArrowGather::ArrowGather(std::vector<GatheredColumn> columns, std::vector<std::string> sources,
                         std::vector<std::optional<std::vector<int64_t>>> tensor_dims, const py::capsule& schema,
                         std::string id_key, std::string who)
    : columns_(std::move(columns)), sources_(std::move(sources)), id_key_(std::move(id_key)), who_(std::move(who)) {
  TORCH_CHECK(columns_.size() == sources_.size() && columns_.size() == tensor_dims.size(),
              "ArrowGather: one source column and one tensor_dims entry for each gathered column");
  const auto* fields = static_cast<const ArrowSchema*>(PyCapsule_GetPointer(schema.ptr(), "arrow_schema"));
  if (fields == nullptr) {
    throw py::error_already_set();
  }
  for (size_t k = 0; k < columns_.size(); ++k) {
    GatheredColumn& column = columns_[k];
    TORCH_CHECK(column.kind != Kind::Ids, "ArrowGather: a table's batch has no ids column");
    const at::Tensor& source = column.source();
    std::string metadata;
    for (int64_t c = 0; c < fields->n_children; ++c) {
      if (sources_[k] == fields->children[c]->name) {
        metadata = metadata_bytes(fields->children[c]->metadata);
      }
    }
    metadata_.push_back(std::move(metadata));
    if (tensor_dims[k]) {
      tensors_.push_back(TensorReading{*tensor_dims[k], source.scalar_type(), source.sizes().slice(1).vec(),
                                       column.kind != Kind::Rows});
    } else {
      tensors_.push_back(std::nullopt);
    }
    stored_.push_back(source.scalar_type());
    inner_.push_back(source.sizes().slice(1).vec());
    // Lent where Ray's own collate lends: a tensor column's rows, or a column of plain numbers. Ray copies a
    // column of fixed-size lists, and a loop that writes into its batch must not write into the dataset.
    lendable_.push_back(column.kind == Kind::Rows && (tensor_dims[k].has_value() || inner_.back().empty()));
    // Only the layout is kept: the first table's buffers (in Ray's object store) are not held.
    column.rows.clear();
    column.values.clear();
    column.offsets.clear();
  }
}

py::object ArrowGather::plan(const py::capsule& capsule, bool in_place) const {
  auto* stream = static_cast<ArrowArrayStream*>(PyCapsule_GetPointer(capsule.ptr(), "arrow_array_stream"));
  if (stream == nullptr) {
    throw py::error_already_set();
  }
  TORCH_CHECK(stream->release != nullptr, "ArrowGather.plan: the Arrow stream was already consumed");
  SchemaHolder schema;
  if (stream->get_schema(stream, &schema.schema) != 0) {
    const char* why = stream->get_last_error(stream);
    TORCH_CHECK(false, who_, ": reading the table's schema failed: ", why ? why : "no reason given");
  }
  auto arrays = std::make_shared<StreamArrays>();
  while (true) {
    auto batch = std::make_unique<ArrowArray>();
    if (stream->get_next(stream, batch.get()) != 0) {
      const char* why = stream->get_last_error(stream);
      TORCH_CHECK(false, who_, ": reading the table's record batches failed: ", why ? why : "no reason given");
    }
    if (batch->release == nullptr) {
      break;  // the end of the stream
    }
    const bool empty = batch->length == 0;
    arrays->batches.push_back(std::move(batch));
    if (empty) {
      arrays->batches.pop_back();  // released as it goes
    }
  }
  stream->release(stream);  // its batches hold their own buffers
  if (arrays->batches.empty()) {
    return handed_to_the_walk("an empty table");
  }
  std::unordered_map<std::string, int64_t> by_name;
  for (int64_t c = 0; c < schema.schema.n_children; ++c) {
    by_name.emplace(schema.schema.children[c]->name, c);
  }
  std::vector<GatheredColumn> columns = columns_;
  int64_t total = 0;
  for (const auto& batch : arrays->batches) {
    TORCH_CHECK(batch->offset == 0, who_, ": a record batch at offset ", batch->offset, " is not read");
    total += batch->length;
  }
  for (size_t k = 0; k < columns.size(); ++k) {
    GatheredColumn& column = columns[k];
    const auto found = by_name.find(sources_[k]);
    if (found == by_name.end()) {
      return handed_to_the_walk("a column the table lacks");
    }
    const ArrowSchema* field = schema.schema.children[found->second];
    const bool ragged = column.kind != Kind::Rows;
    std::optional<Layout> layout;
    if (!tensors_[k]) {
      layout = layout_of(field);
      if (!layout || (layout->offsets_width != 0) != ragged || layout->dtype != stored_[k] ||
          layout->fixed != inner_[k]) {
        return handed_to_the_walk("a column laid out unlike the first table's");
      }
    } else if (metadata_bytes(field->metadata) != metadata_[k]) {  // another tensor type
      return handed_to_the_walk("a column laid out unlike the first table's");
    }
    int64_t start = 0;  // the chunk's first row in the table
    for (const auto& batch : arrays->batches) {
      const ArrowArray* array = batch->children[found->second];
      TORCH_CHECK(array->length == batch->length, who_, ": column '", sources_[k], "' has ", array->length,
                  " rows in a record batch of ", batch->length);
      std::optional<ColumnChunk> chunk;
      int64_t null_row = -1;
      if (layout) {
        null_row = row_with_null(array, *layout);
        chunk = plain_rows(array, *layout);
      } else {
        TensorRows read = read_tensor_rows(field, array, *tensors_[k]);
        null_row = read.null_row;
        chunk = std::move(read.chunk);
      }
      if (null_row >= 0) {
        throw py::value_error(who_ + ": column '" + sources_[k] + "' has a missing value (null) in row " +
                              std::to_string(start + null_row) +
                              " of the batch: a tensor has no null. Fill or drop them first (pyarrow.compute."
                              "fill_null in Dataset.map_batches, or Dataset.filter)");
      }
      if (!chunk) {  // tensor rows not laid out as the first table's: see read_tensor_rows
        return handed_to_the_walk("a column laid out unlike the first table's");
      }
      if (!ragged) {
        column.rows.push_back(std::move(chunk->rows));
      } else {
        column.values.push_back(std::move(chunk->values));
        column.offsets.push_back(std::move(chunk->offsets));
      }
      start += array->length;
    }
  }
  std::shared_ptr<const void> owner = std::static_pointer_cast<const void>(arrays);
  if (in_place && checked_.load(std::memory_order_acquire)) {
    if (auto batch = batch_as_it_lies(columns, owner)) {
      return *batch;
    }
  }
  const ColumnGather gather(std::move(columns), total, id_key_, /*ids_are_indices=*/false, std::nullopt,
                            std::move(owner));
  py::object plan = gather.plan_in_order();
  if (!plan.is_none()) {
    checked_.store(true, std::memory_order_release);
  }
  return plan;
}

std::optional<py::dict> ArrowGather::batch_as_it_lies(const std::vector<GatheredColumn>& columns,
                                                       const std::shared_ptr<const void>& owner) const {
  // First which columns are lent, so that no copy is made for a batch that goes the planned way after all.
  std::vector<bool> lent(columns.size(), false);
  std::vector<const void*> lent_memory;
  for (size_t k = 0; k < columns.size(); ++k) {
    const GatheredColumn& column = columns[k];
    if (column.kind != Kind::Rows || column.rows.size() != 1 || (column.field && column.field->range)) {
      return std::nullopt;  // gathered from chunks, laid out, or checked value by value as it is copied
    }
    const at::Tensor& rows = column.rows.front();
    if (rows.scalar_type() != column.dtype || !rows.is_contiguous()) {
      return std::nullopt;  // cast, or strided
    }
    const void* memory = rows.const_data_ptr();
    const bool aligned = reinterpret_cast<uintptr_t>(memory) % rows.element_size() == 0;
    const bool seen = std::find(lent_memory.begin(), lent_memory.end(), memory) != lent_memory.end();
    lent[k] = lendable_[k] && aligned && !seen && static_cast<int64_t>(rows.nbytes()) > kSmallFieldBytes;
    if (lent[k]) {
      lent_memory.push_back(memory);
    }
  }
  if (lent_memory.empty()) {
    return std::nullopt;  // only small columns: one buffer for all of them beats one allocation each
  }
  py::dict batch;
  for (size_t k = 0; k < columns.size(); ++k) {
    const at::Tensor& rows = columns[k].rows.front();
    at::Tensor out;
    if (lent[k]) {
      out = at::from_blob(rows.data_ptr(), rows.sizes(), [owner](void*) {}, rows.options());
    } else {
      out = at::detail::empty_cpu(rows.sizes(), rows.scalar_type());
      if (rows.nbytes() > 0) {
        std::memcpy(out.mutable_data_ptr(), rows.const_data_ptr(), rows.nbytes());
      }
    }
    batch[py::str(columns[k].key)] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }
  return batch;
}

}  // namespace fastcollate
