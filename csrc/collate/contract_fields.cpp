#include "collate/contract_fields.h"

#include <algorithm>
#include <iterator>

#include "collate/messages.h"

namespace fastcollate {

namespace {

std::vector<std::string> named_dims_of(const FieldSpec& field) {
  std::vector<std::string> names;
  std::copy_if(field.dim_names.begin(), field.dim_names.end(), std::back_inserter(names),
               [](const std::string& name) { return !name.empty(); });
  return names;
}

// How the declaration wrote it: 'x', ['T'], ('T', 2), None.
std::string quoted(const std::string& text) {
  return "'" + text + "'";
}

std::string listed(const std::vector<std::string>& names) {
  std::string text = "[";
  for (size_t i = 0; i < names.size(); ++i) {
    text += (i ? ", " : "") + quoted(names[i]);
  }
  return text + "]";
}

std::string declared_shape(const FieldSpec& field) {
  if (!field.shape) {
    return "None";
  }
  std::string text = "(";
  for (size_t d = 0; d < field.shape->size(); ++d) {
    text +=
        (d ? ", " : "") + (field.dim_names[d].empty() ? std::to_string((*field.shape)[d]) : quoted(field.dim_names[d]));
  }
  return text + (field.shape->size() == 1 ? ",)" : ")");
}

std::string multiple(int64_t pad_to_multiple_of) {
  return pad_to_multiple_of == 1 ? "None" : std::to_string(pad_to_multiple_of);
}

// A shared mask is built once, so the fields must make the same one: the same named dims (which agree
// within a sample), padded to the same multiple on the same side, into the same mask dtype.
void check_shared_mask(const std::string& key, const FieldSpec& a, const FieldSpec& b) {
  const bool same = named_dims_of(a) == named_dims_of(b) && a.mask_dtype == b.mask_dtype &&
                    a.pad_to_multiple_of == b.pad_to_multiple_of && a.pad_left == b.pad_left;
  TORCH_CHECK_VALUE(same, "padded fields ", quoted(a.path), " and ", quoted(b.path), " share the mask key ",
                    quoted(key), ", but their masks would differ: named dims ", listed(named_dims_of(a)), " and ",
                    listed(named_dims_of(b)), ", mask dtypes ", dtype_string(a.mask_dtype), " and ",
                    dtype_string(b.mask_dtype), ", pad_to_multiple_of ", multiple(a.pad_to_multiple_of), " and ",
                    multiple(b.pad_to_multiple_of), ", padding_side ", quoted(a.pad_left ? "left" : "right"), " and ",
                    quoted(b.pad_left ? "left" : "right"),
                    ". A shared mask needs the same named dims in the same order, mask_dtype, pad_to_multiple_of "
                    "and padding_side; otherwise give one field its own mask=<key>");
}

}  // namespace

void ContractFields::check_copy(const FieldSpec& field) const {
  // A copy reads its source's value in the walk: the source is a packed field of the same mapping (the
  // row's starts are the source's) whose samples hold it, not a copy itself.
  const std::string& path = field.path;
  const std::string& source_path = field.copy_of;
  TORCH_INTERNAL_ASSERT(field.packed, "a copy is a packed field (declaration_rules.check_field)");
  TORCH_CHECK_VALUE(source_path != path, "field ", quoted(path),
                    " is declared a copy of itself: copy_of names another packed field");
  TORCH_CHECK_VALUE(parent_path(source_path) == parent_path(path), "field ", quoted(path), " is a copy of ",
                    quoted(source_path), ", which is not in the same mapping: copy_of names a key of it");
  const FieldSpec* source = this->field(source_path);
  TORCH_CHECK_VALUE(source != nullptr, "field ", quoted(path), " is a copy of ", quoted(source_path),
                    ", which the contract does not declare: declare ", quoted(source_path),
                    " as a packed field (Field(pack=True))");
  TORCH_CHECK_VALUE(source->packed, "field ", quoted(path), " is a copy of ", quoted(source_path),
                    ", which is not packed: copy_of names a packed field of the same mapping");
  const std::string name = source->copy_of.substr(source->copy_of.rfind('.') + 1);
  TORCH_CHECK_VALUE(source->copy_of.empty(), "field ", quoted(path), " is a copy of ", quoted(source_path),
                    ", itself a copy of ", quoted(name), ": copies do not chain, name ", quoted(name));
  TORCH_CHECK_VALUE(source->shape == field.shape && source->dim_names == field.dim_names, "field ", quoted(path),
                    " is a copy of ", quoted(source_path), ", so it has its shape ", declared_shape(*source), ", not ",
                    declared_shape(field));
}

ContractFields::ContractFields(std::string id_key, std::vector<FieldSpec> fields, bool has_contract)
    : id_key_(std::move(id_key)), fields_(std::move(fields)), has_contract_(has_contract) {
  // Padded fields by the key their mask goes under: a shared mask is built once, so the fields must
  // agree on what it is (contract.py refuses the rest first, with the same rule).
  std::unordered_map<std::string, const FieldSpec*> masks;
  for (size_t i = 0; i < fields_.size(); ++i) {
    const auto& field = fields_[i];
    TORCH_CHECK(by_path_.emplace(field.path, i).second, "Contract: field '", field.path, "' declared twice");
    TORCH_CHECK(field.dim_names.size() == (field.shape ? field.shape->size() : 0), "Contract: field '", field.path,
                "': dim_names and shape differ in length");
    if (field.padded()) {
      const std::string mask = child_path(parent_path(field.path), field.mask_name);
      auto [first, added] = masks.emplace(mask, &field);
      if (!added) {
        check_shared_mask(mask, *first->second, field);
      }
      TORCH_CHECK(field.pad_to_multiple_of >= 1, "Contract: field '", field.path,
                  "': pad_to_multiple_of must be at least 1, got ", field.pad_to_multiple_of);
    }
    // Every prefix of a declared path is a container ("" is the sample itself).
    if (!field.path.empty()) {
      container_paths_[""] = true;
    }
    for (size_t dot = field.path.find('.'); dot != std::string::npos; dot = field.path.find('.', dot + 1)) {
      container_paths_[field.path.substr(0, dot)] = true;
    }
  }
  for (size_t i = 0; i < fields_.size(); ++i) {
    const auto& field = fields_[i];
    for (const auto& name : field.drop_names) {
      const std::string dropped = child_path(parent_path(field.path), name);
      TORCH_CHECK_VALUE(field.packed, "Packing.drop applies to packed fields' mapping: field ", quoted(field.path),
                        " is not packed");
      TORCH_CHECK_VALUE(by_path_.count(dropped) == 0, quoted(dropped),
                        " is declared a field, but Packing.drop leaves it out of packed batches: remove the field, "
                        "or leave ",
                        quoted(name), " out of Packing(drop=...)");
      dropped_.insert(dropped);
    }
    if (!field.copy_of.empty()) {
      check_copy(field);
      copies_[field.copy_of].push_back(i);
    }
  }
}

std::vector<const FieldSpec*> ContractFields::copies_of(const std::string& path) const {
  std::vector<const FieldSpec*> copies;
  if (copies_.empty()) {
    return copies;
  }
  auto found = copies_.find(path);
  if (found != copies_.end()) {
    for (size_t i : found->second) {
      copies.push_back(&fields_[i]);
    }
  }
  return copies;
}

const FieldSpec* ContractFields::field(const std::string& path) const {
  auto found = by_path_.find(path);
  return found == by_path_.end() ? nullptr : &fields_[found->second];
}

bool ContractFields::is_container_path(const std::string& path) const {
  return container_paths_.count(path) != 0;
}

}  // namespace fastcollate
