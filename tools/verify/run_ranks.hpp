// Runs one function per rank, each on its own thread, and collects errors.
#pragma once
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "epx/epx.hpp"

namespace epx::verify {

// fn(r) runs on `ranks` threads, r = 0 .. ranks - 1. Returns each rank's exception message (""
// when it returned).
inline std::vector<std::string> run_threads(int ranks, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(exception without message)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// fn(group) on each rank of a HostWorld of `ranks` ranks, as run_threads.
inline std::vector<std::string> run_ranks(int ranks, const std::function<void(const Group&)>& fn) {
  HostWorld world(ranks);
  return run_threads(ranks, [&](int r) { fn(world.group(r)); });
}

}  // namespace epx::verify
