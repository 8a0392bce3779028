#!/usr/bin/env bash
# One device call for what waits on a GPU (docs/lab/2026-12-08-session28.md, "Next call"):
#  1. lab/ipc_probe.cu: do two processes' kernels meet on one GPU, plainly, under memcheck and
#     racecheck, and forked under --target-processes all?
#  2. lab/shared-gpu-processes.patch applied: the build, the shared-GPU tests and the process runs
#     at EP2 and EP4 against the reference (device-check.sh tests);
#  3. the sanitizers on EP2 as processes (device-check.sh sanitize, its shared part);
#  4. with the time left, lab/ll-div32.patch and lab/ll-sum4x2.patch against the tree in alternated
#     rounds (scripts/source-ab.sh: the decode preset at EP1 and on the shared GPU at EP2, then EPLB
#     at decode and at V3; each binary's records verified).
# CALL_S: the seconds the call may take (default 585); each step is capped to fit. Everything
# lands in $OUT as one tgz.
#   usage (repository root, on the device machine; carry .deps): [CALL_S=...] bash lab/next-device-call.sh
cd "$(dirname "$0")/.."
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
budget=${CALL_S:-585}
nvidia-smi --query-gpu=name --format=csv,noheader
# The copied tree may have no .git: patch(1) applies a git diff's new files as well.
patch -s -p1 --forward < lab/shared-gpu-processes.patch && echo "shared-gpu-processes.patch applied"
probe() {  # label, wrapper...: ranks 0 and 1 of the probe as two processes
  local label=$1; shift
  local f=/tmp/ipc-handle-$label
  rm -f "$f"
  ( timeout 25 "$@" /tmp/epx-ipc-probe 0 "$f" 20 30000 > "$OUT/probe-$label-0.log" 2>&1; echo "rc=$?" >> "$OUT/probe-$label-0.log" ) &
  ( timeout 25 "$@" /tmp/epx-ipc-probe 1 "$f" 20 30000 > "$OUT/probe-$label-1.log" 2>&1; echo "rc=$?" >> "$OUT/probe-$label-1.log" ) &
  wait
  echo "== probe $label"; grep -hE "epx-ipc-probe|SUMMARY|rc=" "$OUT/probe-$label"-*.log
}
{
  nvcc -O2 -std=c++17 --generate-code=arch=compute_90,code=sm_90 -o /tmp/epx-ipc-probe lab/ipc_probe.cu || echo "probe build failed"
  probe plain env
  probe memcheck compute-sanitizer --tool memcheck --error-exitcode 9
  probe racecheck compute-sanitizer --tool racecheck --error-exitcode 9
  echo "== probe fork under memcheck"
  timeout 25 compute-sanitizer --target-processes all --tool memcheck --error-exitcode 9 /tmp/epx-ipc-probe fork \
    /tmp/ipc-handle-fork 20 30000 2>&1 | tail -n 6
  echo "probe done at $(el) s"
} > "$OUT/probe.txt" 2>&1
cat "$OUT/probe.txt"
( GTEST_FILTER='*shared*' ENGINE_FILTER='-*' timeout 300 bash scripts/device-check.sh tests ) > "$OUT/tests.txt" 2>&1
echo "tests done at $(el) s"; grep -E "^==|SUMMARY" "$OUT/tests.txt"
# The sanitizers: up to 200 s, leaving 135 s for the A/B when the call is long enough for both.
left=$(( budget - 135 - $(el) ))
[ $left -gt 200 ] && left=200
[ "$budget" -lt 500 ] && left=$(( budget - 10 - $(el) ))
if [ $left -gt 40 ]; then
  ( SANITIZE_PARTS=shared timeout $left bash scripts/device-check.sh sanitize ) > "$OUT/sanitize.txt" 2>&1
  echo "sanitize done at $(el) s"; grep -E "^==|SUMMARY" "$OUT/sanitize.txt" | head -20
fi
left=$(( budget - $(el) ))
if [ $left -gt 90 ]; then
  ( AB_RUNS=2 SOURCE_VARIANTS=$'div32=patch -s -p1 < lab/ll-div32.patch\nsum4x2=patch -s -p1 < lab/ll-sum4x2.patch' \
    AB_ARGS=$'--preset ll --ops ll_dispatch,ll_combine --wire fp8\n--preset ll --ops ll_dispatch --wire bf16,nvfp4\n--preset ll --ops ll_dispatch,ll_combine --wire fp8 --shared-gpu --ranks 2\n--preset ll --ops ll_dispatch --wire fp8 --replicas 2\n--wire bf16 --layout rank_major --ops dispatch --replicas 2' \
    timeout $left bash scripts/source-ab.sh ) > "$OUT/ab.txt" 2>&1
  echo "ab done at $(el) s"; cut -c1-220 "$OUT/ab.txt" | tail -40
  # Cut short by the cap: source-ab printed no table, but its log has every run so far.
  grep -q "^SUMMARY: source-ab" "$OUT/ab.txt" || sort -s -k1,2 "$OUT/source-ab.log" 2>/dev/null | cut -c1-200 | tail -60
fi
tar czf /tmp/epx-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/epx-out.tgz "$OUT/"
