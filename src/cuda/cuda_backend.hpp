// The CUDA backend: the same three steps as the CPU backend (plan exchange, transfer,
// layout), as kernels on one stream, over a symmetric window every rank can write into.
#pragma once
#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/handle.hpp"
#include "core/replicas.hpp"
#include "core/wire.hpp"
#include "cuda/cuda_group.hpp"
#include "cuda/host_steps.hpp"
#include "cuda/kernels/launch.hpp"
#include "cuda/phase_timer.hpp"

namespace epx::detail {

struct DeviceHandle;  // what a dispatch leaves on the device for the calls on its handle (device_handle.hpp)

// A stable hash of a call's options that every rank must pass alike (the plan exchange compares it).
int64_t call_signature(std::initializer_list<int64_t> values);

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
  Tensor expert_load() const override;  // refused: no load counters on this backend yet
  void reset_expert_load() override;
  void set_stream(void* stream) override;
  void synchronize() override;
  void wait_event(void* event) override;
  void record_event(void* event) override;

 private:
  enum CallKind : int32_t { kDispatch = 0, kCombine = 1, kDispatchBackward = 2, kCombineBackward = 3, kCachedDispatch = 4 };
  struct Call {
    CallKind kind;
    int64_t index;
    // Begun on the device by begin_call's kernel: a cached dispatch, whose scan of x reports into
    // the status before its plan exchange. A dispatch begins in its plan kernel's first block, the
    // other calls on a handle in their plan exchange's single block (or their rejection's post):
    // their first launch.
    bool begun_on_device;
    // Where this call's plans are (kernels find them from the device's call number; the host
    // needs them only to read a peer's rejection message).
    int plan_slot(int phase) const { return static_cast<int>(index % 2) * 2 + phase; }
    // The call as messages name it ("dispatch #3"), made only for a message. `unsynced_before`:
    // it is the call before call index + 1, which ran without a host sync.
    bool unsynced_before = false;
    std::string name() const;
  };

