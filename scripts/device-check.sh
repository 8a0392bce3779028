#!/usr/bin/env bash
# One call on the GPU machine: configure against the PyTorch wheel's NCCL, build with all cores,
# run the GPU tests against the CPU reference, compute-sanitizer on a small shape (EP1: the
# sanitizer serializes kernels, so ranks waiting on each other could not progress), epx-bench.
# Logs and JSON go to $OUT; a short summary is printed last.
#   usage: [EPX_GIT_COMMIT=$(git rev-parse --short=12 HEAD)] [GTEST_FILTER=...] [GTEST_REPEAT=n] [BENCH_ARGS=...] [SANITIZE_TOOLS=...] \
#          [AB_ENV="VAR=value ...[;VAR=value ...]"] bash scripts/device-check.sh [tests|sanitize|python|bench|targets|ab|interleave|procs|sweep|engines|ll|holdback|profile|chain|all]...
#          (default: all but ab, interleave, procs, sweep, engines, profile, holdback, chain, targets)
# The driver probes (lab/) are built and run by hand (lab/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The shared-GPU transport runs one stream per rank on one GPU; with fewer hardware queues than
# streams, a rank's waiting kernel can block another rank's kernel queued behind it.
export CUDA_DEVICE_MAX_CONNECTIONS=32
steps=${*:-all}
summary=()
note() { summary+=("$1"); echo "== $1"; }
# The names of the tests a gtest log lists as failed, once each, on one line.
failed_tests() { grep -E '^\[  FAILED  \] .*\(' "$1" | sed -E 's/^\[  FAILED  \] ([^ ,]*).*/\1/' | sort -u | tr '\n' ' '; }

NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(nvidia.nccl.__path__[0])")
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
gtest_args=()
[ -f /usr/include/gtest/gtest.h ] || gtest_args=(-DEPX_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# EPX_GIT_COMMIT: the commit the copied tree came from (it has no .git), for benchmark records.
if ! cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DEPX_NCCL_ROOT="$NCCL_DIR" "${gtest_args[@]}" \
     ${EPX_GIT_COMMIT:+-DEPX_GIT_COMMIT=$EPX_GIT_COMMIT} \
     > "$OUT/configure.log" 2>&1 || ! cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/configure.log" "$OUT/build.log"
  echo "SUMMARY: build failed"
  exit 1
fi
note "built against NCCL in $NCCL_DIR"

# Steps that run only when named ("all" leaves them out).
optional_steps="ab interleave procs sweep engines profile holdback chain targets"
want() { [[ ( " $steps " == *" all "* && " $optional_steps " != *" $1 "* ) || " $steps " == *" $1 "* ]]; }
gpus=$(nvidia-smi -L | wc -l)

if want tests; then
  # A lost flag or signal fails a test in 10 s instead of the 60 s default.
  # GTEST_REPEAT=n runs the suite n times (intermittent failures).
  EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-10000} timeout 300 ./build-gpu/tests/epx_gpu_tests --gtest_filter="${GTEST_FILTER:-*}" \
    --gtest_repeat="${GTEST_REPEAT:-1}" --gtest_output=json:"$OUT/gpu_tests.json" > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED)|^\[  FAILED  \]|Failure|Which is|Actual|Expected" "$OUT/gpu_tests.log" | head -60
  failed=$(failed_tests "$OUT/gpu_tests.log")
  note "gpu tests rc=$rc: $(grep -E '^\[  PASSED' "$OUT/gpu_tests.log") failed: ${failed:-none}"
  # Dispatch and combine have two engines each (SM stores; copy engines, the defaults at two
  # ranks): the high-throughput tests once more with each forced, at every rank count.
  # The SM engines' pass without the tests' output poisoning: its memsets stand between the plan
  # and the transfer kernel, so only an unpoisoned pass starts the transfer early (docs/cuda.md).
  for engine in sm copy; do
    poison=1
    [ $engine = sm ] && poison=0
    EPX_POISON_OUTPUTS=$poison EPX_DISPATCH_ENGINE=$engine EPX_COMBINE_ENGINE=$engine EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-10000} timeout 300 \
      ./build-gpu/tests/epx_gpu_tests --gtest_filter="${ENGINE_FILTER:-*Cuda*:-*LowLatency*}" > "$OUT/gpu_tests_$engine.log" 2>&1
    rc=$?
    failed=$(failed_tests "$OUT/gpu_tests_$engine.log")
    note "gpu tests, $engine engines (poisoned outputs: $poison), rc=$rc: $(grep -E '^\[  PASSED' "$OUT/gpu_tests_$engine.log") failed: ${failed:-none}"
  done
