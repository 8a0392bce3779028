// CUDA groups: the NCCL transport (symmetric windows of NCCL's device API) and the
// shared-GPU test transport.
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/check.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/stream_pool.hpp"
#include "cuda/cuda_group.hpp"
#include "epx/cuda.hpp"
#include "host/peer_barrier.hpp"
#include "host/thread_all_gather.hpp"

namespace epx {
namespace detail {

void check_nccl_version() {
  int loaded = 0;
  EPX_NCCL(ncclGetVersion(&loaded));
  if (loaded != NCCL_VERSION_CODE)
    fail(ErrorCode::unsupported, "epx was compiled against NCCL ", NCCL_VERSION_CODE, " but NCCL ", loaded,
         " is loaded; the device API differs between releases and kernels would hang. Put the matching "
         "libnccl.so.2 first on the library path (rebuild epx against the NCCL you run)");
}

namespace {

// ---- NCCL transport ----

// Fills bases[p] with rank p's window as mapped here, after an LSA barrier that guarantees
// every rank has registered (and zeroed) its window.
// Every rank is an LSA peer (checked on the host), so world rank p is LSA rank
// p - first_lsa_rank.
__global__ void discover_peers(ncclDevComm dev_comm, ncclWindow_t window, int ranks, int first_lsa_rank, char** bases) {
  ncclLsaBarrierSession<ncclCoopCta> barrier{ncclCoopCta(), dev_comm, ncclTeamTagLsa(), 0};
  barrier.sync(ncclCoopCta(), cuda::memory_order_acquire);
  for (int p = threadIdx.x; p < ranks; p += blockDim.x)
    bases[p] = static_cast<char*>(ncclGetLsaPointer(window, 0, p - first_lsa_rank));
  barrier.sync(ncclCoopCta(), cuda::memory_order_release);
}

class NcclWindow final : public SymmetricWindow {
 public:
  NcclWindow(ncclComm_t comm, int device, size_t bytes) : comm_(comm), device_(device) {
    EPX_CUDA(cudaSetDevice(device));
    int ranks = 0, rank = 0;
    EPX_NCCL(ncclCommCount(comm, &ranks));
    EPX_NCCL(ncclCommUserRank(comm, &rank));
    require(ranks <= kMaxRanks, "cuda group: at most ", kMaxRanks, " ranks, got ", ranks);
    if (ncclTeamLsa(comm).nRanks != ranks)
      fail(ErrorCode::unsupported, "cuda group: ", ranks, " ranks but only ", ncclTeamLsa(comm).nRanks,
           " reachable over NVLink; multi-node (GIN) transport is not built yet");
    EPX_NCCL(ncclMemAlloc(&memory_, bytes));
    EPX_CUDA(cudaMemset(memory_, 0, bytes));
    EPX_CUDA(cudaDeviceSynchronize());
    EPX_NCCL(ncclCommWindowRegister(comm, memory_, bytes, &window_, NCCL_WIN_COLL_SYMMETRIC));
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof reqs);
    reqs.lsaBarrierCount = 1;
    std::memset(&dev_comm_, 0, sizeof dev_comm_);
    EPX_NCCL(ncclDevCommCreate(comm, &reqs, &dev_comm_));
    char** bases = nullptr;
    EPX_CUDA(cudaMalloc(&bases, sizeof(char*) * ranks));
    discover_peers<<<1, 32>>>(dev_comm_, window_, ranks, rank - ncclTeamLsa(comm).rank, bases);
    EPX_CUDA(cudaGetLastError());
    EPX_CUDA(cudaMemcpy(peers_.base, bases, sizeof(char*) * ranks, cudaMemcpyDeviceToHost));
    EPX_CUDA(cudaFree(bases));
    peers_.rank = rank;
    peers_.ranks = ranks;
  }
  ~NcclWindow() override {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    ncclDevCommDestroy(comm_, &dev_comm_);
    ncclCommWindowDeregister(comm_, window_);
    ncclMemFree(memory_);
  }

