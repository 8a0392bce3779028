// epx-bench --processes (processes.hpp): the parent forks the ranks, waits, and makes the records
// from what they left in one shared mapping.
#include "bench/processes.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>

#include "bench/floors.hpp"
#include "bench/ht_run.hpp"

#ifdef EPX_HAS_CUDA
#include <cuda_runtime.h>

#include "epx/cuda.hpp"
#endif

namespace epx::bench {

#ifdef EPX_HAS_CUDA
namespace {

constexpr int kMaxRanks = 8, kMaxConfigs = 8, kMaxIters = 1000, kText = 1024;
constexpr const char* kOps[] = {"dispatch", "combine", "dispatch_backward", "combine_backward"};
constexpr int kOpCount = 4;

// One rank's result of one op of one configuration.
struct Slot {
  int ran;  // 1 once the rank wrote it
  double times[kMaxIters];
  double logical, wire;  // DeepEP's accounting, this rank's bytes
  HbmBytes hbm;          // what this rank's op must read and write in HBM (floors.hpp)
  char error[kText];     // this rank's check against the reference; empty when it matches
};

// The one mapping every process shares (zero-filled by mmap).
struct Shared {
  pthread_barrier_t barrier;  // process-shared: rank 0's NCCL id, then every timed call's start
  char unique_id[256];
  int id_bytes;
  char gpu_name[256];
  int sm_count;
  double traffic[kMaxRanks][kMaxRanks];  // bytes s -> d of the first bf16 dispatch (rank d writes column d)
  char fatal[kMaxRanks][kText];          // a rank's exception
  Slot slots[kMaxConfigs][kOpCount][kMaxRanks];
};

void copy_text(char* to, const std::string& from) { std::snprintf(to, kText, "%s", from.c_str()); }

void check(bool ok, const std::string& what) {
  if (!ok) throw Error(ErrorCode::invalid_argument, "epx-bench --processes: " + what);
}

// Everything rank r does, in its own process. Returns its exit status.
int rank_process(const Options& o, const verify::Problem& base, const std::vector<Config>& configs, Shared* sh, int r) {
  try {
    if (r == 0) {
      const std::string id = nccl_unique_id();
      check(id.size() <= sizeof sh->unique_id, "the NCCL id does not fit");
      std::memcpy(sh->unique_id, id.data(), id.size());
      sh->id_bytes = static_cast<int>(id.size());
    }
    pthread_barrier_wait(&sh->barrier);  // rank 0's id is there
    const Group g = cuda_group_init_rank(std::string(sh->unique_id, sh->id_bytes), r, o.ranks, r);
    if (r == 0) {
      cudaDeviceProp prop;
      cudaGetDeviceProperties(&prop, 0);
      std::snprintf(sh->gpu_name, sizeof sh->gpu_name, "%s", prop.name);
      sh->sm_count = prop.multiProcessorCount;
    }
    const std::function<void()> arrive = [sh] { pthread_barrier_wait(&sh->barrier); };
    bool traffic_done = false;
    for (size_t c = 0; c < configs.size(); ++c) {
      const auto [layout, wire] = configs[c];
      verify::Problem p = base;
      p.cfg.wire = wire;
      const bool with_combine = wire == o.wires.front();
      std::vector<RankOutputs> outs(o.ranks);
      outs[r] = run_rank(o, g, r, p, layout, with_combine, arrive);
      if (with_combine) {  // the other ranks' inputs, which this rank's combine and backward checks read
        const auto kept = verify::kept_routing(p);
        for (int q = 0; q < o.ranks; ++q)
          if (q != r)
            make_rank_inputs(o, p, q, static_cast<int64_t>(verify::expected_dispatch(p, kept, q, layout).rows.size()),
                             layout == Layout::expert_major, outs[q]);
      }
      for (int k = 0; k < kOpCount; ++k) {
        const std::string op = kOps[k];
        if (!wants(o, op) || (k > 0 && !with_combine)) continue;
        Slot& s = sh->slots[c][k][r];
        const std::vector<double>& t = outs[r].times_us.at(op);
        std::copy(t.begin(), t.end(), s.times);
        const double row = op == "dispatch" ? wire_row_bytes(wire, p.cfg.hidden) : 2.0 * p.cfg.hidden;
        std::tie(s.logical, s.wire) = rank_bytes(outs[r].dispatched, r, o.ranks, row);
        s.hbm = rank_hbm_bytes(op, p, k == 0 ? wire : WireFormat::bf16, layout == Layout::expert_major, outs[r], r);
        copy_text(s.error, verify_op(op, p, layout, outs, r));
        s.ran = 1;
      }
      if (wire == WireFormat::bf16 && !traffic_done) {
        const int64_t* off = outs[r].dispatched.rank_offsets.data<int64_t>();
        for (int q = 0; q < o.ranks; ++q) sh->traffic[q][r] = static_cast<double>(off[q + 1] - off[q]) * 2.0 * p.cfg.hidden;
        traffic_done = true;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    copy_text(sh->fatal[r], e.what());
    return 1;
  }
}

// Waits for every rank; when one fails, stops the others (they would wait for it at the next
// barrier) and throws every rank's error.
void wait_ranks(const std::vector<pid_t>& pids, const Shared* sh) {
  size_t left = pids.size();
  bool failed = false;
  while (left > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    --left;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    if (!failed)
      for (pid_t other : pids)
        if (other != pid) kill(other, SIGKILL);
    failed = true;
  }
  if (!failed) return;
  std::string all;
  for (size_t r = 0; r < pids.size(); ++r)
    if (sh->fatal[r][0]) all += "\n  rank " + std::to_string(r) + ": " + sh->fatal[r];
  throw Error(ErrorCode::internal, "epx-bench --processes: a rank failed (the others were stopped):" +
                                       (all.empty() ? std::string(" no message (killed?)") : all));
}

}  // namespace

std::vector<Record> run_processes(const Options& o, const verify::Problem& base, const std::vector<Config>& configs,
                                  std::vector<std::vector<double>>& bytes_to) {
  check(o.ranks <= kMaxRanks && o.iters <= kMaxIters && configs.size() <= static_cast<size_t>(kMaxConfigs),
        "at most " + std::to_string(kMaxRanks) + " ranks, " + std::to_string(kMaxIters) + " iterations and " +
            std::to_string(kMaxConfigs) + " layout x wire configurations");
  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  check(mem != MAP_FAILED, "cannot map " + std::to_string(sizeof(Shared)) + " bytes of shared memory");
  auto* sh = static_cast<Shared*>(mem);
  pthread_barrierattr_t attr;
  pthread_barrierattr_init(&attr);
  pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_barrier_init(&sh->barrier, &attr, static_cast<unsigned>(o.ranks));
  pthread_barrierattr_destroy(&attr);
  std::fflush(nullptr);  // nothing buffered twice
  std::vector<pid_t> pids;
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    check(pid >= 0, "fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a parent stopped by a timeout takes its ranks with it
      const int status = rank_process(o, base, configs, sh, r);
      std::fflush(nullptr);
      _exit(status);  // the parent's exit handlers and CUDA state are not this process's
    }
    pids.push_back(pid);
  }
  try {
    wait_ranks(pids, sh);
  } catch (...) {
    munmap(mem, sizeof(Shared));
    throw;
  }

  Ranks ranks;  // what the records say about the GPUs
  ranks.gpu_name = sh->gpu_name;
  ranks.sm_count = sh->sm_count;
  std::vector<Record> records;
  for (size_t c = 0; c < configs.size(); ++c) {
    const auto [layout, wire] = configs[c];
    verify::Problem p = base;
    p.cfg.wire = wire;
    for (int k = 0; k < kOpCount; ++k) {
      if (!sh->slots[c][k][0].ran) continue;
      std::vector<std::vector<double>> times(o.ranks);
      std::vector<const std::vector<double>*> per_rank;
      double logical = 0, wire_bytes = 0;
      std::vector<HbmBytes> hbm;
      std::string error;
      for (int r = 0; r < o.ranks; ++r) {
        const Slot& s = sh->slots[c][k][r];
        times[r].assign(s.times, s.times + o.iters);
        per_rank.push_back(&times[r]);
        logical += s.logical / o.ranks;
        wire_bytes += s.wire / o.ranks;
        hbm.push_back(s.hbm);
        if (error.empty() && s.error[0]) error = s.error;
      }
      Record rec = base_record(o, ranks, p, kOps[k], k == 0 ? wire : WireFormat::bf16,
                               std::string(layout_name(layout)), per_rank);
      set_bytes(rec, logical, wire_bytes);
      rec.hbm_read_bytes = busiest(hbm).read;
      rec.hbm_write_bytes = busiest(hbm).write;
      rec.verify_error = error;
      rec.verified = error.empty();
      rec.ranks_as = "processes";
      records.push_back(std::move(rec));
    }
    if (wire == WireFormat::bf16 && bytes_to.empty()) {
      bytes_to.assign(o.ranks, std::vector<double>(o.ranks, 0.0));
      for (int s = 0; s < o.ranks; ++s)
        for (int d = 0; d < o.ranks; ++d) bytes_to[s][d] = sh->traffic[s][d];
    }
  }
  pthread_barrier_destroy(&sh->barrier);
  munmap(mem, sizeof(Shared));
  return records;
}

#else

std::vector<Record> run_processes(const Options&, const verify::Problem&, const std::vector<Config>&,
                                  std::vector<std::vector<double>>&) {
  throw Error(ErrorCode::unsupported, "epx-bench --processes: this build has no CUDA backend");
}

#endif

}  // namespace epx::bench
