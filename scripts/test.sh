#!/usr/bin/env bash
# Sets up, builds and runs every test (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j "$jobs"

# The C ABI and the fuzzed validation again, under AddressSanitizer (with LeakSanitizer) and
# UBSan: host backend only, only those two targets, Debug (the cheapest to build: -O0, with
# assertions). Any report fails the test. LeakSanitizer stops the process's threads with ptrace;
# that works on a machine like CI's. Where it cannot (under a debugger or strace, or a container
# that forbids ptrace: "LeakSanitizer has encountered a fatal error"), run with
# ASAN_OPTIONS=detect_leaks=0.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DEPX_WERROR=ON ${EPX_CMAKE_ARGS:-} \
  -DEPX_CUDA=OFF -DEPX_SANITIZE=address,undefined
cmake --build build-asan -j "$jobs" --target epx_c_api_test epx_fuzz_tests
ctest --test-dir build-asan -R '^(c_api|fuzz\.)' --no-tests=error --output-on-failure -j "$jobs"
