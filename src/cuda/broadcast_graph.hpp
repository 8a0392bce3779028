// A copy-engine dispatch's broadcast (kernels::broadcast_rows: each piece of rows to every other
// rank's bcast_rows, then the call's epoch into that piece's flag there) as one CUDA graph made at
// the buffer's first broadcast and updated for each call: its ~8 copy calls cost the host ~35-40 us
// at the start of every dispatch (docs/performance.md, "Copies cost per call"), a node's update ~1
// us. The nodes form one chain in the calls' order, so each flag still follows its piece. Off unless
// EPX_BCAST_COPIES=graph (not yet measured at two ranks).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/kernels/launch.hpp"

namespace epx::detail {

class BroadcastGraph {
 public:
  // `pieces` pieces to `destinations` ranks each; the rows to come from plain (cudaMalloc) memory,
  // or mapped memory (pools, cuMem, this rank's window) when src_mapped: a node's update may not
  // change the kind (placement_graph.hpp). Made with the buffer, before its window (an
  // instantiation made while a peer's kernel spins can wait for it on a shared GPU): the nodes get
  // their windows' addresses at their first launch.
  BroadcastGraph(int pieces, int destinations, bool src_mapped, cudaMemPool_t pool);
  ~BroadcastGraph();
  BroadcastGraph(const BroadcastGraph&) = delete;
  BroadcastGraph& operator=(const BroadcastGraph&) = delete;

  // Sets this call's rows [0, tokens) of x (row_bytes each, x_stride apart) and launches the chain
  // on `stream`. False, with nothing launched: rows not packed here or at the destination
  // (bcast_stride), or memory of another kind (the caller makes the copy calls instead).
  bool launch(const kernels::Ctx& ctx, const char* x, int64_t x_stride, int64_t row_bytes, int64_t tokens,
              cudaStream_t stream);

 private:
  struct Node {  // one piece to one destination
    cudaGraphNode_t rows = nullptr, flag = nullptr;
    bool enabled = true, flag_set = false;
  };
  char* scratch_ = nullptr;       // plain placeholder source
  char* pool_scratch_ = nullptr;  // mapped placeholder destination and source
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<Node> nodes_;  // in the chain's order: piece by piece, each to every destination
};

}  // namespace epx::detail
