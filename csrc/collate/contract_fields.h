// A contract's fields as the walk reads them: each declared leaf by its path, which paths are containers,
// and how samples are named in errors. The rules between fields (a shared mask, copies, dropped keys) are
// checked here, once, when a Contract is declared (contract.check_contract) and when a collator is made.
#pragma once

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "collate/field_spec.h"

namespace fastcollate {

class ContractFields {
 public:
  ContractFields(std::string id_key, std::vector<FieldSpec> fields, bool has_contract);

  const std::string& id_key() const { return id_key_; }
  bool has_contract() const { return has_contract_; }
  const FieldSpec* field(const std::string& path) const;
  bool is_container_path(const std::string& path) const;
  const std::vector<FieldSpec>& fields() const { return fields_; }
  // The fields that take the samples of the packed field at `path` (FieldSpec::copy_of); none for most.
  std::vector<const FieldSpec*> copies_of(const std::string& path) const;
  // Whether the key at `path` is left out of the batch (a key of packed fields' parent, Packing.drop).
  bool is_dropped(const std::string& path) const { return !dropped_.empty() && dropped_.count(path) != 0; }

 private:
  void check_copy(const FieldSpec& field) const;

  std::string id_key_;
  std::vector<FieldSpec> fields_;
  std::unordered_map<std::string, size_t> by_path_;
  std::unordered_map<std::string, bool> container_paths_;
  std::unordered_map<std::string, std::vector<size_t>> copies_;  // source path -> its copies' indices
  std::unordered_set<std::string> dropped_;
  bool has_contract_;
};

}  // namespace fastcollate
