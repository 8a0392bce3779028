#!/usr/bin/env bash
# Runs epx's Python tests (python/tests) and the example (examples/moe_layer.py) against the module
# of a build tree, with the interpreter that module was built for. The CPU tests run everywhere;
# the GPU tests (tests/test_gpu.py) run where a GPU is and are skipped elsewhere; on a GPU machine
# the example runs on the CPU and on GPU 0.
#
#   bash scripts/python-test.sh [BUILD_DIR] [pytest arguments...]    (BUILD_DIR: build)
#
# The build tree needs the module (target epx_python, built by default where pybind11 is found;
# ctest runs the same tests one file at a time). Writes JUnit XML to $OUT/python-tests.xml when
# $OUT is set (the GPU machine's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[ $# -gt 0 ] && shift
if [ ! -f "$build/python/interpreter" ] || ! ls "$build"/python/epx/_C.*.so >/dev/null 2>&1; then
  echo "python-test: no Python module in $build/python/epx: configure $build with pybind11 and Python 3 headers" \
       "found (apt-get install pybind11-dev python3-dev) and build it (cmake --build $build --target epx_python)" >&2
  exit 1
fi
python=$(cat "$build/python/interpreter")
build_dir=$(cd "$build" && pwd)
export PYTHONPATH="$build_dir/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
junit=()
[ -n "${OUT:-}" ] && junit=(--junitxml "$OUT/python-tests.xml")
echo "python-test: $python, module from $build/python/epx"
"$python" -m pytest -q -p no:cacheprovider -rs "${junit[@]}" python/tests "$@"
"$python" examples/moe_layer.py --ranks 2
if "$python" -c "import epx, sys; sys.exit(0 if epx.has_cuda and epx.cuda_available() else 1)"; then
  "$python" examples/moe_layer.py --device cuda
fi
echo "python-test: OK"
