// One walk over a batch of samples: the checks (against sample 0 in drop-in mode, against the declared
// fields under a contract) and the Node tree they lay out. Nothing is copied here.
#pragma once

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "collate/contract_fields.h"
#include "collate/contract_rules.h"
#include "collate/field_spec.h"
#include "collate/node.h"

namespace fastcollate {

class BatchPlan;

class Walk {
 public:
  Walk(const ContractFields& contract, py::handle batch, BatchPlan& plan)
      : contract_(contract), batch_(batch), plan_(plan) {}

  std::unique_ptr<Node> node(const std::vector<PyObject*>& items, const std::string& path);
  void check_all_fields_seen();

 private:
  using Items = std::vector<PyObject*>;

  // Raises the ContractError of the broken rule (contract_rules.h) for sample `index`.
  [[noreturn]] void fail(const Violation& violation, size_t index, const std::string& field) const;
  // The ContractError kind of a Python error torch raised about a sample: it follows the error's class.
  static std::string error_kind(const py::error_already_set& error);
  const FieldSpec* leaf_spec(const std::string& path, size_t index) const;

  // Structure (walk.cpp).
  std::unique_ptr<Node> mapping(const Items& items, const std::string& path, bool is_dict);
  void check_same_keys(const Items& items, const std::string& path, const Node& node);
  std::unique_ptr<Node> sequence(const Items& items, const std::string& path);
  std::unique_ptr<Node> texts(const Items& items, const std::string& path, const FieldSpec* spec);
  std::unique_ptr<Node> left_to_default(const Items& items, const std::string& path);
  void lay_out(Node& node);

  // Numbers (walk_numbers.cpp).
  std::unique_ptr<Node> numbers(const Items& items, const std::string& path, const FieldSpec* spec);
  std::unique_ptr<Node> number_tensors(const Items& items, const std::string& path, const FieldSpec& spec);
  std::unique_ptr<Node> numbers_by_torch(const Items& items, size_t first, const std::string& path, bool floating);
  bool read_number(PyObject* item, size_t index, const std::string& path, const FieldSpec* spec, Node& node);

  // Tensors (walk_tensors.cpp), in the order tensors() takes them.
  std::unique_ptr<Node> tensors(const Items& items, const std::string& path, const FieldSpec* spec);
  bool stack_plain_tensors(const Items& items, const FieldSpec* spec, Node& node);
  bool gather_tensors(const Items& items, const std::string& path, const FieldSpec* spec, Node& node);
  bool check_dropin_rows(const std::string& path, Node& node);
  std::vector<int64_t> check_contract_rows(const std::string& path, const FieldSpec& spec, Node& node);
  void check_declared_shape(const at::Tensor& value, const FieldSpec& spec, size_t index, size_t count);
  void widen_named_dims(const FieldSpec& spec, const Node& node, std::vector<int64_t>& row_shape);
  void lay_out_padding(const FieldSpec& spec, const std::vector<int64_t>& row_shape, Node& node);
  uint64_t value_pattern(double value, at::ScalarType dtype, const std::string& path, const char* what,
                         const char* hint) const;
  // Lists of numbers (walk_lists.cpp): sample `index`'s list as a tensor of the field's dtype, held by the plan.
  const at::Tensor& tensor_from_list(PyObject* item, size_t index, const FieldSpec& spec);
  // Packing (walk_packing.cpp).
  void lay_out_packing(const FieldSpec& spec, Node& node);
  void lay_out_beside_packing(const FieldSpec& spec, Node& node);
  void check_range(const at::Tensor& value, const FieldSpec& spec, size_t index);
  void check_named_dim(const std::string& name, size_t index, int64_t size, const std::string& path, size_t count);

  const ContractFields& contract_;
  py::handle batch_;
  BatchPlan& plan_;
  std::vector<std::string> seen_fields_;
  // Named dims ("T") must agree between the fields of one sample: name -> size per sample (-1 unset).
  std::unordered_map<std::string, std::pair<std::string, std::vector<int64_t>>> named_dims_;
  // Padded fields' masks by the key they go under (parent path and mask name): the field that builds it.
  std::unordered_map<std::string, const Node*> mask_owners_;
  // Packed fields' parents (their path) that already have the keys beside the packed row.
  std::unordered_map<std::string, const Node*> pack_owners_;
};

}  // namespace fastcollate
