// epx._C: the compiled half of the epx Python package (python/epx). It does not link libtorch:
// tensors cross as DLPack capsules, so one build serves every torch version.
#include <pybind11/pybind11.h>

#include "errors.hpp"
#include "module.hpp"

PYBIND11_MODULE(_C, m) {
  m.doc() = "epx: expert-parallel exchange (the compiled module; use the epx package)";
  epx::python::bind_errors(m);
  epx::python::bind_group(m);
  epx::python::bind_buffer(m);
  epx::python::bind_low_latency(m);
}