 private:
  ncclComm_t comm_;
  int device_;
  void* memory_ = nullptr;
  ncclWindow_t window_ = nullptr;
  ncclDevComm dev_comm_;
};

// Every rank's record (at most kRecordBytes - 4 bytes) by ncclAllGather on a stream of its own, waited for
// at most `timeout`. A rank that never calls leaves the collective pending: the memory it uses is
// then left to the process (freeing it would wait for the collective).
constexpr size_t kRecordBytes = 2048;
std::vector<std::string> nccl_all_gather(ncclComm_t comm, int device, const std::string& record,
                                         std::chrono::milliseconds timeout, std::string_view what) {
  int ranks = 0;
  EPX_NCCL(ncclCommCount(comm, &ranks));
  EPX_CUDA(cudaSetDevice(device));
  // Each slot: the record's length (4 bytes), then its bytes (it may hold NULs: core/creation.cpp).
  std::vector<char> mine(kRecordBytes, 0), all(kRecordBytes * ranks);
  const uint32_t length = static_cast<uint32_t>(std::min(record.size(), kRecordBytes - sizeof(uint32_t)));
  std::memcpy(mine.data(), &length, sizeof length);
  std::memcpy(mine.data() + sizeof length, record.data(), length);
  char* memory = nullptr;  // this rank's record, then every rank's
  cudaStream_t stream = take_stream(device);  // stream_pool.hpp: why pooled
  EPX_CUDA(cudaMallocAsync(&memory, kRecordBytes * (ranks + 1), stream));
  EPX_CUDA(cudaMemcpyAsync(memory, mine.data(), kRecordBytes, cudaMemcpyHostToDevice, stream));
  EPX_NCCL(ncclAllGather(memory, memory + kRecordBytes, kRecordBytes, ncclChar, comm, stream));
  // Waited for before the copy back: a copy into pageable memory returns only once it is done, so
  // enqueued behind the all-gather it would wait for a missing rank with no limit.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  cudaError_t state = cudaStreamQuery(stream);
  while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    state = cudaStreamQuery(stream);
  }
  if (state == cudaErrorNotReady)
    fail(ErrorCode::timeout, what, ": waited ", timeout.count(), " ms and not every one of the ", ranks,
         " ranks arrived (a rank crashed, hung, or made collective calls in a different order)");
  EPX_CUDA(state);
  EPX_CUDA(cudaMemcpyAsync(all.data(), memory + kRecordBytes, all.size(), cudaMemcpyDeviceToHost, stream));
  EPX_CUDA(cudaFreeAsync(memory, stream));
  EPX_CUDA(cudaStreamSynchronize(stream));
  give_back_stream(device, stream);
  std::vector<std::string> records(ranks);
  for (int r = 0; r < ranks; ++r) {
    const char* slot = all.data() + r * kRecordBytes;
    uint32_t size = 0;
    std::memcpy(&size, slot, sizeof size);
    records[r] = std::string(slot + sizeof size, std::min<size_t>(size, kRecordBytes - sizeof size));
  }
  return records;
}

struct NcclGroupState final : CudaGroupState {
  std::vector<ncclComm_t> comms;  // by rank; null for ranks of other processes
  std::vector<int> devices;       // by rank; -1 for ranks of other processes
  bool owns_comms = true;

  ~NcclGroupState() override {
    if (!owns_comms) return;
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
  }
  int device(int rank) const override { return devices[rank]; }
  const char* transport_name() const override { return "nccl"; }
  std::vector<std::string> all_gather(int rank, const std::string& record, std::chrono::milliseconds timeout,
                                      std::string_view what) override {
    // After a timeout the communicator still holds the pending all-gather: later collectives
    // would pair with it, so the group fails them at once.
    if (!creation_failed.empty()) fail(ErrorCode::peer_failed, what, ": the group already failed: ", creation_failed);
    try {
      return nccl_all_gather(comms[rank], devices[rank], record, timeout, what);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::timeout) creation_failed = e.what();
      throw;
    }
  }
  std::string creation_failed;  // why an all-gather timed out, once one did
  std::unique_ptr<SymmetricWindow> allocate(int rank, size_t bytes, std::chrono::milliseconds) override {
    return std::make_unique<NcclWindow>(comms[rank], devices[rank], bytes);
  }
};

// ---- shared-GPU test transport ----

