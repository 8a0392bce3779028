#!/usr/bin/env python3
"""tools/bench/check_targets.py on made-up records (tests/bench_tests.cmake): each kind of target met and
missed, a record without its floor, an unverified record ignored, targets without records, exit status."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tools", "bench", "check_targets.py")


def record(op, dtype="bf16", layout="rank_major", ranks=1, sms=24, tokens=4096, time_us=100.0, **extra):
    r = dict(op=op, dtype=dtype, layout=layout, ranks=ranks, sms=sms, tokens=tokens, time_us=time_us, verified=True,
             hidden=7168, topk=8, experts=288 if op.startswith("ll_") else 256, routing="uniform",
             git_commit="81cb7820ea10")
    r.update(extra)
    return r


def run(records, *options):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(records, f)
    try:
        p = subprocess.run([sys.executable, SCRIPT, *options, f.name], capture_output=True, text=True)
    finally:
        os.remove(f.name)
    return p.returncode, p.stdout.splitlines()


def expect(cond, what):
    if not cond:
        print("FAIL: " + what)
        sys.exit(1)


def main():
    every = [
        record("dispatch", floor_us=90.0, floor_ratio=100.0 / 90.0),
        record("combine", sms=16, floor_us=90.0, floor_ratio=100.0 / 90.0),
        record("dispatch", tokens=128, time_us=19.0),
        record("combine", ranks=2, transport="shared-gpu", floor_us=80.0, floor_ratio=1.25),
        record("ll_dispatch", dtype="fp8", layout="ll", sms=132, tokens=128, time_us=9.5, kernel_us=7.5),
        record("ll_dispatch", dtype="nvfp4", layout="ll", sms=132, tokens=128, time_us=8.5),
        record("ll_dispatch", dtype="bf16", layout="ll", sms=132, tokens=128, time_us=9.0),
        record("ll_combine", dtype="bf16", layout="ll", sms=132, tokens=128, time_us=7.0),
        record("ll_combine", dtype="bf16", layout="ll", ranks=2, sms=132, tokens=128, time_us=14.0,
               transport="shared-gpu"),
    ]
    rc, lines = run(every)
    expect(rc == 0, f"every target met: exit status {rc}, {lines}")
    expect(lines[-1] == "every target met" and all(l.endswith("meets") for l in lines[:-1]), f"{lines}")
    expect(len(lines) == len(every) + 1, f"one line per record: {lines}")

    missed = every + [record("dispatch", layout="expert_major", time_us=300.0, floor_us=200.0, floor_ratio=1.5)]
    rc, lines = run(missed)
    expect(rc == 1 and any("1.50x: misses" in l for l in lines), f"a ratio over 1.25: {rc} {lines}")

    rc, lines = run(every + [record("combine_backward")])  # no floor in it
    expect(rc == 1 and any("no floor in the record" in l for l in lines), f"a record without its floor: {lines}")

    kernel = [r for r in every if r["dtype"] != "fp8"] + [record("ll_dispatch", dtype="fp8", layout="ll", sms=132,
                                                                 tokens=128, time_us=7.0, kernel_us=8.5)]
    rc, lines = run(kernel)
    expect(rc == 1 and any("ll_dispatch fp8" in l and "8.5 us: misses" in l for l in lines),
           f"the kernel time counts, not the graph time: {lines}")

    unverified = [dict(r, verified=False) if r["tokens"] == 128 and r["op"] == "dispatch" else r for r in every]
    rc, lines = run(unverified)
    expect(rc == 1 and any("128 tokens/rank <= 20 us: no record" in l for l in lines),
           f"an unverified record counts for nothing: {lines}")

    rc, lines = run([])
    expect(rc == 1 and sum(l.endswith("no record") for l in lines) == 9, f"no records: {lines}")

    # Records of other conditions count for nothing: a sweep's skewed routing, forced engines, another
    # shape; --commit keeps one commit's.
    slow = dict(time_us=900.0, floor_us=90.0, floor_ratio=10.0)
    others = [record("dispatch", routing="skewed", **slow), record("dispatch", engines="dispatch=sm,combine=auto", **slow),
              record("dispatch", hidden=2048, **slow), record("dispatch", git_commit="0123456", **slow)]
    rc, lines = run(every + others[:3])
    expect(rc == 0 and len(lines) == len(every) + 1, f"records of other conditions ignored: {lines}")
    rc, lines = run(every + others, "--commit", "81cb782")
    expect(rc == 0 and len(lines) == len(every) + 1, f"--commit keeps one commit's records: {lines}")
    rc, lines = run(every + others)
    expect(rc == 1, f"without --commit another commit's record counts: {lines}")
    print("OK: check_targets.py")


main()