fi
if want python; then
  # The Python package's tests (EP1 over NCCL, the shared GPU, graphs, compile) and the example, then
  # the same dispatch and combine through Python and through epx-bench, alternated three times
  # (the machines are noisy): Python must add no copies (docs/python.md).
  OUT="$OUT" timeout 900 bash scripts/python-test.sh build-gpu > "$OUT/python_tests.log" 2>&1
  rc=$?
  grep -E "passed|failed|error|Error" "$OUT/python_tests.log" | tail -15
  note "python tests rc=$rc: $(grep -E '[0-9]+ (passed|failed)' "$OUT/python_tests.log" | tail -1)"
  py=$(cat build-gpu/python/interpreter)
  # The examples run whatever the tests said (python-test.sh stops at a failing test).
  PYTHONPATH=build-gpu/python:python timeout 120 "$py" examples/moe_layer.py --device cuda > "$OUT/example_cuda.log" 2>&1
  note "example on the GPU rc=$?: $(tail -1 "$OUT/example_cuda.log")"
  for round in 1 2 3; do
    for stream in own default; do  # own: the same call as epx-bench's; default: torch's legacy stream
      PYTHONPATH=build-gpu/python:python timeout 300 "$py" python/bench/bench_ht.py --stream $stream ${PY_BENCH_ARGS:-} \
        >> "$OUT/python_bench_ep1.jsonl" 2>> "$OUT/python_bench_ep1.err"
    done
    timeout 300 ./build-gpu/epx-bench --backend cuda --ranks 1 --preset v3 --ops dispatch,combine --wire bf16 \
      --layout expert_major --json "$OUT/epx_bench_ep1_$round.json" > "$OUT/epx_bench_ep1_$round.log" 2>&1
  done
  python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
py = [json.loads(l) for l in open(f"{out}/python_bench_ep1.jsonl") if l.startswith("{")]
cpp = [r for f in sorted(glob.glob(f"{out}/epx_bench_ep1_*.json")) for r in json.load(open(f))]
for op in ("dispatch", "combine"):
    c = [r["time_us"] for r in cpp if r.get("op") == op]
    for stream in ("own", "default"):
        p = [r["median_us"] for r in py if r.get("op") == op and r.get("stream", "default") == stream]
        if p and c:
            print(f"python ({stream} stream) vs epx-bench {op}: python {sorted(p)} us, epx-bench {sorted(c)} us, "
                  f"ratio of medians {sorted(p)[len(p)//2] / sorted(c)[len(c)//2]:.3f}")
PY
fi
if want sanitize; then
  # Each tool twice: the SM path forced, then the copy-engine path (the default at one rank: nothing
  # is copied, but its kernels run: the receiver, the partial sums, the reducers).
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    for engine in sm copy; do
      EPX_DISPATCH_ENGINE=$engine EPX_COMBINE_ENGINE=$engine timeout 240 compute-sanitizer --tool $tool \
        --report-api-errors no --error-exitcode 9 ./build-gpu/tests/epx_gpu_tests \
        --gtest_filter='*nccl_R1_*' > "$OUT/sanitizer_${tool}_$engine.log" 2>&1
      rc=$?
      tail -3 "$OUT/sanitizer_${tool}_$engine.log"
      note "compute-sanitizer $tool, $engine engines, rc=$rc ($(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$OUT/sanitizer_${tool}_$engine.log") clean summaries)"
    done
  done
fi
if want bench; then
  # BENCH_ARGS overrides the shape and formats (default: the V3 preset, bf16 and fp8).
  timeout 400 ./build-gpu/epx-bench --backend cuda --ranks "$gpus" ${BENCH_ARGS:---wire bf16,fp8} \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  rc=$?
  cat "$OUT/bench.log" | tail -25
  note "epx-bench rc=$rc"
  # The issue's second SM budget in the same records: the same run at BENCH_SMS2 SMs (default 16;
  # empty skips it), appended to bench.json.
  if [ -n "${BENCH_SMS2-16}" ]; then
    timeout 400 ./build-gpu/epx-bench --backend cuda --ranks "$gpus" ${BENCH_ARGS:---wire bf16,fp8} --sms "${BENCH_SMS2-16}" \
      --json "$OUT/bench-sms2.json" > "$OUT/bench-sms2.log" 2>&1
    rc=$?
    grep -E "^(dispatch|combine)" "$OUT/bench-sms2.log" | cut -c1-80
    python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
