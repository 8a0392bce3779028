#include "bench/options.hpp"

#ifdef EPX_HAS_CUDA
#include "epx/cuda.hpp"
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace epx::bench {

namespace {

const char* kUsage = R"(epx-bench: dispatch and combine of one MoE layer over N ranks, timed and verified.

  --backend host|cuda     backend (default: cuda when this build has it and a GPU is visible, else host)
  --preset v3|ll          v3: 4096 tokens/rank, hidden 7168, top-8 of 256 experts (host: 512 tokens)
                          ll: 128 tokens/rank, hidden 7168, top-8 of 288 experts (host: 32 tokens)
  --ranks N               ranks (host: threads; default 2)
  --tokens N --hidden N --experts N --topk N   override the preset
  --alignment N           expert_alignment of the expert-major layout (default 1)
  --routing uniform|skewed  expert choice per token (skewed: expert e weighted 1/(e+1))
  --wire LIST             comma list of bf16,fp8,fp8_ue8m0,nvfp4 (default all)
  --layout LIST           comma list of expert_major,rank_major (default both)
  --combine-wire W        bf16 (default), fp8 or fp8_ue8m0: what combine's and ll_combine's partials
                          cross back as (combine_wire)
  --ops LIST              comma list of dispatch,combine,dispatch_backward,combine_backward,
                          ll_dispatch,ll_combine (default: the first four; with --preset ll all six)
  --sms N                 SM budget for GPU kernels (recorded; host ignores it)
  --send-blocks N         CUDA: BufferConfig::send_blocks, the budget's sending blocks (default 0: the
                          measured split)
  --shared-expert         BufferConfig / LowLatencyConfig::shared_expert: the fused shared expert
                          (high-throughput ops: expert-major only; records say "shared_expert": true)
  --replicas N            redundant experts (EPLB): N physical replicas of each logical expert,
                          P = N * experts, replica j of expert e = physical expert j * E + e
                          (BufferConfig::num_physical_experts; records say "replicas": N; verified
                          against the plain problem of P experts)
  --shared-gpu            CUDA: all ranks on GPU 0 over the tests' shared-GPU transport (records say
                          "transport": "shared-gpu"; a test transport's times, real host steps)
  --mode blocking|capacity  the high-throughput buffers' BufferConfig::mode (default blocking;
                          capacity: no host read in a call, outputs of --capacity-rows rows; records
                          say "mode": "capacity" and "capacity_rows")
  --capacity-rows N       BufferConfig::capacity_rows with --mode capacity (default 0: the most rows
                          any rank's layout of the run needs, so nothing overflows)
  --ll-eager              time low-latency calls one by one with events (host launch included)
                          instead of as CUDA-graph replays of 10 calls
  --processes             CUDA, high-throughput ops: one process per rank (one per GPU), as jobs
                          and DeepEP's benchmark run them; default: one thread per rank
  --ll-weights-at WHERE   combine (default) or dispatch: which low-latency call takes the
                          combine's weights (records say "weights_at": "dispatch" for the latter)
  --warmup N --iters N    untimed and timed repetitions (default 2 and 20; host 1 and 5)
  --seed N                random seed for inputs and routing
  --json FILE             write the records as a JSON list, rewritten after every record
  --max-memory-gb X       host memory the run may count on, in GB of 10^9 bytes (default: MemAvailable,
                          or the cgroup's limit where lower). Before running, epx-bench estimates the
                          run's peak memory and refuses (exit status 3) when it exceeds 80% of this,
                          naming the largest --tokens or --ranks that would fit
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "epx-bench: %s\n\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

int64_t to_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 0) usage_error(flag + " needs a non-negative integer, got '" + v + "'");
  return x;
}

double to_positive(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x > 0)) usage_error(flag + " needs a positive number, got '" + v + "'");
  return x;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

WireFormat to_wire(const std::string& s) {
  for (WireFormat w : {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4})
    if (s == wire_name(w)) return w;
  usage_error("unknown wire format '" + s + "'");
}

