// Floors of the high-throughput ops: floors.hpp.
#include "bench/floors.hpp"

#include <algorithm>

namespace epx::bench {

HbmBytes rank_hbm_bytes(const std::string& op, const verify::Problem& p, WireFormat wire, bool weighted,
                        const RankOutputs& out, int r) {
  const double bf16_row = 2.0 * static_cast<double>(p.cfg.hidden);
  const auto tokens = static_cast<double>(p.inputs[r].tokens);
  const auto received = static_cast<double>(out.dispatched.recv_x.size(0));
  if (op == "dispatch") return {tokens * bf16_row, received * wire_row_bytes(wire, p.cfg.hidden)};
  if (op == "combine" || op == "dispatch_backward") return {received * bf16_row, tokens * bf16_row};
  if (op == "combine_backward") return {(tokens + (weighted ? received : 0.0)) * bf16_row, received * bf16_row};
  return {};
}

HbmBytes busiest(const std::vector<HbmBytes>& ranks) {
  HbmBytes most;
  for (const HbmBytes& b : ranks)
    if (b.read + b.write > most.read + most.write) most = b;
  return most;
}

double floor_us(const HbmBytes& b, double read_rate, double write_rate, double copy_rate) {
  const double copied = std::min(b.read, b.write);
  return copied / copy_rate + (b.read - copied) / read_rate + (b.write - copied) / write_rate;
}

namespace {

// Bytes per microsecond of the baseline `op` at `sms` blocks in `records`; 0 when there is none.
double rate_of(const std::vector<Record>& records, const std::string& op, int sms) {
  for (const Record& r : records)
    if (r.op == op && r.sms == sms && r.time_us > 0) return r.logical_bytes / r.time_us;
  return 0.0;
}

}  // namespace

int add_floors(std::vector<Record>& records, bool shared_gpu) {
  int set = 0;
  for (Record& r : records) {
    if (r.hbm_read_bytes <= 0 && r.hbm_write_bytes <= 0) continue;
    // On the shared GPU every rank's bytes move at every rank's SMs: the whole GPU's work.
    const int sms = shared_gpu ? r.sms * r.ranks : r.sms;
    const double scale = shared_gpu ? r.ranks : 1.0;
    const double read = rate_of(records, "local_read", sms), write = rate_of(records, "local_write", sms),
                 copy = rate_of(records, "local_copy", sms);
    if (read <= 0 || write <= 0 || copy <= 0) continue;
    r.floor_us = floor_us({scale * r.hbm_read_bytes, scale * r.hbm_write_bytes}, read, write, copy);
    r.floor_ratio = r.time_us / r.floor_us;
    ++set;
  }
  return set;
}

}  // namespace epx::bench