if os.path.exists(f"{out}/bench-sms2.json"):
    records = json.load(open(f"{out}/bench.json")) + json.load(open(f"{out}/bench-sms2.json"))
    with open(f"{out}/bench.json", "w") as o:
        o.write("[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n")
    os.remove(f"{out}/bench-sms2.json")
PY
    note "epx-bench at ${BENCH_SMS2-16} SMs rc=$rc"
  fi
fi
if want targets; then
  # Every record issues #27 and #29 set a target for (docs/performance.md), into targets.json, then
  # tools/bench/check_targets.py's report: EP1 V3, every op, wire and layout at 24 and 16 SMs; EP1 at
  # 128 tokens; the shared GPU at EP2 and EP4 (rank-major); low-latency at EP1 (every wire) and on the
  # shared GPU at EP2.
  tb() { timeout 300 ./build-gpu/epx-bench --backend cuda "$@" >> "$OUT/targets.log" 2>&1 || echo "FAILED: $*" >> "$OUT/targets.log"; }
  for sms in 24 16; do tb --ranks 1 --wire bf16,fp8,nvfp4 --sms $sms --json "$OUT/targets-ep1-$sms.part"; done
  tb --ranks 1 --tokens 128 --wire bf16 --layout rank_major --ops dispatch,combine --json "$OUT/targets-t128.part"
  for r in 2 4; do
    tb --shared-gpu --ranks $r --wire bf16 --layout rank_major --ops dispatch,combine --json "$OUT/targets-shared$r.part"
  done
  tb --preset ll --ranks 1 --ops ll_dispatch,ll_combine --wire fp8,nvfp4,bf16 --json "$OUT/targets-ll.part"
  tb --preset ll --shared-gpu --ranks 2 --ops ll_dispatch,ll_combine --wire fp8 --json "$OUT/targets-ll-shared.part"
  python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
records = [r for f in sorted(glob.glob(f"{out}/targets-*.part")) for r in json.load(open(f))]
with open(f"{out}/targets.json", "w") as o:
    o.write("[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n")
PY
  rm -f "$OUT"/targets-*.part
  python3 tools/bench/check_targets.py "$OUT/targets.json" | tee "$OUT/targets-report.txt" | tail -40
  note "targets: $(grep -c ': meets$' "$OUT/targets-report.txt") met, $(grep -c ': misses$' "$OUT/targets-report.txt") missed, $(grep -c ': no record$' "$OUT/targets-report.txt") without a record (targets-report.txt)"
fi
if want ab; then
  # The same benchmark once more with AB_ENV's variables set (e.g. AB_ENV="EPX_DISPATCH_ENGINE=sm"):
  # two variants of one tree measured in one machine session (bench-ab.json).
  env ${AB_ENV:?ab needs AB_ENV, e.g. AB_ENV=EPX_DISPATCH_ENGINE=sm} timeout 400 ./build-gpu/epx-bench --backend cuda \
    --ranks "$gpus" ${BENCH_ARGS:---wire bf16,fp8} --json "$OUT/bench-ab.json" > "$OUT/bench-ab.log" 2>&1
  rc=$?
  tail -16 "$OUT/bench-ab.log"
  note "epx-bench with $AB_ENV rc=$rc"
fi
if want interleave; then
  # The defaults and AB_ENV's variants (';'-separated environments, e.g. "A=1;B=2 C=3") in
  # alternating runs, INTERLEAVE_RUNS of each: between two runs of one tree the medians move by up
  # to ~20 us, so a difference shows only when every run of one variant beats the other's
  # (interleave.log, lines labelled by variant; INTERLEAVE_ARGS picks the ops).
  IFS=';' read -ra ab_variants <<< "${AB_ENV:?interleave needs AB_ENV}"
  for i in $(seq "${INTERLEAVE_RUNS:-3}"); do
    for variant in default "${ab_variants[@]}"; do
      vars=()
      [ "$variant" != default ] && read -ra vars <<< "$variant"
      env "${vars[@]}" timeout 120 ./build-gpu/epx-bench --backend cuda --ranks "$gpus" \
        ${INTERLEAVE_ARGS:---wire bf16,fp8 --layout rank_major --ops dispatch} 2>&1 |
        grep -E '^(dispatch|combine)' | sed "s/^/[$variant] run $i: /" >> "$OUT/interleave.log"
    done
  done
  # Grouped by op, dtype, layout, then variant, runs in order.
  awk -F': ' '{split($2, f, " "); print f[1], f[2], f[3], $1 ":", $2}' "$OUT/interleave.log" | sort -s -k1,3 -k4,4
  note "interleaved runs: $(wc -l < "$OUT/interleave.log") lines (default vs ${#ab_variants[@]} variants: $AB_ENV)"
