// The CUDA backend: the same three steps as the CPU backend (plan exchange, transfer,
// layout), as kernels on one stream, over a symmetric window every rank can write into.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/handle.hpp"
#include "core/wire.hpp"
#include "cuda/piece_graph.hpp"
#include "cuda/copy_cuts.hpp"
#include "cuda/cuda_group.hpp"
#include "cuda/host_steps.hpp"
#include "cuda/kernels/launch.hpp"
#include "cuda/phase_timer.hpp"
#include "cuda/placement_graph.hpp"

namespace epx::detail {

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Group& group, const BufferConfig& config);  // collective
  ~CudaBackend() override;

  DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& opt) override;
  DispatchResult cached_dispatch(const DispatchInput& in, const Handle& h, const CachedDispatchOptions& opt) override;
  CombineResult combine(const CombineInput& in, const Handle& h, const CombineOptions& opt) override;
  DispatchBackwardResult dispatch_backward(const DispatchBackwardInput& in, const Handle& h) override;
  CombineBackwardResult combine_backward(const CombineBackwardInput& in, const Handle& h,
                                         const CombineOptions& opt) override;
  [[noreturn]] void reject(Op op, const std::string& reason) override;
  void set_stream(void* stream) override;
  void synchronize() override;
  void wait_event(void* event) override;
  void record_event(void* event) override;

 private:
  enum CallKind : int32_t { kDispatch = 0, kCombine = 1, kDispatchBackward = 2, kCombineBackward = 3, kCachedDispatch = 4 };
  struct Call {
    CallKind kind;
    int64_t index;
    std::string name;  // "dispatch #3"
    // Where this call's plans are (kernels find them from the device's call number; the host
    // needs them only to read a peer's rejection message).
    int plan_slot(int phase) const { return static_cast<int>(index % 2) * 2 + phase; }
  };

  void choose_paths(const CudaGroupState& state);  // constructor: the paths and their streams
  Call begin_call(CallKind kind);
  kernels::Ctx ctx(cudaStream_t stream = nullptr) const;  // on the call's stream unless given
  void report_dispatch_profile(bool quantized, std::chrono::steady_clock::time_point host_call);
  PlanHeader plan_header(const Call& call, const std::string& error, int64_t tokens, int64_t signature) const;
  // A host-side input error: posts the rejection in each of the call's `phases` plan exchanges
  // (peers wait for every one of them, then stop with this message), then throws it.
  [[noreturn]] void reject(const Call& call, int phases, const std::string& error, int64_t tokens, int64_t signature);
  // Posts the plan (with count_len counts) in this call's phase, waits for every rank and
  // checks their plans; with expert_prefix (dispatch with dropping) also fills the lower
  // ranks' per-expert prefix and the drop capacity.
  // With a layout job (a dispatch's last exchange), the same kernel computes the receiver's layout.
  void exchange_plan(const Call& call, int phase, int64_t tokens, int64_t signature, const int64_t* counts,
                     int64_t count_len, int64_t* expert_prefix = nullptr, int64_t* drop_capacity = nullptr,
                     const kernels::LayoutJob* layout = nullptr);
  // The start of a call on a dispatch's handle (combine and the backward passes): the handle and
  // the inputs are checked (a rejection reaches every peer), then the plan exchange, whose
  // signature holds `options` and the handle's layout.
  const HandleState& start_handle_call(const Call& call, const Handle& handle, int64_t options,
                                       const std::function<void(const HandleState&)>& validate);
  bool start_copy_return(const HandleState& h, const TensorView& rows, const TensorView& slot_values,
                         kernels::CombineArgs& a, std::vector<Tensor>& staging);
  // Waits for the forward / reverse transfer of this call.
  void wait(int kind);
  // This rank's signal counters as read now, for a timeout's message.
  std::string signals_now() const;
  // Reads the device status (synchronizing the stream) and throws what it says.
  void sync_and_check(const Call& call);
  // Throws if an earlier call that ran without a host sync failed.
  void check_earlier_calls(const Call& call);
  [[noreturn]] void raise(const DeviceStatus& st, const Call& call);

  // Frees stream-ordered on the current stream, keeping the buffer's own stream alive.
  std::function<void(void*)> stream_deleter() const;
  // Stream-ordered device memory: the buffer's pool, or a graph memory node while `stream` is captured.
  void* allocate(size_t bytes, cudaStream_t stream, bool capturing);
  static bool capturing(cudaStream_t stream);
  // From the buffer's pool, stream-ordered on `stream` (the call's stream if null).
  Tensor device_tensor(DType dtype, std::initializer_list<int64_t> shape, cudaStream_t stream = nullptr);
  // Several outputs carved from one pool allocation (one allocation call per dispatch).
  class OutputBlock {
   public:
    OutputBlock(CudaBackend& backend, cudaStream_t stream);
    void add(Tensor* target, DType dtype, std::initializer_list<int64_t> shape);  // filled by allocate()
    void allocate();

   private:
    struct Part {
      Tensor* target;
      TensorView view;
      int64_t offset;
    };
    CudaBackend& backend_;
    cudaStream_t stream_;
    std::vector<Part> parts_;
    int64_t bytes_ = 0;
  };
  const HandleState& state_of(const Handle& h, const Call& call) const;
  void check_device_tensor(const TensorView& t, std::string_view what) const;

  int rank_, ranks_, device_;
  int blocks_ = 0;       // the SM budget: blocks of the data-moving kernels
  int send_blocks_override_ = 0;  // EPX_SEND_BLOCKS
  // Of the blocks, those that send (the rest receive or reduce) in a dispatch or a combine.
  int send_blocks(bool dispatch, Layout layout) const;
  bool poison_outputs_ = false;  // EPX_POISON_OUTPUTS: fill outputs with 0xa5 first (tests)
  int64_t local_experts_;
  WireRow wire_;
  std::chrono::milliseconds timeout_{60000};  // every wait on a peer (set in the constructor)
  WindowMap map_{};
  std::unique_ptr<SymmetricWindow> window_;
  DeviceStatus* status_ = nullptr;       // device
  CallState* call_state_ = nullptr;      // device: call number and signal targets (advanced by kernels)
  DeviceStatus* host_status_ = nullptr;  // host-mapped copy, published at the end of every call
  int64_t* host_info_ = nullptr;         // pinned: sizes read back in blocking mode
  int64_t* scratch_ = nullptr;           // device: the drop capacity calls other than dispatch ignore
  // The stream of every call: the buffer's own non-blocking stream (kept alive by every tensor
  // allocated on it, so outputs may outlive the buffer) or one the caller set.
  std::shared_ptr<CUstream_st> owned_stream_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // dispatch's receiver, beside the senders on stream_
  cudaStream_t copy_stream_ = nullptr;  // copy-engine dispatch and combine (made only for them)
  cudaEvent_t fork_ = nullptr, join_ = nullptr, copies_done_ = nullptr;
  cudaEvent_t broadcast_begun_ = nullptr;  // copy-engine dispatch: the peers' regions are free
  // EPX_PIECE_COPIES=graph: the broadcast's and the combine's return pieces as graphs
  // (piece_graph.hpp), one per memory kind of the rows (plain, mapped).
  struct PieceGraphs {
    std::unique_ptr<PieceGraph> of_kind[2];
    int last = 0;  // the kind that served last
  };
  PieceGraphs broadcast_graphs_, return_graphs_;
  bool piece_graphs_ = false;  // EPX_PIECE_COPIES=graph
  int piece_split_ = 1;         // EPX_PIECE_SPLIT
  bool place_graphs_ = true;    // EPX_PLACE_COPIES (graph unless "calls")
  bool by_graph(PieceGraphs& graphs, const std::vector<kernels::FlaggedPiece>& pieces, cudaStream_t stream);
  bool broadcast_ = false;  // dispatch moves its rows by copy engine (kernels/broadcast.cu)
  bool early_receiver_ = false;  // EPX_RECEIVER_START=early: a broadcast's receiver goes before the plan (dispatch())
  bool copy_combine_ = false;  // blocking combine and dispatch_backward return their rows by copy engine
  // EPX_ENCODE=pieces: a quantized copy-engine dispatch encodes its rows on the side stream, and
  // each piece's copies wait on the device for that piece's rows only (encode_rows' piece flags).
  bool piece_encode_ = false;
  // EPX_OWN_ROWS=copies: a blocking rank-major bf16 copy-engine dispatch places this rank's own rows
  // by copy engine, in runs read back from the positions (place_own_rows(), dispatch()).
  bool own_copies_ = false;
  // EPX_PEER_ROWS=copies: the same dispatch places the other ranks' rows by copy engine too, from
  // bcast_rows, piece by piece, in runs read back from their placing data (place_peer_rows()).
  bool peer_copies_ = false;
  cudaStream_t place_stream_ = nullptr;  // own and peer rows' copies
  cudaEvent_t positions_ready_ = nullptr, outputs_ready_ = nullptr, own_placed_ = nullptr;
  cudaEvent_t layout_ready_ = nullptr;  // peer rows: the plan kernel has written the layout
  int32_t* host_pos_ = nullptr;  // pinned: [max_tokens][R] positions
  int32_t* host_peer_pos_ = nullptr;  // pinned: [R][max_tokens][R] the sources' positions (meta_pos)
  int64_t* host_layout_ = nullptr;    // pinned: rank_offsets [R+1], then chunks_from [R] (int32)
  // The placing copies as graphs updated per call (placement_graph.hpp), unless
  // EPX_PLACE_COPIES=calls (copy calls, for A/B runs): own rows (one stage), peer rows (a stage per piece).
  std::unique_ptr<PlacementGraph> own_graph_, peer_graph_;
  int peer_pieces() const {
    return static_cast<int>((config().max_tokens_per_rank + map_.piece_tokens - 1) / map_.piece_tokens);
  }
  struct RunJob {  // runs of one source's rows, all in one stage
    int stage;
    const char* from;
    int64_t from_stride;
    std::vector<RowRun> runs;
  };
  void place_runs(PlacementGraph* graph, const std::vector<RunJob>& jobs, const std::vector<uint32_t>& gates,
                  int64_t gate_flags, int64_t gate_stride, char* to, int64_t row_bytes);
  void place_own_rows(const int32_t* send_pos, int64_t tokens, int64_t anchor, int64_t capacity,
                      const kernels::SendRows& rows, char* recv_x, int64_t row_bytes);
  void place_peer_rows(const kernels::RecvArrays& layout, int64_t own_anchor, int64_t capacity, char* recv_x,
                       int64_t row_bytes);
  std::shared_ptr<CUmemPoolHandle_st> pool_;  // outputs and handles; kept alive by every tensor from it
  // Dispatch output blocks whose tensors are gone, for the next dispatch: a pool allocation
  // costs tens of microseconds of host time (docs/performance.md).
  struct BlockCache {
    std::mutex mutex;
    std::vector<std::pair<void*, size_t>> blocks;
    ~BlockCache() {  // blocks released while the buffer was going
      for (const auto& block : blocks) cudaFreeAsync(block.first, cudaStreamPerThread);
    }
  };
  std::shared_ptr<BlockCache> block_cache_ = std::make_shared<BlockCache>();
  // A block of at least `bytes` on `stream`: a cached one if one fits, else from the pool.
  Tensor output_block(int64_t bytes, cudaStream_t stream);
  PhaseTimer timer_;  // EPX_PROFILE
  HostSteps host_steps_;  // the current call's host steps, for timeout messages
  int64_t calls_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace epx::detail
