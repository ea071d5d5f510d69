#include "collate/contract_fields.h"

#include <algorithm>
#include <iterator>

namespace fastcollate {

namespace {

std::vector<std::string> named_dims_of(const FieldSpec& field) {
  std::vector<std::string> names;
  std::copy_if(field.dim_names.begin(), field.dim_names.end(), std::back_inserter(names),
               [](const std::string& name) { return !name.empty(); });
  return names;
}

}  // namespace

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
      auto [first, added] = masks.emplace(child_path(parent_path(field.path), field.mask_name), &field);
      const FieldSpec& owner = *first->second;
      TORCH_CHECK(added || (named_dims_of(owner) == named_dims_of(field) && owner.mask_dtype == field.mask_dtype &&
                            owner.pad_to_multiple_of == field.pad_to_multiple_of && owner.pad_left == field.pad_left),
                  "Contract: padded fields '", owner.path, "' and '", field.path, "' share mask '", field.mask_name,
                  "' but pad different named dims, to different multiples or sides, or into different mask dtypes");
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
  // Copies and dropped keys, as contract.py checks them first (with the reasons).
  for (size_t i = 0; i < fields_.size(); ++i) {
    const auto& field = fields_[i];
    for (const auto& name : field.drop_names) {
      const std::string dropped = child_path(parent_path(field.path), name);
      TORCH_CHECK(field.packed && by_path_.count(dropped) == 0, "Contract: '", dropped,
                  "' is a field, but the packing leaves it out of the batch");
      dropped_.insert(dropped);
    }
    if (field.copy_of.empty()) {
      continue;
    }
    const FieldSpec* source = this->field(field.copy_of);
    TORCH_CHECK(field.packed && source != nullptr && source->packed && source->copy_of.empty() &&
                    parent_path(field.copy_of) == parent_path(field.path),
                "Contract: field '", field.path, "' copies '", field.copy_of,
                "', which is no packed field of the same mapping, or is a copy itself");
    copies_[field.copy_of].push_back(i);
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
