// What a copy-engine copy costs beyond its bytes
// (docs/lab/2026-12-01-performance-diary.md, "Copies cost per call"):
// 1. host time per call: cudaMemcpyAsync, an entry of cudaMemcpyBatchAsync, and the update of one
//    memcpy node of an instantiated graph (cudaGraphExecMemcpyNodeSetParams1D, launch included);
// 2. device time of one rank's dispatch rows (4096 x 14336 bytes) copied as n copies: on one stream,
//    as a graph of n chained memcpy nodes, and as a graph of n independent ones. The host enqueues
//    behind a spinning kernel, so only the device's time is measured. Within GPU 0, and from GPU 0
//    to GPU 1 when there are two.
//   usage: epx-copy-probe
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "probe_common.cuh"

namespace {

using probe::check;

__global__ void spin(unsigned long long ns) {
  const unsigned long long start = probe::now_ns();
  while (probe::now_ns() - start < ns) {
  }
}

// Median host time of f over 21 runs, the device idle before each.
double host_us(const std::function<void()>& f) {
  std::vector<double> t;
  for (int i = 0; i < 21; ++i) {
    check("epx-copy-probe", cudaDeviceSynchronize(), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  check("epx-copy-probe", cudaDeviceSynchronize(), "sync");
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A graph of n 1D copies of [0, total) cut in n equal parts; chained (each after the one before)
// or independent. With `nodes`, the graph stays (its nodes name the copies for updates) in *kept.
cudaGraphExec_t copy_graph(char* dst, const char* src, size_t total, int n, bool chained,
                           std::vector<cudaGraphNode_t>* nodes = nullptr, cudaGraph_t* kept = nullptr) {
  cudaGraph_t g;
  check("epx-copy-probe", cudaGraphCreate(&g, 0), "graph");
  cudaGraphNode_t prev = nullptr;
  for (int i = 0; i < n; ++i) {
    const size_t at = total / n * i, len = i == n - 1 ? total - at : total / n;
    const bool after = chained && prev;
    check("epx-copy-probe",
          cudaGraphAddMemcpyNode1D(&prev, g, after ? &prev : nullptr, after ? 1 : 0, dst + at, src + at, len,
                                   cudaMemcpyDeviceToDevice),
          "memcpy node");
    if (nodes) nodes->push_back(prev);
  }
  cudaGraphExec_t exec;
  check("epx-copy-probe", cudaGraphInstantiate(&exec, g, 0), "instantiate");
  if (kept) *kept = g;
  else cudaGraphDestroy(g);
  return exec;
}

void host_costs(char* a, char* b, cudaStream_t s) {
  constexpr int n = 16;
  constexpr size_t bytes = size_t{1} << 20;
  std::printf("host time per call (16 copies of 1 MiB within GPU 0, medians of 21):\n");
  const double stream = host_us([&] {
    for (int i = 0; i < n; ++i) cudaMemcpyAsync(b + i * bytes, a + i * bytes, bytes, cudaMemcpyDefault, s);
  });
  std::vector<void*> dst(n);
  std::vector<const void*> src(n);
  std::vector<size_t> sizes(n, bytes);
  for (int i = 0; i < n; ++i) {
    dst[i] = b + i * bytes;
    src[i] = a + i * bytes;
  }
  const double batch = host_us([&] {
    cudaMemcpyAttributes in_order{};
    in_order.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    cudaMemcpyBatchAsync(dst.data(), src.data(), sizes.data(), n, &in_order, &first, 1, s);
  });
  std::vector<cudaGraphNode_t> nodes;
  cudaGraph_t template_graph;
  cudaGraphExec_t exec = copy_graph(b, a, n * bytes, n, false, &nodes, &template_graph);
  const double graph = host_us([&] {
    for (int i = 0; i < n; ++i)
      cudaGraphExecMemcpyNodeSetParams1D(exec, nodes[i], b + i * bytes, a + i * bytes, bytes - 16 * (i % 2),
                                         cudaMemcpyDeviceToDevice);  // an update may not change the kinds
    cudaGraphLaunch(exec, s);
  });
  check("epx-copy-probe", cudaGetLastError(), "host costs");
  std::printf("  cudaMemcpyAsync %.1f us, cudaMemcpyBatchAsync %.1f us an entry, graph node update %.1f us"
              " (launch included)\n", stream / n, batch / n, graph / n);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(template_graph);
}

void device_times(const char* what, char* dst, const char* src, cudaStream_t s) {
  constexpr size_t total = size_t{4096} * 14336;
  cudaEvent_t e0, e1;
  check("epx-copy-probe", cudaEventCreate(&e0), "event");
  check("epx-copy-probe", cudaEventCreate(&e1), "event");
  std::printf("device time of %zu bytes %s as n copies (us, medians of 11):\n  %5s %14s %14s %14s\n", total, what, "n",
              "one stream", "graph, chain", "graph, apart");
  for (int n : {1, 4, 8, 17, 64}) {
    double us[3];
    for (int form = 0; form < 3; ++form) {
      cudaGraphExec_t exec = form ? copy_graph(dst, src, total, n, form == 1) : nullptr;
      std::vector<float> t;
      for (int i = 0; i < 11; ++i) {
        spin<<<1, 1, 0, s>>>(1000000ull);  // 1 ms: the host enqueues meanwhile
        cudaEventRecord(e0, s);
        if (exec) {
          cudaGraphLaunch(exec, s);
        } else {
          for (int k = 0; k < n; ++k) {
            const size_t at = total / n * k, len = k == n - 1 ? total - at : total / n;
            cudaMemcpyAsync(dst + at, src + at, len, cudaMemcpyDefault, s);
          }
        }
        cudaEventRecord(e1, s);
        check("epx-copy-probe", cudaEventSynchronize(e1), "copies");
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        t.push_back(1000.0f * ms);
      }
      std::sort(t.begin(), t.end());
      us[form] = t[t.size() / 2];
      if (exec) cudaGraphExecDestroy(exec);
    }
    std::printf("  %5d %14.1f %14.1f %14.1f\n", n, us[0], us[1], us[2]);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace

int main() {
  constexpr size_t bytes = size_t{4096} * 14336;
  int gpus = 0;
  check("epx-copy-probe", cudaGetDeviceCount(&gpus), "device count");
  char *a, *b, *peer = nullptr;
  check("epx-copy-probe", cudaMalloc(&a, bytes), "malloc");
  check("epx-copy-probe", cudaMalloc(&b, bytes), "malloc");
  cudaStream_t s;
  check("epx-copy-probe", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  host_costs(a, b, s);
  device_times("within GPU 0", b, a, s);
  if (gpus >= 2) {
    check("epx-copy-probe", cudaSetDevice(1), "device 1");
    check("epx-copy-probe", cudaMalloc(&peer, bytes), "malloc on GPU 1");
    check("epx-copy-probe", cudaSetDevice(0), "device 0");
    cudaDeviceEnablePeerAccess(1, 0);
    cudaGetLastError();  // already enabled is fine
    device_times("from GPU 0 to GPU 1", peer, a, s);
  }
  return 0;
}
