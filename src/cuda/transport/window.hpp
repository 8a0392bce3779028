// What kernels see of the transport: every rank's symmetric window, mapped on this GPU.
// Two transports fill it: NCCL (ncclGetPeerPointer over NVLink) and the shared-GPU test
// transport (plain device pointers). Kernels never see NCCL types.
#pragma once
#include <cstdint>

namespace epx::detail {

constexpr int kMaxRanks = 16;

struct PeerWindows {
  char* base[kMaxRanks];  // window of rank p, addressable from this GPU
  int rank = 0;
  int ranks = 0;
};

}  // namespace epx::detail
