#include "cuda/broadcast_graph.hpp"

#include <algorithm>

#include "cuda/cuda_check.hpp"

namespace epx::detail {

namespace {

constexpr size_t kPlaceholder = 16;  // bytes of the placeholder copies

}  // namespace

BroadcastGraph::BroadcastGraph(int pieces, int destinations, bool src_mapped, cudaMemPool_t pool) {
  cudaStream_t stream = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EPX_CUDA(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&pool_scratch_), 2 * kPlaceholder, pool, stream));
  EPX_CUDA(cudaStreamSynchronize(stream));
  EPX_CUDA(cudaStreamDestroy(stream));
  EPX_CUDA(cudaMalloc(&scratch_, kPlaceholder));
  // Placeholders of the kinds the calls pass: rows from x (plain or mapped) into a peer's window
  // (mapped), the epoch from this rank's window into a peer's (mapped to mapped).
  char* mapped_dst = pool_scratch_;
  const char* rows_src = src_mapped ? pool_scratch_ + kPlaceholder : scratch_;
  EPX_CUDA(cudaGraphCreate(&graph_, 0));
  cudaGraphNode_t last = nullptr;
  for (int n = 0; n < pieces * destinations; ++n) {
    Node node;
    EPX_CUDA(cudaGraphAddMemcpyNode1D(&node.rows, graph_, last ? &last : nullptr, last ? 1 : 0, mapped_dst, rows_src,
                                      kPlaceholder, cudaMemcpyDeviceToDevice));
    EPX_CUDA(cudaGraphAddMemcpyNode1D(&node.flag, graph_, &node.rows, 1, mapped_dst, pool_scratch_ + kPlaceholder,
                                      sizeof(uint32_t), cudaMemcpyDeviceToDevice));
    last = node.flag;
    nodes_.push_back(node);
  }
  EPX_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
}

BroadcastGraph::~BroadcastGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
  if (scratch_) cudaFree(scratch_);
  if (pool_scratch_) cudaFreeAsync(pool_scratch_, cudaStreamPerThread);
}

// A node's update; false when the memory is of another kind than its placeholder's.
static bool set_copy(cudaGraphExec_t exec, cudaGraphNode_t node, char* dst, const char* src, size_t bytes) {
  const cudaError_t e = cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, bytes, cudaMemcpyDeviceToDevice);
  if (e != cudaErrorInvalidValue) EPX_CUDA(e);
  (void)cudaGetLastError();
  return e == cudaSuccess;
}

bool BroadcastGraph::launch(const kernels::Ctx& ctx, const char* x, int64_t x_stride, int64_t row_bytes,
                            int64_t tokens, cudaStream_t stream) {
  const PeerWindows& w = ctx.peers;
  const WindowMap& m = ctx.map;
  if (x_stride != row_bytes || m.bcast_stride != row_bytes) return false;  // a node's update takes one line
  const char* epoch = w.base[w.rank] + m.bcast_epoch_src;
  size_t n = 0;  // the chain's order, as kernels::broadcast_rows copies: piece by piece, each to every rank
  for (int64_t piece = 0, first = 0; n < nodes_.size(); ++piece, first += m.piece_tokens)
    for (int k = 1; k < w.ranks; ++k, ++n) {
      Node& node = nodes_[n];
      const int d = (w.rank + k) % w.ranks;
      const int64_t rows = std::min(m.piece_tokens, tokens - first);
      const bool used = rows > 0;
      if (used) {
        char* dst = w.base[d] + m.bcast_rows + (w.rank * ctx.shape.max_tokens + first) * m.bcast_stride;
        if (!set_copy(exec_, node.rows, dst, x + first * x_stride, static_cast<size_t>(rows * row_bytes))) return false;
        if (!node.flag_set) {  // the same every call
          char* flag = w.base[d] + m.bcast_flag + (w.rank * kMaxPieces + piece) * sizeof(uint32_t);
          if (!set_copy(exec_, node.flag, flag, epoch, sizeof(uint32_t))) return false;
          node.flag_set = true;
        }
      }
      if (used != node.enabled) {  // pieces past the rows are neither copied nor flagged, as by the calls
        EPX_CUDA(cudaGraphNodeSetEnabled(exec_, node.rows, used ? 1 : 0));
        EPX_CUDA(cudaGraphNodeSetEnabled(exec_, node.flag, used ? 1 : 0));
        node.enabled = used;
      }
    }
  EPX_CUDA(cudaGraphLaunch(exec_, stream));
  return true;
}

}  // namespace epx::detail
