#include "cuda/placement_graph.hpp"

#include "cuda/cuda_check.hpp"

namespace epx::detail {

GraphPlaceholders::GraphPlaceholders(cudaMemPool_t pool) {
  EPX_CUDA(cudaMalloc(&plain_, 2 * kBytes));
  cudaStream_t stream = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EPX_CUDA(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&mapped_), 2 * kBytes, pool, stream));
  EPX_CUDA(cudaStreamSynchronize(stream));
  EPX_CUDA(cudaStreamDestroy(stream));
}

GraphPlaceholders::~GraphPlaceholders() {
  if (plain_) cudaFree(plain_);
  if (mapped_) cudaFreeAsync(mapped_, cudaStreamPerThread);
}

bool update_copy_node(cudaGraphExec_t exec, cudaGraphNode_t node, char* dst, const char* src, size_t bytes) {
  const cudaError_t e = cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, bytes, cudaMemcpyDeviceToDevice);
  if (e != cudaErrorInvalidValue) EPX_CUDA(e);
  (void)cudaGetLastError();  // a refusal is not sticky, but leaves the last error set
  return e == cudaSuccess;
}

bool set_node_enabled(cudaGraphExec_t exec, cudaGraphNode_t node, bool on, bool was_on) {
  if (on != was_on) EPX_CUDA(cudaGraphNodeSetEnabled(exec, node, on ? 1 : 0));
  return on;
}

PlacementGraph::PlacementGraph(int stages, int slots, cudaMemPool_t pool, bool src_mapped)
    : slots_(slots), placeholders_(pool), enabled_(static_cast<size_t>(stages) * slots, false), pending_(stages),
      gates_(stages), gates_set_(stages) {
  // The placeholder copy's memory decides which memory the nodes may copy later: to the outputs
  // (pool memory), from plain or mapped memory.
  char* dst = placeholders_.dst(true);
  const char* src = placeholders_.src(src_mapped);
  EPX_CUDA(cudaGraphCreate(&graph_, 0));
  // Every stage has its gate, waiting or not: behind a kernel node, disabled copy nodes cost the
  // launch ~0.25 us each; as roots or behind an empty node ~1.2 us (measured, 32 of them: 9 / 40 us).
  cudaGraphNode_t previous_gate = nullptr;
  for (int stage = 0; stage < stages; ++stage) {
    previous_gate =
        kernels::add_wait_peer_flags_node(graph_, previous_gate ? &previous_gate : nullptr, previous_gate ? 1 : 0);
    gate_nodes_.push_back(previous_gate);
    for (int i = 0; i < slots; ++i) {
      cudaGraphNode_t copy = nullptr;
      EPX_CUDA(cudaGraphAddMemcpyNode1D(&copy, graph_, &previous_gate, 1, dst, src, GraphPlaceholders::kBytes,
                                        cudaMemcpyDeviceToDevice));
      copy_nodes_.push_back(copy);
    }
  }
  EPX_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
  for (cudaGraphNode_t copy : copy_nodes_) EPX_CUDA(cudaGraphNodeSetEnabled(exec_, copy, 0));
}

PlacementGraph::~PlacementGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
}

bool PlacementGraph::add(int stage, char* dst, int64_t dst_pitch, const char* src, int64_t src_pitch,
                         int64_t row_bytes, int64_t rows) {
  auto& stage_copies = pending_.at(static_cast<size_t>(stage));
  // A node's update takes one line of bytes only (cudaGraphExecMemcpyNodeSetParams1D): packed rows.
  if (src_pitch != row_bytes || dst_pitch != row_bytes || stage_copies.size() == static_cast<size_t>(slots_))
    return false;
  stage_copies.push_back(Copy{dst, src, static_cast<size_t>(row_bytes * rows)});
  return true;
}

void PlacementGraph::gate(int stage, int64_t flags, int64_t stride, uint32_t peers) {
  gates_.at(static_cast<size_t>(stage)) = Gate{flags, stride, peers, true};
}

size_t PlacementGraph::launch(const kernels::Ctx& ctx) {
  std::vector<Copy> refused;  // memory of another kind than the placeholder's: by copy calls after the graph
  for (size_t stage = 0; stage < pending_.size(); ++stage) {
    for (size_t i = 0; i < static_cast<size_t>(slots_); ++i) {
      const size_t k = stage * slots_ + i;
      bool used = i < pending_[stage].size();
      if (used) {
        const Copy& c = pending_[stage][i];
        if (!update_copy_node(exec_, copy_nodes_[k], c.dst, c.src, c.bytes)) {
          refused.push_back(c);
          used = false;
        }
      }
      enabled_[k] = set_node_enabled(exec_, copy_nodes_[k], used, enabled_[k]);
    }
    pending_[stage].clear();
    // A node's arguments change only with the gate (the buffer's windows and state stay).
    const Gate want = gates_[stage].set ? gates_[stage] : Gate{0, 0, 0u, true};
    const Gate& in_exec = gates_set_[stage];
    if (!in_exec.set || in_exec.flags != want.flags || in_exec.stride != want.stride || in_exec.peers != want.peers) {
      kernels::set_wait_peer_flags_node(exec_, gate_nodes_[stage], ctx, want.flags, want.stride, want.peers);
      gates_set_[stage] = want;
    }
    gates_[stage] = Gate{};
  }
  EPX_CUDA(cudaGraphLaunch(exec_, ctx.stream));
  for (const Copy& c : refused)  // after the whole graph, so after every gate
    EPX_CUDA(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, ctx.stream));
  return refused.size();
}

}  // namespace epx::detail
