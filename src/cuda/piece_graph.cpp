#include "cuda/piece_graph.hpp"

#include "cuda/cuda_check.hpp"

namespace epx::detail {

namespace {

constexpr size_t kPlaceholder = 16;  // bytes of the placeholder copies

// A node's update; false when the memory is of another kind than its placeholder's.
bool set_copy(cudaGraphExec_t exec, cudaGraphNode_t node, char* dst, const char* src, size_t bytes) {
  const cudaError_t e = cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, bytes, cudaMemcpyDeviceToDevice);
  if (e != cudaErrorInvalidValue) EPX_CUDA(e);
  (void)cudaGetLastError();
  return e == cudaSuccess;
}

}  // namespace

PieceGraph::PieceGraph(int pieces, bool rows_mapped, bool epoch_mapped, cudaMemPool_t pool) {
  cudaStream_t stream = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EPX_CUDA(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&pool_scratch_), 2 * kPlaceholder, pool, stream));
  EPX_CUDA(cudaStreamSynchronize(stream));
  EPX_CUDA(cudaStreamDestroy(stream));
  EPX_CUDA(cudaMalloc(&scratch_, kPlaceholder));
  char* mapped_dst = pool_scratch_;
  const char* mapped_src = pool_scratch_ + kPlaceholder;
  EPX_CUDA(cudaGraphCreate(&graph_, 0));
  cudaGraphNode_t last = nullptr;
  for (int n = 0; n < pieces; ++n) {
    Node node;
    EPX_CUDA(cudaGraphAddMemcpyNode1D(&node.rows, graph_, last ? &last : nullptr, last ? 1 : 0, mapped_dst,
                                      rows_mapped ? mapped_src : scratch_, kPlaceholder, cudaMemcpyDeviceToDevice));
    EPX_CUDA(cudaGraphAddMemcpyNode1D(&node.flag, graph_, &node.rows, 1, mapped_dst, epoch_mapped ? mapped_src : scratch_,
                                      sizeof(uint32_t), cudaMemcpyDeviceToDevice));
    last = node.flag;
    nodes_.push_back(node);
  }
  EPX_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
}

PieceGraph::~PieceGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
  if (scratch_) cudaFree(scratch_);
  if (pool_scratch_) cudaFreeAsync(pool_scratch_, cudaStreamPerThread);
}

bool PieceGraph::launch(const std::vector<kernels::FlaggedPiece>& pieces, cudaStream_t stream) {
  if (pieces.size() > nodes_.size()) return false;
  for (const kernels::FlaggedPiece& p : pieces)
    if (p.parts != 1 || p.part[0].dst_stride != p.part[0].row_bytes || p.part[0].src_stride != p.part[0].row_bytes)
      return false;
  for (size_t n = 0; n < nodes_.size(); ++n) {
    Node& node = nodes_[n];
    const bool used = n < pieces.size();
    if (used) {
      const kernels::FlaggedPiece::Part& c = pieces[n].part[0];
      if (!set_copy(exec_, node.rows, c.dst, c.src, static_cast<size_t>(c.rows * c.row_bytes))) return false;
      if (node.flag_dst != pieces[n].flag || node.flag_src != pieces[n].epoch) {
        if (!set_copy(exec_, node.flag, pieces[n].flag, pieces[n].epoch, sizeof(uint32_t))) return false;
        node.flag_dst = pieces[n].flag;
        node.flag_src = pieces[n].epoch;
      }
    }
    if (used != node.enabled) {  // the chain's unused end: neither copied nor flagged
      EPX_CUDA(cudaGraphNodeSetEnabled(exec_, node.rows, used ? 1 : 0));
      EPX_CUDA(cudaGraphNodeSetEnabled(exec_, node.flag, used ? 1 : 0));
      node.enabled = used;
    }
  }
  EPX_CUDA(cudaGraphLaunch(exec_, stream));
  return true;
}

}  // namespace epx::detail
