// Records as they are measured: record_sink.hpp.
#include "bench/record_sink.hpp"

#include "bench/floors.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace epx::bench {

namespace {

void print_header() {
  std::printf("%-18s %-10s %-13s %4s %11s %11s %11s %10s %10s %6s %s\n", "op", "dtype", "layout", "sms", "median_us",
              "min_us", "max_us", "logical", "wire", "link", "verified");
  std::printf("%-18s %-10s %-13s %4s %11s %11s %11s %10s %10s %6s\n", "", "", "", "", "", "", "", "GB/s", "GB/s", "frac");
}

void print_row(const Record& r) {
  const std::string verified = r.verified ? "yes" : is_baseline(r.op) ? "(baseline)" : "NO: " + r.verify_error;
  std::printf("%-18s %-10s %-13s %4lld %11.1f %11.1f %11.1f %10.2f %10.2f %6.2f %s\n", r.op.c_str(), r.dtype.c_str(),
              r.layout.c_str(), static_cast<long long>(r.sms), r.time_us, r.min_us, r.max_us, r.logical_gbps,
              r.wire_gbps, r.link_fraction, verified.c_str());
  if (r.kernel_us > 0)  // the low-latency kernels' own time (kernel_timer.hpp)
    std::printf("%s %s: kernel time %.1f us per call (median of %d graph replays, CUPTI)\n", r.op.c_str(),
                r.dtype.c_str(), r.kernel_us, r.iters);
}

}  // namespace

RecordSink::RecordSink(std::string json_path) : path_(std::move(json_path)) {
  print_header();
  std::fflush(stdout);
  save();
}

void RecordSink::add(Record r) {
  records_.push_back(std::move(r));
  save();  // first: a row on screen is a record on disk
  print_row(records_.back());
  std::fflush(stdout);  // seen now, also when stdout is a file or a pipe
}

void RecordSink::add_link_fractions() {
  const Record* peer = nullptr;
  for (const Record& r : records_)
    if (r.op == "peer_copy") peer = &r;
  if (!peer) return;
  const double link_gbps = peer->wire_gbps;
  std::printf("link_fraction (wire GB/s / peer_copy's %.1f GB/s):\n", link_gbps);
  for (Record& r : records_) {
    r.link_fraction = r.wire_gbps / link_gbps;
    std::printf("  %-18s %-10s %-13s %4d %6.2f\n", r.op.c_str(), r.dtype.c_str(), r.layout.c_str(), r.sms,
                r.link_fraction);
  }
  std::fflush(stdout);
  save();
}

void RecordSink::add_floors(bool shared_gpu) {
  if (bench::add_floors(records_, shared_gpu) == 0) return;
  std::printf("floors (HBM bytes at this run's local_read / local_write / local_copy rates, same SMs):\n");
  std::printf("  %-18s %-10s %-13s %4s %11s %11s %7s\n", "op", "dtype", "layout", "sms", "median_us", "floor_us", "ratio");
  for (const Record& r : records_)
    if (r.floor_us > 0)
      std::printf("  %-18s %-10s %-13s %4d %11.1f %11.1f %7.2f\n", r.op.c_str(), r.dtype.c_str(), r.layout.c_str(),
                  r.sms, r.time_us, r.floor_us, r.floor_ratio);
  std::fflush(stdout);
  save();
}

void RecordSink::save() const {
  if (path_.empty() || write_json(path_, records_)) return;
  throw std::runtime_error("cannot write " + path_ + ": " + std::strerror(errno));
}

}  // namespace epx::bench
