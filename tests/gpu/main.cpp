// The GPU tests' main: the shared-GPU transport runs every rank's streams on one GPU, and with
// CUDA's default of 8 hardware queues two ranks' streams share one, so a kernel waiting for a
// peer can hold back the peer's kernel queued behind it until the wait times out (docs/cuda.md).
// The variable must be set before CUDA starts; a value the caller set is kept.
#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