fi
if want procs; then
  # The benchmark of `bench` with one process per rank (--processes), as jobs and DeepEP's benchmark
  # run their GPUs: the host's API calls of one rank no longer wait behind another's (bench-procs.json).
  timeout 400 ./build-gpu/epx-bench --backend cuda --ranks "$gpus" ${BENCH_ARGS:---wire bf16,fp8} \
    --processes --json "$OUT/bench-procs.json" > "$OUT/bench-procs.log" 2>&1
  rc=$?
  tail -16 "$OUT/bench-procs.log"
  note "epx-bench --processes rc=$rc"
fi
if want engines; then
  # The SM and copy engines side by side at the V3 shape (dispatch bf16 and fp8, combine), with
  # EPX_PROFILE's per-step times (engines.log) and the records (engines-sm.json, engines-copy.json).
  for engine in sm copy; do
    echo "== engines $engine" >> "$OUT/engines.log"
    EPX_DISPATCH_ENGINE=$engine EPX_COMBINE_ENGINE=$engine EPX_PROFILE=1 timeout 120 ./build-gpu/epx-bench --backend cuda \
      --ranks "$gpus" --wire bf16,fp8 --ops dispatch,combine --json "$OUT/engines-$engine.json" \
      >> "$OUT/engines.log" 2>&1 || echo "FAILED: engine $engine" >> "$OUT/engines.log"
  done
  # The host's steps without CUDA events (EPX_PROFILE=host), with the default engines and at one rank.
  for ranks in "$gpus" 1; do
    echo "== host steps, $ranks ranks, default engines" >> "$OUT/engines.log"
    EPX_PROFILE=host timeout 120 ./build-gpu/epx-bench --backend cuda --ranks "$ranks" --wire bf16 --layout rank_major \
      --ops dispatch,combine >> "$OUT/engines.log" 2>&1 || echo "FAILED: host steps at $ranks ranks" >> "$OUT/engines.log"
  done
  grep -E "^==|^dispatch |^combine |FAILED|broadcast|receive kernel|send kernel|routing|combine: " "$OUT/engines.log"
  note "engines: $(grep -cE '^(dispatch|combine) ' "$OUT/engines.log") records, $(grep -c FAILED "$OUT/engines.log") failed"
fi
if want chain; then
  # The small kernels before a dispatch's receiver (the call's begin, the plan kernel, placing
  # data) at one rank, copy engines forced so every one of them runs: each launch's duration by
  # ncu (kernels serialized, so no overlap hides one), the mean over CHAIN_CALLS calls (chain.log).
  timeout 300 env EPX_DISPATCH_ENGINE=copy ncu --clock-control none --metrics gpu__time_duration.sum \
    -k 'regex:begin_call|plan_dispatch|finalize_positions|push_placing|broadcast_begin' \
    --launch-skip 20 --launch-count "$((5 * ${CHAIN_CALLS:-10}))" ./build-gpu/epx-bench --backend cuda --ranks 1 --wire bf16 \
    --layout rank_major --ops dispatch --warmup 4 --iters "$((${CHAIN_CALLS:-10} + 4))" > "$OUT/chain.log" 2>&1
  python3 - "$OUT/chain.log" <<'PY'
import re, sys, collections
times, kernel = collections.defaultdict(list), None
for line in open(sys.argv[1]):
    m = re.search(r"(\w+_kernel)\b", line)
    if m and "Context" in line:
        kernel = m.group(1)
    m = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and kernel:
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(m.group(1), 1.0)
        times[kernel].append(float(m.group(2).replace(",", "")) * scale)
for k, v in sorted(times.items(), key=lambda kv: -sum(kv[1]) / len(kv[1])):
    print(f"chain kernel {k:32s} {sum(v) / len(v):8.1f} us (mean of {len(v)})")
