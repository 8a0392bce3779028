// The CUDA backend's groups. Ranks are GPUs; the transport is NCCL's symmetric memory
// (device API, NVLink load/store). Include only in builds with EPX_HAS_CUDA.
#pragma once
#include <string>
#include <vector>

#include "epx/group.hpp"
#include "epx/tensor.hpp"

namespace epx {

// True when this build has the CUDA backend and at least one GPU is visible.
bool cuda_available();

// Single-process mode: one rank per GPU in `devices` (default: every visible GPU), NCCL
// communicators made with ncclCommInitAll. Drive rank r from its own host thread.
// shared_gpu(): the test transport, several ranks on one GPU (see docs/cuda.md for its limits).
class CudaWorld {
 public:
  explicit CudaWorld(std::vector<int> devices = {});
  static CudaWorld shared_gpu(int ranks, int device = 0);
  int size() const { return size_; }
  Group group(int rank) const;

 private:
  struct Empty {};
  explicit CudaWorld(Empty) {}
  std::shared_ptr<detail::GroupState> state_;
  int size_ = 0;
};

// Multi-process mode: one process per GPU. Rank 0 makes the id and hands it to the others.
std::string nccl_unique_id();
Group cuda_group_init_rank(const std::string& unique_id, int rank, int size, int device);
// A group over an existing communicator (ncclComm_t passed as void*). The caller keeps it alive.
Group cuda_group_from_comm(void* nccl_comm, int device);

// The GPU that rank drives.
int cuda_device(const Group& group);

// A host copy of a tensor (device tensors are copied; host tensors are returned as they are).
// Call Buffer::synchronize() first: outputs are written on the buffer's stream.
Tensor to_host(const Tensor& t);

}  // namespace epx
