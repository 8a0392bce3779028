// The peak memory of an epx-bench run: memory.hpp. Each formula names the code whose memory it
// counts; docs/benchmarks.md ("Memory") has them checked against /usr/bin/time's maximum RSS.
#include "bench/memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "bench/ht_run.hpp"

namespace epx::bench {

namespace {

constexpr double kPage = 4096;

// The run's shape as doubles: the products below pass 2^31 long before they lose precision.
struct Shape {
  double R, M, H, K, E, L, S;  // ranks, tokens per rank, hidden, top-k, experts, experts per rank, R*M slots
  explicit Shape(const Options& o)
      : R(o.ranks), M(static_cast<double>(o.tokens)), H(static_cast<double>(o.hidden)), K(static_cast<double>(o.topk)),
        E(static_cast<double>(o.experts)), L(std::floor(E / R)), S(R * M) {}
};

// What each received row carries beside its payload: source, weight, rank-major routing
// (DispatchResult) and the handle's layout. Generous; a few percent of a row at real sizes.
double row_meta(const Shape& s) { return 64 + 16 * s.K; }

// Rows a high-throughput dispatch delivers, summed over ranks: those with data, and all of them
// (with the expert-major layout's padding).
struct Rows {
  double real = 0, all = 0;
};

Rows received_rows(const Options& o, const Shape& s, Layout layout) {
  if (layout == Layout::rank_major) {
    // A token once per rank that holds one of its K experts; uniform routing's expectation
    // (skewed routing reaches fewer ranks). miss: no expert of the token on a given rank.
    double miss = 1;
    for (double i = 0; i < s.K; ++i) miss *= std::max(0.0, (s.E - s.L - i) / (s.E - i));
    return {s.S * s.R * (1 - miss), s.S * s.R * (1 - miss)};
  }
  // Expert-major: a row per (token, expert) pair, each expert's segment padded to the alignment
  // (layout.cpp): at most a - 1 rows more per expert. Where uniform routing gives every expert
  // fewer rows than one aligned block (mean + 3 sigma), each segment is that one block.
  const double routed = s.S * s.K, a = static_cast<double>(o.alignment), mean = routed / s.E;
  double all = routed + s.E * (a - 1);
  if (o.routing == verify::Routing::uniform && mean + 3 * std::sqrt(mean) <= a) all = std::min(all, s.E * a);
  // The fused shared expert: each rank's own tokens first, padded like every segment.
  const double shared = o.shared_expert ? s.S : 0, shared_padding = o.shared_expert ? s.R * (a - 1) : 0;
  return {routed + shared, all + shared + shared_padding};
}

// What every phase holds besides its own parts: the problem's inputs (verify::make_problem), the
// process itself, and the allocator's slack: memory freed by earlier phases that malloc's arenas
// keep (measured: up to ~3% of the peak after the high-throughput configurations).
void add_base(const Options& o, const Shape& s, MemoryPhase& ph) {
  ph.host.push_back({"allocator slack", 0.05 * ph.host_bytes()});
  ph.host.push_back({"problem inputs", s.S * (2 * s.H + 8 * s.K)});
  if (o.backend == "cuda")  // per process: --processes has one per rank
    ph.host.push_back({"CUDA runtime and NCCL", 512e6 * (o.processes ? s.R : 1)});
  else
    ph.host.push_back({"process", 16e6});
}

// One high-throughput configuration (ht_run.cpp run_rank and verify_op), summed over ranks.
struct HtMemory {
  double dispatched = 0;  // dispatch's results
  double inputs = 0;      // y and the gradients that combine and the backward passes take
  double outputs = 0;     // their results
  double in_flight = 0;   // a timed call's new result, made while the last one is still alive
  double reference = 0;   // the check's layouts and copies of every rank's inputs (verify_op)
};

HtMemory ht_memory(const Options& o, const Shape& s, Layout layout, WireFormat wire, bool with_combine) {
  const Rows rows = received_rows(o, s, layout);
  const double recv_rows = rows.all * 2 * s.H, token_rows = s.S * 2 * s.H;  // bf16 [rows, H] and [tokens, H]
  // The host backend's results are made zeroed (calloc) and padding rows never written, so
  // their pages stay unused; a CUDA result is copied back whole (Staging::fetch).
  const double payload_rows = o.backend == "host" ? rows.real : rows.all;
  HtMemory m;
  m.dispatched = payload_rows * wire_row_bytes(wire, o.hidden) + rows.all * row_meta(s);
  m.in_flight = m.dispatched;
  m.reference = rows.all * (16 + 8 * s.K);  // verify::Expected of every rank
  if (!with_combine) return m;
  m.inputs = recv_rows;  // y, made for every op after dispatch
  if (wants(o, "combine")) m.outputs += token_rows;
  if (wants(o, "dispatch_backward")) {
    m.inputs += recv_rows + rows.all * 4 * s.K;
    m.outputs += token_rows + s.S * 4 * s.K;
  }
  if (wants(o, "combine_backward")) {
    m.inputs += token_rows;
    m.outputs += recv_rows + s.S * 4 * s.K;
    m.in_flight = std::max(m.in_flight, recv_rows);
  }
  // The checks run one op at a time; the largest copies every rank's y and grad_out.
  m.reference += recv_rows + 2 * token_rows;
  return m;
}

void add_ht_phases(const Options& o, const Shape& s, Layout layout, WireFormat wire, bool with_combine,
                   std::vector<MemoryPhase>& phases) {
  const HtMemory m = ht_memory(o, s, layout, wire, with_combine);
  const std::string name = std::string(layout_name(layout)) + " " + std::string(wire_name(wire));
  const bool host = o.backend == "host";
  // --processes: each rank's process rebuilds every rank's inputs for its own checks (processes.cpp).
  const double copies = o.processes ? s.R : 1;
  MemoryPhase run{name + ", running", {}, 0};
  if (host)  // host_backend.cpp: per rank, R*M forward rows (bf16-sized), reverse rows, slot arrays
    run.host.push_back({"high-throughput receive areas", s.R * s.S * (4 * s.H + 12 * s.K + 4)});
  run.host.push_back({"dispatch results", m.dispatched});
  run.host.push_back({"inputs of combine and the backward passes", m.inputs * copies});
  run.host.push_back({"their results", m.outputs});
  if (host) run.host.push_back({"a timed call's new result beside the last", m.in_flight});
  if (!host) {  // per GPU: the window (cuda_backend.cpp make_window_map), staged inputs, results in flight
    const double window = s.S * (4 * s.H + wire_row_bytes(wire, o.hidden) + 28 * s.K + 4 * s.R + 64);
    const double per_rank = window + (m.dispatched + m.in_flight + m.inputs + m.outputs) / s.R;
    run.device_bytes = per_rank * (o.shared_gpu ? s.R : 1);
  }
  MemoryPhase check{name + ", verifying", {}, 0};
  check.host.push_back({"dispatch results", m.dispatched});
  check.host.push_back({"inputs of combine and the backward passes", m.inputs * copies});
  check.host.push_back({"their results", m.outputs});
  check.host.push_back({"reference's copies and layouts", m.reference * copies});
  phases.push_back(run);
  phases.push_back(check);
}

// One low-latency wire format (main.cpp run_low_latency), summed over ranks.
void add_ll_phases(const Options& o, const Shape& s, WireFormat wire, std::vector<MemoryPhase>& phases) {
  const double wire_row = wire_row_bytes(wire, o.hidden), y_row = 2 * s.H;
  const double segments = s.L + (o.shared_expert ? 1 : 0);  // the shared expert's segment first
  const double slots = segments * s.S;  // one rank's [(1 +) L, R*M] receive slots
  // ll_outputs.hpp: y keeps the rows the dispatch fills (a row per (token, expert) pair, and each
  // rank's own tokens for the shared expert) and one more per expert, each expert's run rounded
  // out to whole pages.
  const double shared_rows = o.shared_expert ? s.S : 0;
  const double y_used = (s.S * s.K + shared_rows + s.R * segments) * y_row + s.R * segments * 2 * kPage;
  const std::string name = "ll " + std::string(wire_name(wire));
  const bool host = o.backend == "host";

  MemoryPhase make_y{name + ", making y", {}, 0};  // one rank at a time holds its whole y
  make_y.host.push_back({"one rank's whole y", slots * y_row});
  make_y.host.push_back({"the other ranks' y rows", y_used});
  phases.push_back(make_y);

  MemoryPhase run{name + ", running", {}, 0};
  if (host) {  // host_low_latency.cpp: two dispatch sets of [L][R*M] rows with token and slot ids, two combine sets of [M][K] bf16 rows
    run.host.push_back({"low-latency receive areas", s.R * (2 * slots * (wire_row + 8) + 2 * s.M * s.K * y_row)});
    // Made zeroed (calloc): only the rows received are touched, with recv_src and the handle's
    // per-slot sources. Twice: a timed call's new result is made while the last one lives.
    run.host.push_back({"dispatch results", 2 * (s.S * s.K * wire_row + s.R * slots * 20 + s.R * s.L * kPage)});
    run.host.push_back({"combine results", 2 * s.S * y_row});
  } else {  // copied back whole (Staging::fetch)
    run.host.push_back({"dispatch results", s.R * slots * (wire_row + 8)});
    run.host.push_back({"combine results", s.S * y_row});
    // Per GPU (cuda_low_latency.cpp): two sets of receive slots and outputs, the window, staged y and x.
    const double sets = 2 * (slots * (wire_row + 20) + s.M * s.K * 4 + s.M * y_row);
    const double window = 2 * s.S * (wire_row + 16) + 2 * s.S * y_row + 24 * s.S * s.K;
    run.device_bytes = (sets + window + slots * y_row + s.M * y_row) * (o.shared_gpu ? s.R : 1);
  }
  run.host.push_back({"y rows", y_used});
  phases.push_back(run);
}

}  // namespace

double MemoryPhase::host_bytes() const {
  double sum = 0;
  for (const MemoryPart& p : host) sum += p.bytes;
  return sum;
}

MemoryEstimate estimate_memory(const Options& o) {
  const Shape s(o);
  std::vector<MemoryPhase> phases;
  const bool any_ht = wants(o, "dispatch") || wants(o, "combine") || wants(o, "dispatch_backward") ||
                      wants(o, "combine_backward");
  for (Layout layout : any_ht ? o.layouts : std::vector<Layout>{})
    for (WireFormat wire : o.wires) add_ht_phases(o, s, layout, wire, wire == o.wires.front(), phases);
  if (wants(o, "ll_dispatch") || wants(o, "ll_combine"))
    for (WireFormat wire : o.wires) add_ll_phases(o, s, wire, phases);
  MemoryEstimate e;
  e.peak.name = "start";
  for (MemoryPhase& ph : phases) {
    add_base(o, s, ph);
    std::sort(ph.host.begin(), ph.host.end(), [](const MemoryPart& a, const MemoryPart& b) { return a.bytes > b.bytes; });
    if (ph.host_bytes() > e.peak.host_bytes()) e.peak = ph;
    e.device_bytes = std::max(e.device_bytes, ph.device_bytes);
  }
  if (phases.empty()) add_base(o, s, e.peak);
  return e;
}

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, bytes < 10e9 ? "%.2f GB" : "%.1f GB", bytes / 1e9);
  return text;
}

std::string describe(const MemoryPhase& ph) {
  std::string text = ph.name + ":";
  for (size_t i = 0; i < ph.host.size() && i < 4; ++i)  // the largest (sorted)
    text += (i ? ", " : " ") + ph.host[i].what + " " + gigabytes(ph.host[i].bytes);
  return text;
}

}  // namespace epx::bench