  void choose_paths(const CudaGroupState& state);  // constructor: the engines and their streams
  Call begin_call(CallKind kind);
  // begin_call's kernel now, for a path whose first launch cannot begin the call itself (a
  // rejected dispatch's broadcast release); nothing if the call has begun on the device.
  void begin_on_device(Call& call);
  kernels::Ctx ctx(cudaStream_t stream = nullptr) const;  // on the call's stream unless given
  // dispatch()'s steps, in the order it takes them.
  // A dispatch's input as the kernels read it, or why it was refused (error).
  struct DispatchRequest {
    std::string error;
    int64_t tokens = 0;
    kernels::RoutingInput routing;
    kernels::SendRows rows;
    kernels::FiniteCheck finite;  // check_finite: scanned beside the routing check
    ReplicaTable replicas;  // EPLB: the call's table (checked and hashed by the plan kernel)
    bool has_weights = false;
    bool has_shared_gate = false;  // given (defined: a [0] gate of an empty rank too)
    std::pair<const float*, int64_t> shared_gate{nullptr, 0};  // the shared expert's gate and its stride
  };
  DispatchRequest read_dispatch(const DispatchInput& in, const DispatchOptions& opt) const;
  // Copy-engine dispatch: the rows the broadcast sends (x itself, or bf16 rows encoded into this
  // rank's window), row_bytes each, stride apart.
  struct BroadcastRows {
    const char* from;
    int64_t stride, row_bytes;
  };
  // The broadcast's start (the copy engines need no plan): its first two pieces on the copy stream.
  BroadcastRows start_broadcast(const kernels::SendRows& rows, int64_t tokens);
  // Pieces [first, end) of the broadcast by copy calls on the copy stream; after the last, copies_done_.
  void enqueue_broadcast(const BroadcastRows& b, int64_t tokens, int64_t first, int64_t end);
  // The handle's arrays, sized for `tokens`, for the plan kernel to write (and zero: zeroed_parts).
  std::shared_ptr<DeviceHandle> make_device_handle(int64_t tokens);
  // The parts of a new handle that start zeroed: the drop rule's sums and the receive arrays.
  struct ZeroedParts {
    kernels::ZeroBytes sums, receive;
  };
  ZeroedParts zeroed_parts(const DeviceHandle& dh) const;
  // The plan kernel(s): routing, the drop rule (with its own plan exchange), the positions and the
  // plan exchange with the receiver's layout. Returns the phase of the last exchange.
  int plan(const Call& call, int64_t signature, const DispatchRequest& rq, DeviceHandle& dh,
           const kernels::LayoutJob& layout, int32_t* chosen);
  // The outputs, one allocation on the call's stream (the transfer writes every row, padding and
  // empty rows too), and their pointers as the transfer kernels take them.
  kernels::RecvOutputs allocate_outputs(DispatchResult& out, const DeviceHandle& dh, Layout layout, int64_t capacity);
  // The transfer: the SM engine's one kernel, or the copy-engine dispatch's placing kernel and
  // receiver (after its broadcast has begun; the call's stream then waits for its copies). Its
  // last block copies the layout words into `layout_copy` and publishes the call's status.
  void transfer(const DispatchRequest& rq, const DeviceHandle& dh, const kernels::RecvOutputs& outputs, Layout layout,
                int phase, const Tensor& layout_copy);
  // Blocking mode's sizes, from the plan's report (the layout's info words, the dropped count, the
  // rank offsets the copy-engine combine cuts by), once plan_ok or a sync has waited for it.
  void take_sizes(DispatchResult& out, HandleState& h) const;
  // The call's end once every kernel is enqueued: small outputs copied from the handle, then
  // capacity mode's return, or blocking mode's sizes (`sizes_read`: read already, with the plan's
  // check, so the call returns without a sync; else one sync now) and the outputs cut to them.
  DispatchResult finish_dispatch(const Call& call, DispatchResult out, std::shared_ptr<DeviceHandle> dh,
                                 std::shared_ptr<HandleState> h, Layout layout, int64_t capacity, bool sizes_read,
                                 std::chrono::steady_clock::time_point host_call);
  void report_dispatch_profile(bool quantized, std::chrono::steady_clock::time_point host_call);
  PlanHeader plan_header(const Call& call, const std::string& error, int64_t tokens, int64_t signature) const;
  // A host-side input error: posts the rejection in each of the call's `phases` plan exchanges
  // (peers wait for every one of them, then stop with this message), then throws it.
  [[noreturn]] void reject(const Call& call, int phases, const std::string& error, int64_t tokens, int64_t signature);
  // The plan exchange of this call's phase (kernels::ExchangeJob): this rank's plan (with count_len
  // counts), every rank's awaited and checked; with expert_prefix (dispatch with dropping) also the
  // lower ranks' per-expert prefix and the drop capacity; with a layout job (a dispatch's last
  // exchange), the receiver's layout. In blocking mode the call's last exchange (not the drop
  // rule's) also writes plan_report_; exchanged() then records plan_done_, for plan_ok.
  kernels::ExchangeJob exchange_job(const Call& call, int phase, int64_t tokens, int64_t signature,
                                    const int64_t* counts, int64_t count_len, int64_t* expert_prefix = nullptr,
                                    int64_t* drop_capacity = nullptr, const kernels::LayoutJob* layout = nullptr,
                                    const int64_t* dropped = nullptr) const;
  void exchanged(const kernels::ExchangeJob& job);  // after the launch that runs it
  // The header-only exchange of the calls on a handle, in a launch of its own.
  void exchange_plan(const Call& call, int64_t tokens, int64_t signature);
  // The start of a call on a dispatch's handle (combine and the backward passes): the handle and
  // the inputs are checked (a rejection reaches every peer), then the plan exchange, whose
  // signature holds `options` and the handle's layout.
  const HandleState& start_handle_call(const Call& call, const Handle& handle, int64_t options,
                                       const std::function<void(const HandleState&)>& validate);
  bool start_copy_return(const HandleState& h, const TensorView& rows, const TensorView& slot_values,
                         kernels::CombineArgs& a, std::vector<Tensor>& staging);
  // After the kernels of a copy-engine return: the call's stream waits for its copies (their rows
  // are read until then), if it made any.
  void join_copy_return();
  // This rank's signal counters as read now, for a timeout's message.
  std::string signals_now() const;
  // Publishes the device status, then sync_and_raise.
  void sync_and_check(const Call& call);
  // Synchronizes the stream and throws what the published status says.
  void sync_and_raise(const Call& call);
  // Blocking mode's one host read: waits for the call's plan exchange (plan_done_, not the work
  // queued after it) and reads its report: true when the device found nothing so far (every peer
  // arrived and agreed, the routing is good) and no earlier call published a finding. Then the
  // call ends with end_call's publish and no sync; a finding makes it run on and raise at its end.
  // The calls on a handle queue their transfer first (its kernels skip a failed call), so the GPU
  // does not wait for the host's read.
  bool plan_ok();
  // The copy-engine return cannot skip a failed call as the kernels do: where it copies rows to other
  // ranks (blocking, copy_combine_, more than one rank), combine and dispatch_backward read the plan
  // first and copy nothing after a failed one (a peer late in its previous call may still read the
  // rows the copies would overwrite).
  bool copies_wait_for_plan() const;
  // The end of a call: plan_failed (what plan_ok found) syncs and raises; otherwise the status goes
  // to host-mapped memory, raised by the next call (what the transfer kernels found: a lost peer).
  // `published`: the call's last kernel published the status already.
  void end_call(const Call& call, bool plan_failed, bool published = false);
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
  // recv_x, recv_scales and recv_global_scale of `capacity` rows in this buffer's wire format.
  void add_row_outputs(OutputBlock& outputs, DispatchResult& out, int64_t capacity) const;
  const HandleState& state_of(const Handle& h, const Call& call) const;
  void check_device_tensor(const TensorView& t, std::string_view what) const;

