#!/usr/bin/env bash
# Sets up, builds and runs epx-bench; extra arguments go to epx-bench
# (default: the host backend, 4 ranks, results in bench-out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
if [ $# -eq 0 ]; then
  set -- --backend host --ranks 4 --json bench-out.json
fi
exec ./build/epx-bench "$@"
