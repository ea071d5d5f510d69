#include "collate/python_refs.h"

#include <pybind11/gil_safe_call_once.h>

namespace fastcollate {

const PythonRefs& python_refs() {
  // Initialised once even when two threads collate first at the same time: a plain function-local
  // static would deadlock if its initialiser (which imports) gave up the GIL while another thread
  // waited on the static's guard holding it. Never destroyed: it must outlive the interpreter.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<PythonRefs*> storage;
  return *storage
              .call_once_and_store_result([] {
                auto* refs = new PythonRefs();
                py::module_ errors = py::module_::import("fastcollate.collate.errors");
                py::module_ tree = py::module_::import("fastcollate.structure.tree");
                py::module_ torch = py::module_::import("torch");
                py::module_ abc = py::module_::import("collections.abc");
                py::module_ numpy = py::module_::import("numpy");
                refs->make_error = errors.attr("make_error");
                refs->error_kind = errors.attr("kind_of");
                refs->rebuild_mapping = tree.attr("rebuild_mapping");
                refs->rebuild_sequence = tree.attr("rebuild_sequence");
                refs->default_collate = py::module_::import("fastcollate._native_support").attr("default_collate");
                refs->as_tensor = torch.attr("as_tensor");
                refs->tensor_from_list = torch.attr("tensor");
                refs->float64 = torch.attr("float64");
                refs->mapping_abc = abc.attr("Mapping");
                refs->sequence_abc = abc.attr("Sequence");
                refs->ndarray = numpy.attr("ndarray");
                refs->numpy_generic = numpy.attr("generic");
                refs->numpy_number = numpy.attr("number");
                refs->numpy_bool = numpy.attr("bool_");
                return refs;
              })
              .get_stored();
}

bool is_instance(PyObject* obj, const py::object& type) {
  const int result = PyObject_IsInstance(obj, type.ptr());
  if (result < 0) {
    throw py::error_already_set();
  }
  return result == 1;
}

std::string type_name(PyObject* obj) {
  return Py_TYPE(obj)->tp_name;
}

}  // namespace fastcollate