PY
  note "chain: $(grep -c 'Context' "$OUT/chain.log") kernel launches profiled"
fi
if want holdback; then
  # The shared-GPU hold-back (docs/cuda.md, Known gaps, hangs items 7-13): every shared-GPU test
  # (EP2, EP4, EP8, both modes) HOLDBACK_PASSES times in a row in one process (issue #27 item 5
  # asks for 20). A timeout's message says when each rank's kernels began on the device and when
  # its host launched them.
  passes=${HOLDBACK_PASSES:-20}
  EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-10000} timeout $((30 * passes + 60)) ./build-gpu/tests/epx_gpu_tests \
    --gtest_filter='*shared*' --gtest_repeat="$passes" > "$OUT/holdback.log" 2>&1
  rc=$?
  failed=$(failed_tests "$OUT/holdback.log")
  note "holdback: rc=$rc, $(grep -c '^\[  PASSED' "$OUT/holdback.log") of $passes passes of the shared-GPU tests, failed: ${failed:-none}"
fi

if want profile; then
  # Nsight Compute (clock control off, full set) on the kernels that bound the calls, at one rank:
  # ncu serializes kernels, so ranks waiting on each other could not progress. Copy-engine paths
  # forced (at one rank they copy nothing, but their kernels run). Reports' text in ncu-*.log.
  prof() {
    local name=$1 kernel=$2
    shift 2
    timeout 300 env "$@" ncu --clock-control none --set full -k "regex:$kernel" --launch-skip 3 --launch-count 1 \
      ./build-gpu/epx-bench --backend cuda --ranks 1 --warmup 2 --iters 3 ${PROFILE_ARGS[$name]} > "$OUT/ncu-$name.log" 2>&1
    echo "== ncu $name ($kernel)"
    grep -E "^\s+(Duration|Memory Throughput|DRAM Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued Instruction)" \
      "$OUT/ncu-$name.log" | head -12
  }
  declare -A PROFILE_ARGS=(
    [receiver]="--wire bf16 --layout rank_major --ops dispatch"
    [receiver_em]="--wire bf16 --layout expert_major --ops dispatch"
    [partials]="--wire bf16 --layout expert_major --ops combine"
    [reducers]="--wire bf16 --layout rank_major --ops combine"
    [expand]="--wire bf16 --layout expert_major --ops combine_backward"
    [encode]="--wire fp8 --layout rank_major --ops dispatch"
    [encode_nvfp4]="--wire nvfp4 --layout rank_major --ops dispatch"
    [plan]="--wire bf16 --layout rank_major --ops dispatch"
    [ll_dispatch]="--preset ll --wire fp8 --ops ll_dispatch"
    [ll_combine]="--preset ll --wire fp8 --ops ll_combine"
  )
  # PROFILES picks the reports (default: the first two's kernels and the low-latency ones).
  for name in ${PROFILES:-receiver partials ll_dispatch ll_combine}; do
    case $name in
      receiver | receiver_em) prof "$name" 'dispatch_receive_kernel' EPX_DISPATCH_ENGINE=copy ;;
      partials) prof partials 'reduce_partials_kernel' EPX_DISPATCH_ENGINE=copy EPX_COMBINE_ENGINE=copy ;;
      reducers) prof reducers '^combine_kernel$' EPX_DISPATCH_ENGINE=copy EPX_COMBINE_ENGINE=copy ;;
      expand) prof expand 'expand_transfer_kernel' ;;
      encode | encode_nvfp4) prof "$name" 'encode_rows_kernel' EPX_DISPATCH_ENGINE=copy ;;
      plan) prof plan 'plan_dispatch_kernel' ;;
      ll_dispatch) prof ll_dispatch '^dispatch_kernel$' EPX_TIMEOUT_MS=60000 ;;
      ll_combine) prof ll_combine '^combine_kernel$' EPX_TIMEOUT_MS=60000 ;;
      *) echo "unknown profile $name" ;;
    esac
  done
  # The machine code of the kernels named in SASS_KERNELS (a regex of mangled names), for
  # counting a loop's instructions (sass.log).
  cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2> /dev/null | head -1)
  if [ -n "${SASS_KERNELS:-}" ] && [ -n "$cuobjdump" ]; then
    find build-gpu -name '*.o' -path '*kernels*' -exec "$cuobjdump" -sass {} \; 2>/dev/null |
      awk -v re="$SASS_KERNELS" '/Function :/{p = ($0 ~ re)} p' > "$OUT/sass.log"
    note "sass: $(grep -c 'Function :' "$OUT/sass.log") kernels dumped"
  fi
  note "ncu profiles: $(ls "$OUT"/ncu-*.log 2>/dev/null | wc -l) logs"
