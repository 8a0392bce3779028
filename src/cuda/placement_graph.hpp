// The copies by which copy engines place a dispatch's rows (EPX_OWN_ROWS, EPX_PEER_ROWS), as one
// CUDA graph instantiated with the buffer and updated for each call. Measured (epx-copy-probe,
// docs/performance.md "Copies cost per call"): a copy call costs the host ~4-5 us whatever its size,
// and copies that follow one another on a stream cost the device ~2-5 us more each (one rank's rows
// as 17 copies: 114 us instead of 31); a memcpy node of an instantiated graph is updated in ~1 us, and
// independent nodes run side by side (17 of them: 54 us).
//
// Stage q holds a gate (a one-warp kernel that waits for piece q of the sources with rows in it, or
// for nothing) and up to `slots` copies that are independent of each other and follow the gate; each
// gate follows the one before, so the stages open in order as the pieces land. A launch runs the
// copies added since the last one (every other copy node is disabled) behind the gates set for it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/kernels/launch.hpp"

namespace epx::detail {

// Placeholder memory for a graph's copy nodes, 16 bytes to copy to and 16 to copy from of each kind:
// plain (cudaMalloc) and mapped (from `pool`). A node made with memory of a kind takes only memory
// of that kind later (below).
class GraphPlaceholders {
 public:
  explicit GraphPlaceholders(cudaMemPool_t pool);
  ~GraphPlaceholders();
  GraphPlaceholders(const GraphPlaceholders&) = delete;
  GraphPlaceholders& operator=(const GraphPlaceholders&) = delete;
  char* dst(bool mapped) const { return mapped ? mapped_ : plain_; }
  const char* src(bool mapped) const { return (mapped ? mapped_ : plain_) + kBytes; }
  static constexpr size_t kBytes = 16;

 private:
  char* plain_ = nullptr;
  char* mapped_ = nullptr;
};

// Gives a 1D copy node of `exec` new operands for its next launches (device to device, the kind of
// every placeholder). False, the node unchanged: memory of another kind than its placeholder's.
bool update_copy_node(cudaGraphExec_t exec, cudaGraphNode_t node, char* dst, const char* src, size_t bytes);
// Enables (on) or disables a node of `exec` that was `was_on`, calling CUDA only when that changes
// (each call costs the host); returns `on`, the node's state now.
bool set_node_enabled(cudaGraphExec_t exec, cudaGraphNode_t node, bool on, bool was_on);

class PlacementGraph {
 public:
  // A node of an instantiated graph may be given only memory of the kinds its copy had at
  // instantiation, plain (cudaMalloc) or mapped (pools, cuMem: NCCL's windows), per operand
  // (measured, docs/performance.md): the placeholder copies to `pool` memory (the outputs) from
  // mapped memory (src_mapped) or plain memory. A copy of other kinds goes by a copy call after the
  // graph.
  PlacementGraph(int stages, int slots, cudaMemPool_t pool, bool src_mapped);
  ~PlacementGraph();
  PlacementGraph(const PlacementGraph&) = delete;
  PlacementGraph& operator=(const PlacementGraph&) = delete;

  // A copy of `rows` rows of `row_bytes` from src (rows src_pitch bytes apart) to dst (dst_pitch
  // apart) in `stage`. False: the stage is full, or the rows are not packed (a node's update takes
  // one line of bytes): the caller copies them some other way.
  bool add(int stage, char* dst, int64_t dst_pitch, const char* src, int64_t src_pitch, int64_t row_bytes, int64_t rows);
  // The stage's gate waits for the uint32 flag at window offset flags + d * stride (elements) of each
  // rank d in `peers`, a bit per rank (0: it waits for nothing).
  void gate(int stage, int64_t flags, int64_t stride, uint32_t peers);
  // Runs on ctx.stream the copies added and the gates set since the last launch (gates not set
  // wait for nothing). Returns how many of the copies went by copy calls instead (their memory's
  // kind, above).
  size_t launch(const kernels::Ctx& ctx);

 private:
  struct Gate {
    int64_t flags = 0, stride = 0;
    uint32_t peers = 0;
    bool set = false;  // its node's arguments are these (none set before the first launch)
  };
  int slots_;
  GraphPlaceholders placeholders_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<cudaGraphNode_t> gate_nodes_, copy_nodes_;  // copy_nodes_[stage * slots + i]
  std::vector<bool> enabled_;                              // copy node enabled in exec_
  struct Copy {
    char* dst;
    const char* src;
    size_t bytes;
  };
  std::vector<std::vector<Copy>> pending_;                 // per stage, since the last launch
  std::vector<Gate> gates_, gates_set_;                    // asked for the next launch; in exec_
};

}  // namespace epx::detail
