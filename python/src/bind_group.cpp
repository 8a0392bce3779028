// Groups: the CPU backend's threads, and (CUDA builds) GPUs in one process, the shared-GPU test
// transport and one process per GPU over NCCL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "module.hpp"
#ifdef EPX_HAS_CUDA
#include "epx/cuda.hpp"
#endif

namespace epx::python {

namespace py = pybind11;

namespace {

std::vector<Group> host_world(int ranks) {
  HostWorld world(ranks);  // the groups keep its state
  std::vector<Group> groups;
  for (int r = 0; r < ranks; ++r) groups.push_back(world.group(r));
  return groups;
}

// Every rank's `record`, in rank order (Group::all_gather: collective, over the group's transport).
py::list all_gather(const Group& g, const py::bytes& record, int64_t timeout_ms) {
  const std::string mine = record;
  std::vector<std::string> records;
  {
    py::gil_scoped_release release;  // waits for every rank
    records = g.all_gather(mine, timeout_ms);
  }
  py::list out;
  for (const std::string& r : records) out.append(py::bytes(r));
  return out;
}

#ifdef EPX_HAS_CUDA
std::vector<Group> groups_of(const CudaWorld& world) {
  std::vector<Group> groups;
  for (int r = 0; r < world.size(); ++r) groups.push_back(world.group(r));
  return groups;
}
#else
[[noreturn]] void no_cuda() { throw Error(ErrorCode::unsupported, "this build of epx has no CUDA backend"); }
#endif

}  // namespace

int group_device(const Group& g) {
#ifdef EPX_HAS_CUDA
  if (g.backend() == BackendKind::cuda) return cuda_device(g);
#endif
  (void)g;
  return -1;
}

void bind_group(py::module_& m) {
  py::class_<Group>(m, "Group")
      .def_property_readonly("rank", &Group::rank)
      .def_property_readonly("size", &Group::size)
      .def_property_readonly("backend", [](const Group& g) { return static_cast<int>(g.backend()); })
      .def_property_readonly("device", &group_device, "the GPU this rank drives; -1 on the CPU backend")
      .def("all_gather", &all_gather, py::arg("record"), py::arg("timeout_ms") = 0,
           "every rank's record (bytes, at most 2044), in rank order; collective");

  m.def("host_world", &host_world, py::arg("ranks"));
#ifdef EPX_HAS_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_available", &cuda_available);
  m.def("cuda_world", [](std::vector<int> devices) {
    py::gil_scoped_release release;
    return groups_of(CudaWorld(std::move(devices)));
  });
  m.def("shared_gpu", [](int ranks, int device) {
    py::gil_scoped_release release;
    return groups_of(CudaWorld::shared_gpu(ranks, device));
  });
  m.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); });
  m.def("cuda_group_init_rank", [](const py::bytes& id, int rank, int size, int device) {
    const std::string unique_id = id;
    py::gil_scoped_release release;  // collective: waits for every rank
    return cuda_group_init_rank(unique_id, rank, size, device);
  });
#else
  m.attr("has_cuda") = false;
  m.def("cuda_available", [] { return false; });
  m.def("cuda_world", [](const std::vector<int>&) -> std::vector<Group> { no_cuda(); });
  m.def("shared_gpu", [](int, int) -> std::vector<Group> { no_cuda(); });
  m.def("nccl_unique_id", []() -> py::bytes { no_cuda(); });
  m.def("cuda_group_init_rank", [](const py::bytes&, int, int, int) -> Group { no_cuda(); });
#endif
}

}  // namespace epx::python
