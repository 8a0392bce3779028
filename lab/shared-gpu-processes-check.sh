#!/usr/bin/env bash
# One device call that checks lab/shared-gpu-processes.patch on a GPU (docs/lab/2026-12-07-session27.md):
# lab/ipc_probe.cu (do two processes' kernels meet on one GPU, plainly and under the sanitizer?),
# the patch's build, the shared-GPU tests and its process runs at EP2 and EP4 against the
# reference (device-check.sh tests), the sanitizers on EP2 as processes (device-check.sh sanitize,
# its shared part), and the NVFP4 encoder's profile and SASS. Everything lands in $OUT as one tgz.
#   usage (repository root, on the device machine): bash lab/shared-gpu-processes-check.sh
# Apply the patch first where the tree does not have it (this script does, when it applies).
cd "$(dirname "$0")/.."
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
git apply --check lab/shared-gpu-processes.patch 2>/dev/null && git apply lab/shared-gpu-processes.patch
probe() {  # label, wrapper...: ranks 0 and 1 of the probe as two processes
  local label=$1; shift
  local f=/tmp/ipc-handle-$label
  rm -f "$f"
  ( timeout 60 "$@" /tmp/epx-ipc-probe 0 "$f" 20 30000 > "$OUT/probe-$label-0.log" 2>&1; echo "rc=$?" >> "$OUT/probe-$label-0.log" ) &
  ( timeout 60 "$@" /tmp/epx-ipc-probe 1 "$f" 20 30000 > "$OUT/probe-$label-1.log" 2>&1; echo "rc=$?" >> "$OUT/probe-$label-1.log" ) &
  wait
  echo "== probe $label"; grep -hE "epx-ipc-probe|SUMMARY|rc=" "$OUT/probe-$label"-*.log
}
{
  nvcc -O2 -std=c++17 --generate-code=arch=compute_90,code=sm_90 -o /tmp/epx-ipc-probe lab/ipc_probe.cu || echo "probe build failed"
  probe plain env
  probe memcheck compute-sanitizer --tool memcheck --error-exitcode 9
  probe racecheck compute-sanitizer --tool racecheck --error-exitcode 9
  echo "== probe fork under memcheck"
  timeout 60 compute-sanitizer --target-processes all --tool memcheck --error-exitcode 9 /tmp/epx-ipc-probe fork \
    /tmp/ipc-handle-fork 20 30000 2>&1 | tail -n 6
  echo "probe done at $(el) s"
} > "$OUT/probe.txt" 2>&1
( GTEST_FILTER='*shared*' ENGINE_FILTER='-*' timeout 330 bash scripts/device-check.sh tests ) > "$OUT/tests.txt" 2>&1
echo "tests done at $(el) s" >> "$OUT/tests.txt"
left=$(( 470 - $(el) ))  # the sanitizers, then the profile in what is left of a 600-s call
if [ $left -gt 60 ]; then
  ( SANITIZE_PARTS=shared timeout $left bash scripts/device-check.sh sanitize ) > "$OUT/sanitize.txt" 2>&1
  echo "sanitize done at $(el) s" >> "$OUT/sanitize.txt"
fi
# Which instructions the NVFP4 encode's ~19 a value are (issue #27's encodes): its ncu report and
# its SASS (sass.log; count the loop's opcodes on the host).
left=$(( 580 - $(el) ))
[ $left -gt 60 ] && ( SASS_KERNELS=encode_rows_kernel PROFILES=encode_nvfp4 timeout $left bash scripts/device-check.sh profile ) > "$OUT/profile.txt" 2>&1
cat "$OUT/probe.txt"; grep "^==" "$OUT/tests.txt"; grep "^==" "$OUT/sanitize.txt" 2>/dev/null; grep "^==" "$OUT/profile.txt"
cd "$OUT" && tar czf ../out.tgz . && rm -rf ./* && mv ../out.tgz .
