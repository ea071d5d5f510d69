#include "collate/collator.h"

#include "collate/node.h"
#include "collate/walk.h"

namespace fastcollate {

std::shared_ptr<BatchPlan> Collator::plan(py::handle samples) const {
  auto plan = std::make_shared<BatchPlan>();
  plan->batch = py::reinterpret_borrow<py::object>(samples);
  // A tuple of the samples: strong references, whatever Python code the walk runs meanwhile.
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Tuple(samples.ptr()));
  if (!fast) {
    throw py::error_already_set();
  }
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast.ptr());
  TORCH_CHECK(count > 0, "Collator.plan: an empty batch has no structure to follow");
  std::vector<PyObject*> items(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    items[static_cast<size_t>(i)] = PySequence_Fast_GET_ITEM(fast.ptr(), i);
  }
  plan->keepalive.push_back(fast);
  Walk walk(contract_, fast, *plan);
  plan->root = walk.node(items, "");
  walk.check_all_fields_seen();
  if (plan->root->text) {
    // default_collate returns a batch of strings as it got it: the same object, be it a list, a tuple or
    // a numpy array of str, bytes or objects.
    plan->root->ready = py::reinterpret_borrow<py::object>(samples);
  }
  return plan;
}

}  // namespace fastcollate
