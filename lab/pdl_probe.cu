// What a dependent kernel's start costs after the kernel before it on the stream, with and without
// programmatic dependent launch (PDL), as epx's two kernels a call would see it: a "plan" of 24
// blocks that works `work_us` per block, then a "transfer" of 24 blocks of 512 threads, already
// queued when the plan runs (the host launches both back to back). Per mode, medians of `reps`:
//   gap:   from the plan's last block's end to the transfer's first block's first instruction
//          after its wait (plain launch: its first instruction), on the device timer;
//   call:  events around both launches (what epx-bench times).
// Modes: plain (stream order); pdl-start (the plan triggers its dependents at its start, the
// transfer waits with griddepcontrol.wait: the transfer's blocks become resident while the plan
// runs, and the wait returns when the plan's grid has completed and flushed its memory).
//   usage: epx-pdl-probe [reps] [work_us]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

namespace {

struct Stamps {
  unsigned long long plan_end;        // max over the plan's blocks
  unsigned long long transfer_begin;  // min over the transfer's blocks, after the wait
};

__global__ void plan(Stamps* st, int* data, unsigned long long work_ns, bool trigger) {
  if (trigger) asm volatile("griddepcontrol.launch_dependents;");
  const unsigned long long start = probe::now_ns();
  while (probe::now_ns() - start < work_ns) {
  }
  if (threadIdx.x == 0) data[blockIdx.x] = blockIdx.x + 1;
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&st->plan_end, probe::now_ns());
}

__global__ void transfer(Stamps* st, const int* data, int* out, bool wait) {
  if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) {
    atomicMin(&st->transfer_begin, probe::now_ns());
    out[blockIdx.x] = data[blockIdx.x];  // what the plan wrote: must be there
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void measure(const char* mode, bool pdl, int reps, unsigned long long work_ns, cudaStream_t s, Stamps* st, int* data,
             int* out) {
  const char* name = "pdl-probe";
  cudaEvent_t a, b;
  probe::check(name, cudaEventCreate(&a), "event");
  probe::check(name, cudaEventCreate(&b), "event");
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(24);
  cfg.blockDim = dim3(512);
  cfg.stream = s;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  std::vector<double> gap, call;
  int bad = 0;
  for (int i = 0; i < reps + 5; ++i) {
    const Stamps init{0, ~0ull};
    probe::check(name, cudaMemcpyAsync(st, &init, sizeof init, cudaMemcpyHostToDevice, s), "stamps");
    probe::check(name, cudaMemsetAsync(data, 0, 24 * sizeof(int), s), "data");
    probe::check(name, cudaStreamSynchronize(s), "reset");
    cudaEventRecord(a, s);
    plan<<<24, 512, 0, s>>>(st, data, work_ns, pdl);
    probe::check(name, cudaLaunchKernelEx(&cfg, transfer, st, static_cast<const int*>(data), out, pdl), "transfer");
    cudaEventRecord(b, s);
    probe::check(name, cudaEventSynchronize(b), "call");
    Stamps h{};
    int o[24];
    probe::check(name, cudaMemcpy(&h, st, sizeof h, cudaMemcpyDeviceToHost), "read");
    probe::check(name, cudaMemcpy(o, out, sizeof o, cudaMemcpyDeviceToHost), "read");
    for (int k = 0; k < 24; ++k) bad += o[k] != k + 1;
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i < 5) continue;  // warm-up
    gap.push_back((static_cast<double>(h.transfer_begin) - static_cast<double>(h.plan_end)) / 1000.0);
    call.push_back(1000.0 * ms);
  }
  std::printf("%-10s gap %6.2f us  call %7.2f us  (work %.1f us)  wrong reads %d\n", mode, median(gap), median(call),
              work_ns / 1000.0, bad);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  const double work_us = argc > 2 ? std::atof(argv[2]) : 20.0;
  cudaStream_t s;
  probe::check("pdl-probe", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  Stamps* st = nullptr;
  int *data = nullptr, *out = nullptr;
  probe::check("pdl-probe", cudaMalloc(&st, sizeof *st), "malloc");
  probe::check("pdl-probe", cudaMalloc(&data, 24 * sizeof(int)), "malloc");
  probe::check("pdl-probe", cudaMalloc(&out, 24 * sizeof(int)), "malloc");
  const auto work_ns = static_cast<unsigned long long>(work_us * 1000.0);
  for (int round = 0; round < 2; ++round) {
    measure("plain", false, reps, work_ns, s, st, data, out);
    measure("pdl-start", true, reps, work_ns, s, st, data, out);
  }
  cudaFree(st);
  cudaFree(data);
  cudaFree(out);
  cudaStreamDestroy(s);
  return 0;
}
