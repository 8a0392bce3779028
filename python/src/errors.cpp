#include "errors.hpp"


#include "epx/error.hpp"

namespace epx::python {

namespace py = pybind11;

namespace {

// The classes by code, set once by epx/errors.py. Kept as owned raw references, never released:
// an exception may be translated while the interpreter shuts down.
PyObject* classes[8] = {};

void raise_error(const Error& e) {
  const int code = static_cast<int>(e.code());
  PyObject* cls = code >= 0 && code < 8 && classes[code] ? classes[code] : PyExc_RuntimeError;
  PyObject* exc = cls == PyExc_RuntimeError ? PyObject_CallFunction(cls, "s", e.what())
                                            : PyObject_CallFunction(cls, "si", e.what(), code);
  if (!exc) return;  // the constructor's own error is set
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
}

}  // namespace

void bind_errors(py::module_& m) {
  m.def("_set_error_classes", [](const py::dict& by_code) {
    for (auto item : by_code) {
      const int code = item.first.cast<int>();
      if (code < 0 || code >= 8) throw py::value_error("error code out of range");
      Py_XDECREF(classes[code]);
      classes[code] = item.second.ptr();
      Py_INCREF(classes[code]);
    }
  });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });
}

}  // namespace epx::python
