// Group state of the CUDA backend: which GPU each rank drives and how ranks get a
// symmetric window (the same size on every rank, every rank's window addressable).
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.hpp"
#include "cuda/transport/window.hpp"

namespace epx::detail {

// Window parts start at 16-byte boundaries (kernels move rows with 16-byte vectors).
inline int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// One rank's share of a collective allocation. Zero-filled before any peer can write to it.
class SymmetricWindow {
 public:
  virtual ~SymmetricWindow() = default;
  const PeerWindows& peers() const { return peers_; }
  char* local() const { return peers_.base[peers_.rank]; }
  // Called by a buffer's destructor once its streams are idle, before it frees anything. Where
  // ranks share one GPU (one CUDA context), cudaFree and cudaFreeHost wait for every kernel
  // running there and hold back every other thread's launches meanwhile (epx-sync-probe,
  // docs/cuda.md): a rank freeing while a peer is still inside a call would hold back the launch
  // that peer's kernels wait for, until their timeout. There this waits (at most `timeout`) until
  // every rank releases this window. With a GPU per rank there is nothing to wait for.
  virtual void await_peers_release(std::chrono::milliseconds /*timeout*/) {}

 protected:
  PeerWindows peers_{};
};

struct CudaGroupState : GroupState {
  virtual int device(int rank) const = 0;
  virtual const char* transport_name() const = 0;
  // Collective: every rank calls it once per Buffer, in the same order.
  virtual std::unique_ptr<SymmetricWindow> allocate(int rank, size_t bytes, std::chrono::milliseconds timeout) = 0;
  // Throws where a buffer whose ranks each keep `streams_per_rank` streams busy at once could
  // hang: on one GPU shared by every rank, more busy streams than hardware queues (docs/cuda.md).
  // Called before any collective step, with the same count on every rank, so all ranks refuse.
  virtual void check_streams(int /*streams_per_rank*/) const {}
};

// Throws unless the loaded NCCL is the one epx was compiled against (the device ABI changes
// between patch releases: a mismatch hangs kernels instead of failing).
void check_nccl_version();

}  // namespace epx::detail
