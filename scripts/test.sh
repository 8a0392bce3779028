#!/usr/bin/env bash
# Sets up, builds and runs every test (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
