// A copy-engine transfer's flagged pieces (kernels::FlaggedPiece: a dispatch's broadcast, a
// combine's return) as one CUDA graph made with the buffer and updated for each call: their ~8 copy
// calls cost the host ~35-40 us (docs/performance.md, "Copies cost per call"), a node's update ~1
// us. The pieces form one chain in the calls' order (each piece's rows, then its flag), so each flag
// still follows its rows. Off unless EPX_PIECE_COPIES=graph (not yet measured at two ranks).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/kernels/launch.hpp"
#include "cuda/placement_graph.hpp"

namespace epx::detail {

class PieceGraph {
 public:
  // Room for `pieces` pieces of one part each. A node's update may not change the kind of its memory
  // (placement_graph.hpp), plain (cudaMalloc) or mapped (pools, cuMem): the rows come from mapped
  // memory when rows_mapped, the epoch when epoch_mapped, and both go to peers' windows, mapped
  // when window_mapped (NCCL's; the shared GPU's are plain). Made with the buffer, before its window
  // (an instantiation made while a peer's kernel spins can wait for it on a shared GPU,
  // docs/cuda.md): the nodes get their addresses at their launches.
  // Each piece's rows go as `split` copies side by side (EPX_PIECE_SPLIT: the copy engines may take
  // them in parallel), its flag after all of them.
  PieceGraph(int pieces, int split, bool rows_mapped, bool epoch_mapped, bool window_mapped, cudaMemPool_t pool);
  ~PieceGraph();
  PieceGraph(const PieceGraph&) = delete;
  PieceGraph& operator=(const PieceGraph&) = delete;

  // Sets the nodes to `pieces` (the rest do nothing) and launches the chain on `stream`. False, with
  // nothing launched: more pieces than room, a piece of two parts or of rows not packed at either
  // end (a node's update takes one line of bytes), or memory of another kind (the caller makes the
  // copy calls instead).
  bool launch(const std::vector<kernels::FlaggedPiece>& pieces, cudaStream_t stream);

 private:
  struct Node {  // one piece
    std::vector<cudaGraphNode_t> rows;  // its copies
    std::vector<bool> rows_on;          // enabled in exec_
    cudaGraphNode_t flag = nullptr;
    bool flag_on = true;
    char* flag_dst = nullptr;  // the flag copy's operands as set (the same call after call)
    const char* flag_src = nullptr;
  };
  GraphPlaceholders placeholders_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<Node> nodes_;  // the chain's order
};

}  // namespace epx::detail