class PlainWindow final : public SymmetricWindow {
 public:
  PlainWindow(const std::vector<char*>& bases, int rank, std::shared_ptr<void> keep, std::shared_ptr<PeerBarrier> released)
      : keep_(std::move(keep)), released_(std::move(released)) {
    for (size_t p = 0; p < bases.size(); ++p) peers_.base[p] = bases[p];
    peers_.rank = rank;
    peers_.ranks = static_cast<int>(bases.size());
  }

  void await_peers_release(std::chrono::milliseconds timeout) override {
    try {
      released_->arrive_and_wait(peers_.rank, timeout, "buffer release (shared-gpu window)");
    } catch (const std::exception&) {
      // A peer that never releases (its thread hung or gone): free anyway, as a destructor must.
    }
  }

 private:
  std::shared_ptr<void> keep_;  // every rank's memory, freed when the last rank lets go
  std::shared_ptr<PeerBarrier> released_;  // the ranks' releases of this window meet here
};

struct SharedGpuGroupState final : CudaGroupState {
  SharedGpuGroupState(int ranks, int dev) : ranks(ranks), gpu(dev), barrier(ranks), gather(ranks), created(ranks, 0) {}
  int device(int) const override { return gpu; }
  std::vector<std::string> all_gather(int rank, const std::string& record, std::chrono::milliseconds timeout,
                                      std::string_view what) override {
    return gather.gather(rank, record, timeout, what);
  }
  const char* transport_name() const override { return "shared-gpu"; }

  // The GPU's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set before CUDA starts) are
  // handed to streams as they get work. With every queue taken by a stream that holds a waiting
  // kernel, a launch on one more stream lands behind such a kernel and never starts if that
  // kernel waits for it (measured: `epx-queue-probe ... busy`, docs/cuda.md).
  void check_streams(int streams_per_rank) const override {
    const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const int queues = set && std::atoi(set) > 0 ? std::min(std::atoi(set), 32) : 8;
    require(ranks * streams_per_rank <= queues, "shared-gpu transport: ", ranks, " ranks with ", streams_per_rank,
            " streams each can hold ", ranks * streams_per_rank, " streams busy at once, more than the GPU's ", queues,
            " hardware queues (CUDA_DEVICE_MAX_CONNECTIONS", set ? "=" : " unset: ", set ? set : "8",
            "); a rank's kernel could then wait behind a peer's waiting kernel until every wait times out. Set "
            "CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (epx's GPU tests and epx-bench --shared-gpu do), "
            "or use fewer ranks");
  }

  struct Pending {
    std::vector<char*> bases;
    int joined = 0;
    std::shared_ptr<void> memory;
    std::shared_ptr<PeerBarrier> released;
  };

  std::unique_ptr<SymmetricWindow> allocate(int rank, size_t bytes, std::chrono::milliseconds timeout) override {
    std::shared_ptr<Pending> mine;
    {
      std::lock_guard lock(mutex);
      auto& slot = pending[created[rank]++];
      if (!slot) {
        slot = std::make_shared<Pending>();
        slot->bases.assign(ranks, nullptr);
        EPX_CUDA(cudaSetDevice(gpu));
        char* all = nullptr;  // one allocation holds every rank's window
        EPX_CUDA(cudaMalloc(&all, bytes * ranks));
        EPX_CUDA(cudaMemset(all, 0, bytes * ranks));
        EPX_CUDA(cudaDeviceSynchronize());
        slot->memory = std::shared_ptr<void>(all, [](void* p) { cudaFree(p); });
        for (int p = 0; p < ranks; ++p) slot->bases[p] = all + bytes * p;
        slot->released = std::make_shared<PeerBarrier>(ranks);
      }
      mine = slot;
      if (++mine->joined == ranks) pending.erase(created[rank] - 1);
    }
    barrier.arrive_and_wait(rank, timeout, "buffer creation (shared-gpu window)");
    return std::make_unique<PlainWindow>(mine->bases, rank, mine->memory, mine->released);
  }

  const int ranks;
  const int gpu;
  PeerBarrier barrier;
  ThreadAllGather gather;
  std::mutex mutex;
  std::vector<int64_t> created;
  std::map<int64_t, std::shared_ptr<Pending>> pending;
};

}  // namespace
}  // namespace detail

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

