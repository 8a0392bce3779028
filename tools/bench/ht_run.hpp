// High-throughput runs of one rank (dispatch, combine and the backward passes of one layer): its
// timed calls, the inputs every rank's verification needs, the checks against the reference and
// the records. epx-bench drives the ranks from threads (main.cpp) or processes (processes.cpp).
#pragma once
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench/json.hpp"
#include "bench/options.hpp"
#include "bench/staging.hpp"
#include "verify/reference.hpp"

namespace epx::bench {

// Everything one rank produced for one (layout, wire) configuration.
struct RankOutputs {
  DispatchResult dispatched;
  std::vector<uint16_t> y, grad_x_in, grad_out;
  std::vector<float> grad_w_in;
  CombineResult combined;
  DispatchBackwardResult dispatch_grad;
  CombineBackwardResult combine_grad;
  std::map<std::string, std::vector<double>> times_us;  // op -> per iteration
};

inline bool wants(const Options& o, const std::string& op) { return std::find(o.ops.begin(), o.ops.end(), op) != o.ops.end(); }

// Runs call() warmup + iters times, each start aligned across ranks by `arrive` (every rank's
// call of it returns together); keeps the timed ones.
template <typename Call>
void time_calls(const Options& o, const std::function<void()>& arrive, Staging& io, std::vector<double>& times,
                Call&& call) {
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    arrive();
    io.start();
    call();
    io.stop();
    const double us = io.elapsed_us();
    if (i >= o.warmup) times.push_back(us);
  }
}

// The ranks of the run: host threads of a HostWorld, or GPUs of a CudaWorld (one per GPU).
struct Ranks {
  std::function<Group(int)> group;
  std::function<int(const Group&)> device;  // -1 on the host backend
  std::string gpu_name;
  int sm_count = 0;  // of GPU 0 (the low-latency kernels take them all)
};

// --mode capacity: p's buffers in CapacityMode::capacity with o.capacity_rows rows, or (0) the most
// rows any rank's `layout` of p needs (no overflow: the results are the blocking ones).
void use_capacity_mode(const Options& o, verify::Problem& p, Layout layout);

// Rank r's calls of one configuration on group g (its GPU `device`, -1 on the host), timed.
RankOutputs run_rank(const Options& o, const Group& g, int device, const verify::Problem& p, Layout layout,
                     bool with_combine, const std::function<void()>& arrive);

// Rank r's inputs of combine and the backward passes (deterministic from the seed; `rows`: its
// dispatch's output rows), for the ops asked for: what run_rank passes, and what a process
// running another rank rebuilds to verify its own results.
void make_rank_inputs(const Options& o, const verify::Problem& p, int r, int64_t rows, bool weighted, RankOutputs& out);

// Empty when every rank's result of `op` (only rank `only`, when given) equals the reference.
// The ranks' inputs (make_rank_inputs) must be there for all ranks.
std::string verify_op(const std::string& op, const verify::Problem& p, Layout layout, const std::vector<RankOutputs>& outs,
                      int only = -1);

// DeepEP's accounting for rank r (its dispatch's rank_offsets): {logical, from other ranks} bytes.
std::pair<double, double> rank_bytes(const DispatchResult& d, int r, int ranks, double row_bytes);
std::pair<double, double> bytes_per_rank(const std::vector<RankOutputs>& outs, double row_bytes);
std::vector<std::vector<double>> traffic_matrix(const std::vector<RankOutputs>& outs, double row_bytes);
double wire_row_bytes(WireFormat w, int64_t h);

Record base_record(const Options& o, const Ranks& ranks, const verify::Problem& p, const std::string& op, WireFormat wire,
                   const std::string& layout, const std::vector<const std::vector<double>*>& times);
void set_bytes(Record& rec, double logical, double wire_bytes);
Record make_record(const Options& o, const Ranks& ranks, const verify::Problem& p, const std::string& op, WireFormat wire,
                   Layout layout, const std::vector<RankOutputs>& outs);

}  // namespace epx::bench
