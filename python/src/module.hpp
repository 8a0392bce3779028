// The pieces of the epx._C module, one file each.
#pragma once
#include <pybind11/pybind11.h>

#include "epx/group.hpp"

namespace epx::python {

void bind_group(pybind11::module_& m);
void bind_buffer(pybind11::module_& m);
void bind_low_latency(pybind11::module_& m);

// The GPU a group's rank drives; -1 on the CPU backend.
int group_device(const Group& g);

}  // namespace epx::python
