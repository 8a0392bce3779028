#!/usr/bin/env bash
# Performance sweeps on the GPU machine (after scripts/device-check.sh built build-gpu): epx-bench
# once per argument set, verified, each run's records kept.
#   SWEEP_SETS="--sms 8|--sms 16|--tokens 1024"   argument sets, '|'-separated (default: SM budgets)
#   SWEEP_ARGS="..."                              epx-bench arguments common to every set
# Environment such as EPX_PROFILE=1 (per-step times on stderr) applies to all; "--send-blocks N" in a
# set tries another split of the SM budget (BufferConfig::send_blocks).
# Output: $OUT/sweep.log and $OUT/sweep.json (every record of every set, one JSON list).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
ranks=$(nvidia-smi -L | wc -l)
IFS='|' read -r -a sets <<< "${SWEEP_SETS:---sms 8|--sms 16|--sms 32}"
parts=()
for i in "${!sets[@]}"; do
  echo "== ${sets[$i]}" | tee -a "$OUT/sweep.log"
  # shellcheck disable=SC2086  # word splitting of the argument sets is intended
  timeout 150 ./build-gpu/epx-bench --backend cuda --ranks "$ranks" ${SWEEP_ARGS:-} ${sets[$i]} \
    --json "$OUT/sweep-$i.part" 2>&1 | grep -vE "^\[|^epx-bench:|^op|^  " | tee -a "$OUT/sweep.log"
  [ -s "$OUT/sweep-$i.part" ] && parts+=("$OUT/sweep-$i.part")
done
python3 - "$OUT/sweep.json" "${parts[@]}" <<'PY'
import json, sys
records = []
for part in sys.argv[2:]:
    records += json.load(open(part))
json.dump(records, open(sys.argv[1], "w"), indent=1)
PY
rm -f "$OUT"/sweep-*.part