  int rank_, ranks_, device_;
  int blocks_ = 0;       // the SM budget: blocks of the data-moving kernels
  int plan_warps_ = 0;   // warps of a plan block that count chunks (kernels::plan_chunk_warps)
  // Of the blocks, those that send (the rest receive or reduce) in a dispatch or a combine.
  int send_blocks(bool dispatch, Layout layout) const;
  // Of the blocks of a combine or dispatch_backward, those that return rows (none when the copy
  // engines return them, or at one rank with this rank's own rows read in place).
  int return_blocks(bool by_copy, bool own_in_place, Layout layout) const;
  // Of the blocks of combine_backward's and cached_dispatch's transfer, those that send (none at
  // one rank: the expanders read this rank's rows from the input).
  int expand_senders(Layout layout) const;
  bool poison_outputs_ = false;  // EPX_POISON_OUTPUTS: fill outputs with 0xa5 first (tests)
  ReplicaShape replicas_;   // EPLB's E, P and W (P = E without it)
  int64_t local_experts_;   // L = P / R, the physical experts of each rank
  WireRow wire_;
  std::chrono::milliseconds timeout_{60000};  // every wait on a peer (set in the constructor)
  WindowMap map_{};
  std::unique_ptr<SymmetricWindow> window_;
  DeviceStatus* status_ = nullptr;       // device
  CallState* call_state_ = nullptr;      // device: call number and signal targets (advanced by kernels)
  DeviceStatus* host_status_ = nullptr;  // host-mapped copy, published at the end of every call
  PlanReport* plan_report_ = nullptr;    // host-mapped: blocking mode's plan status and sizes (plan_ok)
  int64_t* scratch_ = nullptr;           // device: the drop capacity calls other than dispatch ignore
  int64_t* load_ = nullptr;              // device [L]: expert_load's counters (the layout kernel adds to them)
  int32_t* replica_seen_ = nullptr;      // device [P] with EPLB: the table check's scratch (ReplicaTable::seen)
  // The stream of every call: the buffer's own non-blocking stream (kept alive by every tensor
  // allocated on it, so outputs may outlive the buffer) or one the caller set.
  std::shared_ptr<CUstream_st> owned_stream_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  // copy-engine dispatch and combine (made only for them)
  cudaEvent_t fork_ = nullptr, copies_done_ = nullptr;
  cudaEvent_t plan_done_ = nullptr;  // blocking mode: the call's last plan exchange (and its report) is done
  cudaEvent_t broadcast_begun_ = nullptr;  // copy-engine dispatch: the peers' regions are free
  bool broadcast_ = false;  // dispatch moves its rows by copy engine (kernels/broadcast.cu)
  bool copies_in_flight_ = false;  // start_copy_return queued copies that join_copy_return waits for
  bool copy_combine_ = false;  // blocking combine and dispatch_backward return their rows by copy engine
  std::shared_ptr<CUmemPoolHandle_st> pool_;  // outputs and handles; kept alive by every tensor from it
  // Dispatch output blocks whose tensors are gone, for the next dispatch: a pool allocation
  // costs tens of microseconds of host time (docs/lab/2026-12-01-performance-diary.md).
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
  std::string own_rejection_;  // capacity mode: this rank's last host-side refusal, raised again by its next call
};

}  // namespace epx::detail