Layout to_layout(const std::string& s) {
  for (Layout l : {Layout::expert_major, Layout::rank_major})
    if (s == layout_name(l)) return l;
  usage_error("unknown layout '" + s + "'");
}

}  // namespace

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--shared-gpu") {
      o.shared_gpu = true;
      continue;
    }
    if (flag == "--shared-expert") {
      o.shared_expert = true;
      continue;
    }
    if (flag == "--ll-eager") {
      o.ll_eager = true;
      continue;
    }
    if (flag == "--processes") {
      o.processes = true;
      continue;
    }
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--backend") o.backend = v;
    else if (flag == "--preset") o.preset = v;
    else if (flag == "--ll-weights-at") {
      if (v != "combine" && v != "dispatch") usage_error("--ll-weights-at takes combine or dispatch, got '" + v + "'");
      o.ll_weights_at_dispatch = v == "dispatch";
    }
    else if (flag == "--mode") {
      if (v != "blocking" && v != "capacity") usage_error("--mode is blocking or capacity, got '" + v + "'");
      o.capacity_mode = v == "capacity";
    } else if (flag == "--capacity-rows") o.capacity_rows = to_int(flag, v);
    else if (flag == "--ranks") o.ranks = static_cast<int>(to_int(flag, v));
    else if (flag == "--tokens") o.tokens = to_int(flag, v);
    else if (flag == "--hidden") o.hidden = to_int(flag, v);
    else if (flag == "--experts") o.experts = to_int(flag, v);
    else if (flag == "--topk") o.topk = to_int(flag, v);
    else if (flag == "--alignment") o.alignment = to_int(flag, v);
    else if (flag == "--sms") o.sms = static_cast<int>(to_int(flag, v));
    else if (flag == "--replicas") o.replicas = to_int(flag, v);
    else if (flag == "--send-blocks") o.send_blocks = to_int(flag, v);
    else if (flag == "--warmup") o.warmup = static_cast<int>(to_int(flag, v));
    else if (flag == "--iters") o.iters = static_cast<int>(to_int(flag, v));
    else if (flag == "--seed") o.seed = static_cast<uint64_t>(to_int(flag, v));
    else if (flag == "--json") o.json = v;
    else if (flag == "--max-memory-gb") o.max_memory_gb = to_positive(flag, v);
    else if (flag == "--routing") {
      if (v != "uniform" && v != "skewed") usage_error("--routing is uniform or skewed, got '" + v + "'");
      o.routing = v == "skewed" ? verify::Routing::skewed : verify::Routing::uniform;
    } else if (flag == "--wire") {
      for (const auto& w : split(v)) o.wires.push_back(to_wire(w));
    } else if (flag == "--combine-wire") {
      o.combine_wire = to_wire(v);
      if (o.combine_wire == WireFormat::nvfp4) usage_error("--combine-wire is bf16, fp8 or fp8_ue8m0, got 'nvfp4'");
    } else if (flag == "--layout") {
      for (const auto& l : split(v)) o.layouts.push_back(to_layout(l));
    } else if (flag == "--ops") {
      for (const auto& op : split(v)) {
        if (op != "dispatch" && op != "combine" && op != "dispatch_backward" && op != "combine_backward" &&
            op != "ll_dispatch" && op != "ll_combine")
          usage_error("unknown op '" + op + "'");
        o.ops.push_back(op);
      }
    } else {
      usage_error("unknown flag " + flag);
    }
  }
  if (o.backend.empty()) {
#ifdef EPX_HAS_CUDA
    o.backend = cuda_available() ? "cuda" : "host";
#else
    o.backend = "host";
#endif
  }
  if (o.backend != "host" && o.backend != "cuda") usage_error("--backend is host or cuda, got '" + o.backend + "'");
  if (o.preset != "v3" && o.preset != "ll") usage_error("--preset is v3 or ll, got '" + o.preset + "'");
  if (o.ranks < 1) usage_error("--ranks must be >= 1");
  const bool host = o.backend == "host";
  if (o.warmup < 0) o.warmup = host ? 1 : 2;
  if (o.iters < 0) o.iters = host ? 5 : 20;
  if (o.iters < 1) usage_error("--iters must be >= 1");
  const bool v3 = o.preset == "v3";
  if (o.tokens < 0) {
    o.tokens = v3 ? 4096 : 128;
    if (host) {  // keep a host run well under a minute on 2 cores (and the ll buffers small)
      o.tokens = v3 ? 512 : 32;
      o.tokens_scaled = true;
    }
  }
  if (o.hidden < 0) o.hidden = 7168;
  if (o.experts < 0) o.experts = v3 ? 256 : 288;
  if (o.topk < 0) o.topk = 8;
  if (o.wires.empty()) o.wires = {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4};
  // The shared expert is a segment of the expert-major layout; the rank-major one refuses it.
  if (o.layouts.empty()) o.layouts = o.shared_expert ? std::vector<Layout>{Layout::expert_major}
                                                     : std::vector<Layout>{Layout::expert_major, Layout::rank_major};
  for (Layout l : o.layouts)
    if (o.shared_expert && l == Layout::rank_major) usage_error("--shared-expert needs --layout expert_major");
  if (o.replicas < 0) usage_error("--replicas must be >= 1 (0: none)");

  if (o.ops.empty()) {
    o.ops = {"dispatch", "combine", "dispatch_backward", "combine_backward"};
    if (!v3) o.ops.insert(o.ops.end(), {"ll_dispatch", "ll_combine"});
    if (o.shared_gpu) o.ops = {"ll_dispatch", "ll_combine"};
  }
  if (o.shared_gpu) {
    if (o.backend != "cuda") usage_error("--shared-gpu needs --backend cuda");
    // High-throughput ops: every rank's blocks (the SM budget, 24 unless --sms) must be resident on
    // GPU 0 at once, as the tests' shared-GPU runs keep them (an H200 has 132 SMs).
    const bool any_ht = std::any_of(o.ops.begin(), o.ops.end(),
                                    [](const std::string& op) { return op != "ll_dispatch" && op != "ll_combine"; });
    if (any_ht && o.ranks * (o.sms > 0 ? o.sms : 24) > 128)
      usage_error("--shared-gpu with high-throughput ops needs ranks x SM budget <= 128 (every rank's blocks on GPU 0 "
                  "at once); lower --ranks or --sms");
  }
  if (o.capacity_rows > 0 && !o.capacity_mode) usage_error("--capacity-rows needs --mode capacity");
  if (o.processes) {
    if (o.backend != "cuda" || o.shared_gpu) usage_error("--processes needs --backend cuda, one GPU per rank");
    if (o.capacity_mode) usage_error("--processes runs blocking mode only (its ranks' checks size inputs by the layout)");
    for (const std::string& op : o.ops)
      if (op == "ll_dispatch" || op == "ll_combine") usage_error("--processes runs the high-throughput ops only, not " + op);
  }
  return o;
}

}  // namespace epx::bench
