#!/usr/bin/env bash
# Performance sweeps on the GPU machine (after scripts/device-check.sh built build-gpu): epx-bench
# once per setting, verified, each record kept. Settings come from the environment:
#   SWEEP_SEND="8 12 16"   EPX_SEND_BLOCKS values (blocks that send; the rest receive/reduce)
#   SWEEP_SMS="16 24"      num_sms values
#   SWEEP_ARGS="..."       epx-bench arguments for every run (shape, wire, layout, ops)
# EPX_PROFILE=1 adds per-step times (stderr). Output: $OUT/sweep.log, $OUT/sweep-*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
ranks=$(nvidia-smi -L | wc -l)
for sms in ${SWEEP_SMS:-24}; do
  for send in ${SWEEP_SEND:-default}; do
    tag="sms${sms}_send${send}"
    echo "== $tag" | tee -a "$OUT/sweep.log"
    if [ "$send" = default ]; then unset EPX_SEND_BLOCKS; else export EPX_SEND_BLOCKS=$send; fi
    timeout 120 ./build-gpu/epx-bench --backend cuda --ranks "$ranks" --sms "$sms" ${SWEEP_ARGS:-} \
      --json "$OUT/sweep-$tag.json" 2>&1 | grep -vE "^\[|^epx-bench:|^op|^  " | tee -a "$OUT/sweep.log"
  done
done