fi
if want sweep; then
  bash scripts/perf-sweep.sh > /dev/null 2>&1
  grep -E "^==|^dispatch|^combine|profile" "$OUT/sweep.log" | cut -c1-150
  note "sweep done ($(grep -c '^==' "$OUT/sweep.log") settings)"
fi
if want ll; then
  # Low-latency mode: EP over every GPU at the decode shape (ll.json), a token sweep of fp8
  # dispatch and combine (ll-sweep.json), EP4 and EP8 on the shared-GPU transport (ll-shared.json).
  ranks=$gpus
  bench() { timeout 120 ./build-gpu/epx-bench --backend cuda --preset ll "$@" >> "$OUT/ll.log" 2>&1 || echo "FAILED: $*" >> "$OUT/ll.log"; }
  bench --ranks "$ranks" --ops ll_dispatch,ll_combine --wire fp8,bf16 --json "$OUT/ll.json"
  for t in ${LL_SWEEP_TOKENS:-1 8 32 64 256 512}; do
    bench --ranks "$ranks" --ops ll_dispatch,ll_combine --tokens "$t" --wire fp8 --json "$OUT/ll-t$t.part"
  done
  # The combine's weights given to ll_dispatch (records say "weights_at": "dispatch"), into the sweep's file.
  for t in 1 128; do
    bench --ranks "$ranks" --ops ll_dispatch,ll_combine --tokens "$t" --wire fp8 --ll-weights-at dispatch \
      --json "$OUT/ll-t$t-wd.part"
  done
  for r in 4 8; do bench --shared-gpu --ranks "$r" --wire fp8 ${LL_SHARED_ARGS:-} --json "$OUT/ll-r$r.part"; done
  python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
for name, pattern in (("ll-sweep.json", "ll-t*.part"), ("ll-shared.json", "ll-r*.part")):
    records = [r for f in sorted(glob.glob(f"{out}/{pattern}")) for r in json.load(open(f))]
    records.sort(key=lambda r: (r["op"], r["ranks"], r.get("weights_at", ""), r["tokens"]))
    with open(f"{out}/{name}", "w") as o:
        o.write("[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n")
PY
  rm -f "$OUT"/*.part
  # Where a call's time goes: each block's steps (EPX_PROFILE=ll), the last call at 1 and 128 tokens.
  for t in 1 128; do
    for at in combine dispatch; do  # where the combine's weights were given
      EPX_PROFILE=ll timeout 120 ./build-gpu/epx-bench --backend cuda --preset ll --ranks "$ranks" \
        --ops ll_dispatch,ll_combine --tokens "$t" --wire fp8 --ll-weights-at "$at" 2>&1 | grep -E "timeline" |
        sed "s/^/$t tokens, weights at $at: /" >> "$OUT/ll-timeline.log"
    done
  done
  cat "$OUT/ll-timeline.log"
  grep -E "^ll_|FAILED" "$OUT/ll.log" | cut -c1-100
  note "low-latency runs: $(grep -c '^ll_' "$OUT/ll.log") records, $(grep -c 'FAILED' "$OUT/ll.log") failed"
fi
# The benchmark variants of this call side by side (median us): bench, ab, procs.
if ls "$OUT"/bench*.json > /dev/null 2>&1; then
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/bench*.json"))}
keys = []
for recs in runs.values():
    for r in recs:
        k = (r["op"], r["dtype"], r["layout"], r["sms"])
        if k not in keys: keys.append(k)
print("%-44s" % "op dtype layout sms" + "".join("%14s" % n for n in runs))
for k in keys:
    row = []
    for recs in runs.values():
        t = [r["time_us"] for r in recs if (r["op"], r["dtype"], r["layout"], r["sms"]) == k]
        row.append("%14.1f" % t[0] if t else "%14s" % "-")
    print("%-44s" % " ".join(map(str, k)) + "".join(row))
PY
fi
# At most 8 files come back from the machine: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
echo
echo "SUMMARY:"
printf '  %s\n' "${summary[@]}"
