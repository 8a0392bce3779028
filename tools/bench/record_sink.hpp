// Where epx-bench's records go, each as soon as it is measured: its table row, printed and
// flushed, and the JSON file, rewritten whole after every record (json.hpp: a temporary file
// renamed over it). A run that dies midway leaves every record finished before it, on screen
// and in a valid JSON file.
#pragma once
#include <string>
#include <vector>

#include "bench/json.hpp"

namespace epx::bench {

class RecordSink {
 public:
  // Prints the table's header; with a path, writes an empty list there at once, so a path that
  // cannot be written fails before anything runs.
  explicit RecordSink(std::string json_path);

  // Prints r's row (and its kernel time, when measured) and rewrites the JSON file.
  void add(Record r);

  // With a peer_copy record (CUDA, 2+ GPUs, measured last): every record's link_fraction,
  // printed after the table and written to the JSON file.
  void add_link_fractions();

  // With the local_read / local_write / local_copy baselines (CUDA, measured last): every
  // high-throughput record's floor_us and floor_ratio (floors.hpp), printed and written.
  void add_floors(bool shared_gpu);

  const std::vector<Record>& records() const { return records_; }

 private:
  void save() const;  // throws when the file cannot be written

  std::string path_;
  std::vector<Record> records_;
};

}  // namespace epx::bench
