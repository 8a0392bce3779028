// epx::Error as Python exceptions: epx/errors.py defines one class per ErrorCode and hands them to
// the module (_C._set_error_classes); every epx::Error leaving a binding is raised as the class of
// its code, carrying the same code and message.
#pragma once
#include <pybind11/pybind11.h>

namespace epx::python {

void bind_errors(pybind11::module_& m);

}  // namespace epx::python
