#!/usr/bin/env python3
"""The performance targets of issues #27 and #29 against epx-bench records (docs/performance.md).

    check_targets.py [--commit SHA] RECORDS.json [MORE.json ...]

Pass one run's records (device-check's targets.json), or --commit to keep one commit's. Only
verified records of the targets' conditions count: the V3 shape (hidden 7168, top-8 of 256) or the
decode shape (hidden 7168, top-8 of 288, 128 tokens), uniform routing, the default engines, no
shared expert or replicas. Prints one line per target and record: the record's time, its floor where the target is one, the
target, and "meets" or "misses"; then one line per target no record speaks to ("no record"). Exit
status 0 when every target has a record and every record meets it, 1 otherwise (a report: nothing
is changed). `bash scripts/device-check.sh targets` writes the records these targets need.
"""
import json
import sys

V3_TOKENS = 4096
HT_OPS = ("dispatch", "combine", "dispatch_backward", "combine_backward")


def shared(r):
    return r.get("transport") == "shared-gpu"


def default_conditions(r):
    """What every target assumes: uniform routing, the default engines, no shared expert, no replicas."""
    return (r.get("routing", "uniform") == "uniform" and r.get("engines", "dispatch=auto,combine=auto")
            == "dispatch=auto,combine=auto" and not r.get("shared_expert") and not r.get("replicas"))


def v3(r):
    return r.get("hidden") == 7168 and r.get("topk") == 8 and r.get("experts") == 256


def ll_time(r):
    """A low-latency record's kernel time where CUPTI measured it, else its (graph) time."""
    return r.get("kernel_us") or r["time_us"]


def decode(r):
    """The low-latency decode shape, weights given to combine."""
    return (r.get("hidden") == 7168 and r.get("topk") == 8 and r.get("experts") == 288 and r["tokens"] == 128
            and not r.get("weights_at"))


def ll_at_ep1(r, op, dtype):
    """A low-latency record of `op` in `dtype` at one rank."""
    return r["op"] == op and r["dtype"] == dtype and r["ranks"] == 1 and not shared(r) and decode(r)


# (name, which records it takes, how it is measured: ("floor", max ratio), ("us", max time) or ("ll", max
# kernel time))
TARGETS = [
    ("#27: EP1 V3 high-throughput op <= 1.25x its floor, 24 SMs",
     lambda r: r["op"] in HT_OPS and r["ranks"] == 1 and not shared(r) and v3(r) and r["tokens"] == V3_TOKENS
     and r["sms"] == 24,
     ("floor", 1.25)),
    ("#27: EP1 V3 high-throughput op <= 1.25x its floor, 16 SMs",
     lambda r: r["op"] in HT_OPS and r["ranks"] == 1 and not shared(r) and v3(r) and r["tokens"] == V3_TOKENS
     and r["sms"] == 16,
     ("floor", 1.25)),
    ("#27: EP1 dispatch and combine at 128 tokens/rank <= 20 us",
     lambda r: r["op"] in ("dispatch", "combine") and r["ranks"] == 1 and not shared(r) and r["tokens"] == 128
     and r["hidden"] == 7168 and r["layout"] == "rank_major" and r["dtype"] == "bf16" and r["sms"] == 24,
     ("us", 20.0)),
    ("#27: shared GPU EP2/EP4 rank-major dispatch and combine <= 1.5x their floor",
     lambda r: r["op"] in ("dispatch", "combine") and shared(r) and r["ranks"] in (2, 4) and r["layout"] == "rank_major"
     and v3(r) and r["tokens"] == V3_TOKENS and r["dtype"] == "bf16" and r["sms"] == 24,
     ("floor", 1.5)),
    ("#29: EP1 ll_dispatch fp8 <= 8 us (kernel)", lambda r: ll_at_ep1(r, "ll_dispatch", "fp8"), ("ll", 8.0)),
    ("#29: EP1 ll_dispatch nvfp4 <= 9 us (kernel)", lambda r: ll_at_ep1(r, "ll_dispatch", "nvfp4"), ("ll", 9.0)),
    ("#29: EP1 ll_dispatch bf16 <= 10 us (kernel)", lambda r: ll_at_ep1(r, "ll_dispatch", "bf16"), ("ll", 10.0)),
    ("#29: EP1 ll_combine bf16 <= 8 us (kernel)", lambda r: ll_at_ep1(r, "ll_combine", "bf16"), ("ll", 8.0)),
    ("#29: shared GPU EP2 ll_dispatch and ll_combine <= 15 us (kernel)",
     lambda r: r["op"] in ("ll_dispatch", "ll_combine") and shared(r) and r["ranks"] == 2 and decode(r),
     ("ll", 15.0)),
]


def describe(r):
    return f"{r['op']} {r['dtype']} {r['layout']} ranks {r['ranks']} sms {r['sms']} tokens {r['tokens']}"


def check(records):
    """(lines, every target met)."""
    lines, ok = [], True
    verified = [r for r in records if r.get("verified") and default_conditions(r)]
    for name, takes, (kind, limit) in TARGETS:
        mine = [r for r in verified if takes(r)]
        if not mine:
            lines.append(f"{name}: no record")
            ok = False
            continue
        for r in mine:
            if kind == "floor":
                ratio = r.get("floor_ratio")
                if ratio is None:
                    lines.append(f"{name}: {describe(r)}: {r['time_us']:.1f} us, no floor in the record")
                    ok = False
                    continue
                met = ratio <= limit
                lines.append(f"{name}: {describe(r)}: {r['time_us']:.1f} us, floor {r['floor_us']:.1f} us, "
                             f"{ratio:.2f}x: {'meets' if met else 'misses'}")
            else:
                t = ll_time(r) if kind == "ll" else r["time_us"]
                met = t <= limit
                lines.append(f"{name}: {describe(r)}: {t:.1f} us: {'meets' if met else 'misses'}")
            ok = ok and met
    return lines, ok


def main(args):
    commit = None
    if args[:1] == ["--commit"]:
        if len(args) < 3:
            sys.exit(__doc__)
        commit, args = args[1], args[2:]
    records = [r for p in args for r in json.load(open(p))]
    if commit is not None:
        records = [r for r in records if str(r.get("git_commit", "")).startswith(commit)]
    lines, ok = check(records)
    print("\n".join(lines))
    print("every target met" if ok else "targets missed or without a record")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
