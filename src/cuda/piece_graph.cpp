#include "cuda/piece_graph.hpp"

#include <algorithm>

#include "cuda/cuda_check.hpp"

namespace epx::detail {

PieceGraph::PieceGraph(int pieces, int split, bool rows_mapped, bool epoch_mapped, bool window_mapped,
                       cudaMemPool_t pool)
    : placeholders_(pool) {
  char* const window = placeholders_.dst(window_mapped);
  EPX_CUDA(cudaGraphCreate(&graph_, 0));
  cudaGraphNode_t last = nullptr;
  for (int n = 0; n < pieces; ++n) {
    Node node;
    for (int i = 0; i < split; ++i) {  // side by side, each after the previous piece's flag
      cudaGraphNode_t rows = nullptr;
      EPX_CUDA(cudaGraphAddMemcpyNode1D(&rows, graph_, last ? &last : nullptr, last ? 1 : 0, window,
                                        placeholders_.src(rows_mapped), GraphPlaceholders::kBytes,
                                        cudaMemcpyDeviceToDevice));
      node.rows.push_back(rows);
      node.rows_on.push_back(true);
    }
    EPX_CUDA(cudaGraphAddMemcpyNode1D(&node.flag, graph_, node.rows.data(), node.rows.size(), window,
                                      placeholders_.src(epoch_mapped), sizeof(uint32_t), cudaMemcpyDeviceToDevice));
    last = node.flag;
    nodes_.push_back(node);
  }
  EPX_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
}

PieceGraph::~PieceGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
}

bool PieceGraph::launch(const std::vector<kernels::FlaggedPiece>& pieces, cudaStream_t stream) {
  if (pieces.size() > nodes_.size()) return false;
  for (const kernels::FlaggedPiece& p : pieces)
    if (p.parts != 1 || p.part[0].dst_stride != p.part[0].row_bytes || p.part[0].src_stride != p.part[0].row_bytes)
      return false;
  for (size_t n = 0; n < nodes_.size(); ++n) {
    Node& node = nodes_[n];
    const bool used = n < pieces.size();
    const int64_t rows = used ? pieces[n].part[0].rows : 0, split = static_cast<int64_t>(node.rows.size());
    const int64_t per_copy = (rows + split - 1) / split;  // the piece's rows cut in `split` copies
    for (int64_t i = 0; i < split; ++i) {
      const int64_t first = i * per_copy, count = std::min(rows, first + per_copy) - first;
      if (count > 0) {
        const kernels::FlaggedPiece::Part& c = pieces[n].part[0];
        if (!update_copy_node(exec_, node.rows[i], c.dst + first * c.row_bytes, c.src + first * c.row_bytes,
                              static_cast<size_t>(count * c.row_bytes)))
          return false;
      }
      // A piece of fewer rows than copies leaves some idle.
      node.rows_on[i] = set_node_enabled(exec_, node.rows[i], count > 0, node.rows_on[i]);
    }
    if (used && (node.flag_dst != pieces[n].flag || node.flag_src != pieces[n].epoch)) {
      if (!update_copy_node(exec_, node.flag, pieces[n].flag, pieces[n].epoch, sizeof(uint32_t))) return false;
      node.flag_dst = pieces[n].flag;
      node.flag_src = pieces[n].epoch;
    }
    node.flag_on = set_node_enabled(exec_, node.flag, used, node.flag_on);  // the chain's unused end: no flag
  }
  EPX_CUDA(cudaGraphLaunch(exec_, stream));
  return true;
}

}  // namespace epx::detail
