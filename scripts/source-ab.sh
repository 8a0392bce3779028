#!/usr/bin/env bash
# Variants of the source against each other in one device call, without a knob in the library:
# each variant is a shell command that edits the tree (sed, patch -R, ...). The script builds each
# one into its own epx-bench (only the edited files recompile), puts the sources back, then runs
# the tree as it is and every variant in alternating order, AB_RUNS times (source-ab.log): between
# two runs of one binary the medians move by up to ~20 us, so only what holds in every round is a
# result. Run it after scripts/device-check.sh has built build-gpu (e.g. its `tests` step).
#   usage: SOURCE_VARIANTS=$'label=command[\nlabel=command...]' (one variant a line)
#          [AB_ARGS=$'epx-bench arguments[\nmore arguments...]' (a set a line)] [AB_RUNS=3] [AB_GREP="lines to keep", e.g. with EPX_PROFILE=1] bash scripts/source-ab.sh
# e.g.   SOURCE_VARIANTS=$'group2=sed -i "s/kScaleGroup = 4;/kScaleGroup = 2;/" src/cuda/kernels/combine_backward.cu\nold=patch -R -p1 < my.patch'
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
[ -x build-gpu/epx-bench ] || { echo "source-ab: no build-gpu/epx-bench; run scripts/device-check.sh first"; exit 1; }
bins=$(mktemp -d)
cp -a src "$bins/src.pristine"
cp build-gpu/epx-bench "$bins/current"
labels=(current)
mapfile -t variants <<< "${SOURCE_VARIANTS:?source-ab needs SOURCE_VARIANTS}"
for variant in "${variants[@]}"; do
  label=${variant%%=*}
  if (eval "${variant#*=}") && cmake --build build-gpu -j "$(nproc)" --target epx-bench > "$OUT/source-ab-build-$label.log" 2>&1; then
    cp build-gpu/epx-bench "$bins/$label"
    labels+=("$label")
  else
    echo "source-ab: variant $label did not build (source-ab-build-$label.log)"
  fi
  # The edited files back, with new times, so that the next build compiles them again.
  diff -rq src "$bins/src.pristine" | sed -nE 's/^Files (src\/[^ ]+) and .*/\1/p' |
    while read -r f; do cp "$bins/src.pristine/${f#src/}" "$f"; done
done
cmake --build build-gpu -j "$(nproc)" > /dev/null 2>&1  # build-gpu as the tree is, for later steps
gpus=$(nvidia-smi -L | wc -l)
# AB_ARGS: one set of epx-bench arguments a line; every set runs every binary in each round.
mapfile -t argsets <<< "${AB_ARGS:---wire bf16 --ops dispatch}"
for i in $(seq "${AB_RUNS:-3}"); do
  for a in "${!argsets[@]}"; do
    for label in "${labels[@]}"; do
      timeout 120 "$bins/$label" --backend cuda --ranks "$gpus" ${argsets[$a]} 2>&1 |
        grep -E "${AB_GREP:-^(dispatch|combine|ll_)}" | sed "s/^/[set $a] [$label] run $i: /" >> "$OUT/source-ab.log"
    done
  done
done
for a in "${!argsets[@]}"; do echo "set $a: ${argsets[$a]}"; done
# Grouped by argument set, op, dtype, layout, then variant, runs in order.
awk -F': ' '{split($2, f, " "); print substr($1, 1, 7), f[1], f[2], f[3], $1 ":", $2}' "$OUT/source-ab.log" |
  sort -s -k1,5 -k8,8 | cut -c1-160
rm -rf "$bins"
echo "SUMMARY: source-ab: ${#labels[@]} binaries (${labels[*]}), ${AB_RUNS:-3} rounds: $(wc -l < "$OUT/source-ab.log") lines"
