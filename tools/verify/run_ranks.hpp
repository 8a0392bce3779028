// Runs one function per rank of a HostWorld, each on its own thread, and collects errors.
#pragma once
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "epx/epx.hpp"

namespace epx::verify {

// fn(group) runs on `ranks` threads. Returns each rank's exception message ("" when it returned).
inline std::vector<std::string> run_ranks(int ranks, const std::function<void(const Group&)>& fn) {
  HostWorld world(ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(world.group(r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(exception without message)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace epx::verify
