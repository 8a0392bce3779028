// dispatch_all and the others (epx/all_ranks.hpp): the buffers checked to be ranks of one group,
// then each rank's call, from this thread (CUDA) or one thread per rank (the CPU backend).
#include "epx/all_ranks.hpp"

#include <exception>
#include <functional>
#include <set>
#include <thread>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/low_latency_backend.hpp"

namespace epx {
namespace detail {
struct AllRanksAccess {
  static const void* partners(const Buffer& b) { return b.backend_->partners(); }
  static const void* partners(const LowLatencyBuffer& b) { return b.backend_->partners(); }
};
}  // namespace detail

namespace {

// Checks that `buffers` are distinct ranks of one group with one input each (and, on the CUDA
// backend, that the calls never wait on the host: `host_free`), then runs call(r) for each and
// returns the results, or throws the first rank's own error.
template <class Buf, class Result>
std::vector<Result> on_every_rank(std::span<Buf* const> buffers, size_t inputs, const char* op,
                                  const std::function<bool(const Buf&)>& host_free,
                                  const std::function<Result(Buf&, size_t)>& call) {
  detail::require(!buffers.empty(), op, ": no buffers given");
  detail::require(inputs == buffers.size(), op, ": ", inputs, " inputs for ", buffers.size(),
                  " buffers; give one per buffer, in the buffers' order");
  std::set<int> ranks;
  for (size_t i = 0; i < buffers.size(); ++i) {
    detail::require(buffers[i] != nullptr, op, ": buffers[", i, "] is null");
    const Group& g = buffers[i]->group();
    detail::require(g.state() == buffers[0]->group().state(), op, ": buffers[", i,
                    "] belongs to another group than buffers[0]; give the buffers of one group");
    detail::require(ranks.insert(g.rank()).second, op, ": buffers[", i, "] is rank ", g.rank(),
                    " again; give each rank once");
    // Calls pair the buffers created together on each rank: any other mix would wait in vain.
    const void* together = detail::AllRanksAccess::partners(*buffers[0]);
    detail::require(together == nullptr || detail::AllRanksAccess::partners(*buffers[i]) == together, op,
                    ": buffers[", i, "] was not created together with buffers[0] (the n-th buffer of each rank pair "
                    "up); give the buffers made by one collective creation");
  }
  const bool cuda = buffers[0]->group().backend() == BackendKind::cuda;
  for (size_t i = 0; cuda && i < buffers.size(); ++i)
    detail::require(host_free(*buffers[i]), op, ": buffers[", i, "] is in blocking mode, whose calls wait on the "
                    "host for the other ranks' calls, which one thread makes one after another; create the buffers "
                    "in capacity mode (capacity_rows) to drive them from one thread");
  std::vector<Result> out(buffers.size());
  std::vector<std::exception_ptr> errors(buffers.size());
  auto run = [&](size_t i) {
    try {
      out[i] = call(*buffers[i], i);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (cuda) {
    for (size_t i = 0; i < buffers.size(); ++i) run(i);  // every rank takes part, failed or not
  } else {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < buffers.size(); ++i) threads.emplace_back(run, i);
  }  // the threads join here
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (err.code() != ErrorCode::peer_failed) std::rethrow_exception(e);  // a rank's own cause
    } catch (...) {
      std::rethrow_exception(e);
    }
    if (!first) first = e;
  }
  if (first) std::rethrow_exception(first);
  return out;
}

bool capacity_mode(const Buffer& b) { return b.config().mode == CapacityMode::capacity; }
bool always(const LowLatencyBuffer&) { return true; }

}  // namespace

std::vector<DispatchResult> dispatch_all(std::span<Buffer* const> buffers, std::span<const DispatchInput> inputs,
                                         const DispatchOptions& opt) {
  return on_every_rank<Buffer, DispatchResult>(buffers, inputs.size(), "dispatch_all", capacity_mode,
                                               [&](Buffer& b, size_t i) { return b.dispatch(inputs[i], opt); });
}

std::vector<CombineResult> combine_all(std::span<Buffer* const> buffers, std::span<const CombineInput> inputs,
                                       std::span<const Handle> handles, const CombineOptions& opt) {
  detail::require(handles.size() == inputs.size(), "combine_all: ", handles.size(), " handles for ", inputs.size(),
                  " inputs; give one per buffer");
  return on_every_rank<Buffer, CombineResult>(
      buffers, inputs.size(), "combine_all", capacity_mode,
      [&](Buffer& b, size_t i) { return b.combine(inputs[i], handles[i], opt); });
}

std::vector<LowLatencyDispatchResult> ll_dispatch_all(std::span<LowLatencyBuffer* const> buffers,
                                                      std::span<const LowLatencyDispatchInput> inputs) {
  return on_every_rank<LowLatencyBuffer, LowLatencyDispatchResult>(
      buffers, inputs.size(), "ll_dispatch_all", always,
      [&](LowLatencyBuffer& b, size_t i) { return b.dispatch(inputs[i]); });
}

std::vector<Tensor> ll_combine_all(std::span<LowLatencyBuffer* const> buffers,
                                   std::span<const LowLatencyCombineInput> inputs,
                                   std::span<const LowLatencyHandle> handles) {
  detail::require(handles.size() == inputs.size(), "ll_combine_all: ", handles.size(), " handles for ", inputs.size(),
                  " inputs; give one per buffer");
  return on_every_rank<LowLatencyBuffer, Tensor>(
      buffers, inputs.size(), "ll_combine_all", always,
      [&](LowLatencyBuffer& b, size_t i) { return b.combine(inputs[i], handles[i]); });
}

}  // namespace epx