CudaWorld::CudaWorld(std::vector<int> devices) {
  detail::check_nccl_version();
  if (devices.empty()) {
    int n = 0;
    EPX_CUDA(cudaGetDeviceCount(&n));
    for (int d = 0; d < n; ++d) devices.push_back(d);
  }
  detail::require(!devices.empty(), "CudaWorld: no GPU visible");
  auto state = std::make_shared<detail::NcclGroupState>();
  state->comms.assign(devices.size(), nullptr);
  state->devices = devices;
  EPX_NCCL(ncclCommInitAll(state->comms.data(), static_cast<int>(devices.size()), devices.data()));
  size_ = static_cast<int>(devices.size());
  state_ = state;
}

CudaWorld CudaWorld::shared_gpu(int ranks, int device) {
  detail::require(ranks >= 1 && ranks <= detail::kMaxRanks, "CudaWorld::shared_gpu: ranks must be in [1, ",
                  detail::kMaxRanks, "], got ", ranks);
  CudaWorld w(Empty{});
  w.state_ = std::make_shared<detail::SharedGpuGroupState>(ranks, device);
  w.size_ = ranks;
  return w;
}

Group CudaWorld::group(int rank) const {
  detail::require(rank >= 0 && rank < size_, "CudaWorld::group: rank ", rank, " is outside [0, ", size_, ")");
  return Group(state_, rank, size_, BackendKind::cuda);
}

std::string nccl_unique_id() {
  detail::check_nccl_version();
  ncclUniqueId id;
  EPX_NCCL(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof id.internal);
}

Group cuda_group_init_rank(const std::string& unique_id, int rank, int size, int device) {
  detail::check_nccl_version();
  ncclUniqueId id;
  detail::require(unique_id.size() == sizeof id.internal, "cuda_group_init_rank: unique_id must be the ",
                  sizeof id.internal, " bytes nccl_unique_id() returned, got ", unique_id.size());
  std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
  detail::require(size >= 1 && rank >= 0 && rank < size, "cuda_group_init_rank: rank ", rank, " is outside [0, size=", size,
                  ")");
  auto state = std::make_shared<detail::NcclGroupState>();
  state->comms.assign(size, nullptr);
  state->devices.assign(size, -1);
  state->devices[rank] = device;
  EPX_CUDA(cudaSetDevice(device));
  EPX_NCCL(ncclCommInitRank(&state->comms[rank], size, id, rank));
  return Group(state, rank, size, BackendKind::cuda);
}

Group cuda_group_from_comm(void* nccl_comm, int device) {
  detail::check_nccl_version();
  auto comm = static_cast<ncclComm_t>(nccl_comm);
  int size = 0, rank = 0;
  EPX_NCCL(ncclCommCount(comm, &size));
  EPX_NCCL(ncclCommUserRank(comm, &rank));
  auto state = std::make_shared<detail::NcclGroupState>();
  state->comms.assign(size, nullptr);
  state->devices.assign(size, -1);
  state->comms[rank] = comm;
  state->devices[rank] = device;
  state->owns_comms = false;
  return Group(state, rank, size, BackendKind::cuda);
}

int cuda_device(const Group& group) {
  auto* state = dynamic_cast<detail::CudaGroupState*>(group.state().get());
  detail::require(state != nullptr, "cuda_device: not a CUDA group");
  return state->device(group.rank());
}

Tensor to_host(const Tensor& t) {
  if (!t.defined() || t.view().device == DeviceKind::host) return t;
  TensorView v = t.view();
  const size_t bytes = static_cast<size_t>(v.numel() * dtype_size(v.dtype));
  std::shared_ptr<void> storage(std::malloc(bytes ? bytes : 1), std::free);
  // Not cudaMemcpy: the legacy stream would wait on every blocking stream of the device.
  EPX_CUDA(cudaMemcpyAsync(storage.get(), v.data, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread));
  EPX_CUDA(cudaStreamSynchronize(cudaStreamPerThread));
  v.data = storage.get();
  v.device = DeviceKind::host;
  v.device_index = 0;
  return Tensor(std::move(storage), v);
}

}  // namespace epx
