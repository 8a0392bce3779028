// Buffers are destroyed with the GIL released: a CUDA buffer's destructor may wait for its peers
// (on the shared GPU, until every rank released the window), and those may be threads of this
// process that need the GIL to get there.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

namespace epx::python {

template <typename T>
struct DeleteWithoutGil {
  void operator()(T* p) const {
    if (p && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  }
};

template <typename T>
using HolderWithoutGil = std::unique_ptr<T, DeleteWithoutGil<T>>;

}  // namespace epx::python
