// What a kernel launch costs by the size of its parameters (docs/lab/2026-12-03-session21.md,
// "Next": epx's plan kernel takes ~1.4 KB of parameters and its launch ~6.5 us of host time).
// For parameter blocks of 64 B to 4 KB, a kernel of one block that reads one word of them:
//   host: the host time of one launch, launches queued back to back (the stream is busy);
//   idle: an idle stream's call as epx-bench times one: event, launch, event, sync; the events'
//         time (the GPU waits for the launch to land);
//   graph: the same launch in a one-node CUDA graph, replayed (the launch's host work done once).
// Medians of `reps` (default 200).   usage: epx-launch-probe [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

namespace {

template <int kBytes>
struct Params {
  unsigned long long words[kBytes / 8];
};

template <int kBytes>
__global__ void touch(Params<kBytes> p, unsigned long long* out) {
  if (threadIdx.x == 0) *out = p.words[kBytes / 8 - 1];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <int kBytes>
void measure(int reps, cudaStream_t s, unsigned long long* out) {
  const char* name = "launch-probe";
  Params<kBytes> p{};
  p.words[kBytes / 8 - 1] = kBytes;
  cudaEvent_t a, b;
  probe::check(name, cudaEventCreate(&a), "event");
  probe::check(name, cudaEventCreate(&b), "event");
  touch<kBytes><<<1, 32, 0, s>>>(p, out);  // loaded and warm
  probe::check(name, cudaStreamSynchronize(s), "warm-up");

  std::vector<double> host, idle, graph;
  for (int i = 0; i < reps; ++i) {  // host: launches behind a busy stream
    const auto t0 = std::chrono::steady_clock::now();
    touch<kBytes><<<1, 32, 0, s>>>(p, out);
    host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  probe::check(name, cudaStreamSynchronize(s), "host");
  for (int i = 0; i < reps; ++i) {  // idle: the call as epx-bench times it
    float ms = 0;
    cudaEventRecord(a, s);
    touch<kBytes><<<1, 32, 0, s>>>(p, out);
    cudaEventRecord(b, s);
    probe::check(name, cudaEventSynchronize(b), "idle");
    cudaEventElapsedTime(&ms, a, b);
    idle.push_back(1000.0 * ms);
  }
  cudaGraph_t g;
  cudaGraphExec_t exec;
  probe::check(name, cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  touch<kBytes><<<1, 32, 0, s>>>(p, out);
  probe::check(name, cudaStreamEndCapture(s, &g), "capture");
  probe::check(name, cudaGraphInstantiate(&exec, g, 0), "instantiate");
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    cudaEventRecord(a, s);
    cudaGraphLaunch(exec, s);
    cudaEventRecord(b, s);
    probe::check(name, cudaEventSynchronize(b), "graph");
    cudaEventElapsedTime(&ms, a, b);
    graph.push_back(1000.0 * ms);
  }
  std::printf("params %5d B: host %6.2f us  idle %6.2f us  graph %6.2f us\n", kBytes, median(host), median(idle),
              median(graph));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  cudaStream_t s;
  probe::check("launch-probe", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  unsigned long long* out = nullptr;
  probe::check("launch-probe", cudaMalloc(&out, sizeof *out), "malloc");
  measure<64>(reps, s, out);
  measure<512>(reps, s, out);
  measure<1024>(reps, s, out);
  measure<1536>(reps, s, out);
  measure<4096>(reps, s, out);
  cudaFree(out);
  cudaStreamDestroy(s);
  return 0;
}
