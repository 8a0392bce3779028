#include "bench/json.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace epx::bench {

namespace {

std::string quoted(const std::string& s) {
  std::ostringstream os;
  os << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') os << '\\' << c;
    else if (c < 0x20) os << "\\u" << std::hex << std::setw(4) << std::setfill('0') << int(c) << std::dec;
    else os << c;
  }
  os << '"';
  return os.str();
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os << std::setprecision(6) << v;
  return os.str();
}

}  // namespace

bool write_json(const std::string& path, const std::vector<Record>& records) {
  const std::string temp = path + ".tmp";
  std::ofstream f(temp);
  if (!f) return false;
  f << "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    f << "  {\"op\": " << quoted(r.op) << ", \"dtype\": " << quoted(r.dtype) << ", \"layout\": " << quoted(r.layout)
      << ", \"ranks\": " << r.ranks << ", \"tokens\": " << r.tokens << ", \"hidden\": " << r.hidden
      << ", \"topk\": " << r.topk << ", \"experts\": " << r.experts << ", \"alignment\": " << r.alignment
      << ", \"routing\": " << quoted(r.routing) << ", \"sms\": " << r.sms << ", \"time_us\": " << number(r.time_us)
      << ", \"min_us\": " << number(r.min_us) << ", \"max_us\": " << number(r.max_us) << ", \"iters\": " << r.iters
      << ", \"logical_gbps\": " << number(r.logical_gbps) << ", \"wire_gbps\": " << number(r.wire_gbps)
      << ", \"link_fraction\": " << number(r.link_fraction)
      << ", \"logical_bytes\": " << number(r.logical_bytes) << ", \"verified\": " << (r.verified ? "true" : "false");
    if (r.hbm_read_bytes > 0 || r.hbm_write_bytes > 0)
      f << ", \"hbm_read_bytes\": " << static_cast<long long>(r.hbm_read_bytes)
        << ", \"hbm_write_bytes\": " << static_cast<long long>(r.hbm_write_bytes);  // whole rows: exact
    if (r.floor_us > 0) f << ", \"floor_us\": " << number(r.floor_us) << ", \"floor_ratio\": " << number(r.floor_ratio);
    if (!r.combine_wire.empty()) f << ", \"combine_wire\": " << quoted(r.combine_wire);
    if (!r.verify_error.empty()) f << ", \"verify_error\": " << quoted(r.verify_error);
    if (!r.transport.empty()) f << ", \"transport\": " << quoted(r.transport);
    if (!r.timing.empty()) f << ", \"timing\": " << quoted(r.timing);
    if (r.kernel_us > 0) f << ", \"kernel_us\": " << number(r.kernel_us);
    if (!r.weights_at.empty()) f << ", \"weights_at\": " << quoted(r.weights_at);
    if (!r.ranks_as.empty()) f << ", \"ranks_as\": " << quoted(r.ranks_as);
    if (r.shared_expert) f << ", \"shared_expert\": true";
    if (r.replicas > 0) f << ", \"replicas\": " << r.replicas;
    if (r.capacity_rows > 0) f << ", \"mode\": \"capacity\", \"capacity_rows\": " << r.capacity_rows;
    if (!r.engines.empty()) f << ", \"engines\": " << quoted(r.engines);
    f << ", \"backend\": " << quoted(r.backend) << ", \"gpu\": " << (r.gpu.empty() ? "null" : quoted(r.gpu))
      << ", \"git_commit\": " << quoted(r.git_commit) << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  f << "]\n";
  f.close();
  return f && std::rename(temp.c_str(), path.c_str()) == 0;
}

}  // namespace epx::bench
