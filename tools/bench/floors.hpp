// The floor of each high-throughput op (issue #27's measure, docs/benchmarks.md "Floors"): the
// bytes the op must read and write in HBM, at the rates this run's baselines measured with the
// record's SM budget. Rows only: an op reads each input row once and writes each output row once;
// metadata (indices, weights, layout arrays) is under 1% of the rows at V3 and left out.
#pragma once
#include <string>
#include <vector>

#include "bench/ht_run.hpp"
#include "bench/json.hpp"

namespace epx::bench {

struct HbmBytes {
  double read = 0, write = 0;
};

// Rank r's, from its outputs `out`:
// dispatch: T rows of bf16 x read, its received rows (padding rows too) written in the wire format;
// combine, dispatch_backward: the N received rows read in bf16, T rows written;
// combine_backward: T rows of grad_out (and, weighted, the N rows of y) read, N rows of grad_y written.
HbmBytes rank_hbm_bytes(const std::string& op, const verify::Problem& p, WireFormat wire, bool weighted,
                        const RankOutputs& out, int r);
// The busiest rank's (the op ends with its slowest rank).
HbmBytes busiest(const std::vector<HbmBytes>& ranks);

// The floor of moving `b` at these rates (bytes/us): min(read, write) bytes as a copy (each byte
// read once and written once, at local_copy's rate), the rest of the reads at local_read's rate and
// the rest of the writes at local_write's. A copy's floor is local_copy's time.
double floor_us(const HbmBytes& b, double read_rate, double write_rate, double copy_rate);

// Sets floor_us and floor_ratio (time_us / floor_us) of every record with HBM bytes whose SM budget
// (times its ranks on the shared GPU, where every rank's SMs share one GPU) has local_read,
// local_write and local_copy records in `records`; returns how many it set.
int add_floors(std::vector<Record>& records, bool shared_gpu);

}  // namespace epx::bench
