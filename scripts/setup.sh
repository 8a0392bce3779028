#!/usr/bin/env bash
# Installs what epx needs to build on a Debian machine (no-op when it is all there),
# then configures and builds into build/. Used by test.sh and bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
command -v git >/dev/null || need+=(git)
command -v pkg-config >/dev/null || need+=(pkg-config)  # the installed-tree test (scripts/consumer-test.sh)
command -v python3 >/dev/null || need+=(python3)        # epx-bench record tests (tests/bench_records_check.py)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/gmock/gmock.h ] || need+=(libgmock-dev)
[ -f /usr/include/pybind11/pybind11.h ] || need+=(pybind11-dev)   # the Python module (python/)
compgen -G '/usr/include/python3*/Python.h' >/dev/null || need+=(python3-dev)
/usr/bin/python3 -c 'import torch' 2>/dev/null || need+=(python3-torch)   # the Python tests
/usr/bin/python3 -c 'import pytest' 2>/dev/null || need+=(python3-pytest)
/usr/bin/python3 -c 'import numpy' 2>/dev/null || need+=(python3-numpy)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${need[@]}"
fi

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DEPX_WERROR=ON ${EPX_CMAKE_ARGS:-}
cmake --build build -j "$jobs"
