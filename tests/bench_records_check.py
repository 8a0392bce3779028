#!/usr/bin/env python3
"""Checks that epx-bench writes each record as soon as it is measured (tests/bench_tests.cmake).

    bench_records_check.py all|killed JSON EXPECTED -- EPX-BENCH-COMMAND...

The command must write its EXPECTED records to JSON. Every table row it prints must already be
in JSON, a complete list, when the row appears. `all`: the run ends well and JSON holds the
EXPECTED records, one per row, every one verified. `killed`: the run is killed (SIGKILL) as soon
as its first row appears; it must have had records left to measure (else its rows were not
flushed as they came) and JSON must still hold the rows printed.
"""
import json
import os
import re
import subprocess
import sys

ROW = re.compile(r"^(dispatch|combine|dispatch_backward|combine_backward|ll_dispatch|ll_combine) ")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def load(path):
    try:
        with open(path) as f:
            records = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path} is not a complete JSON document: {e}")
    if not isinstance(records, list):
        fail(f"{path} holds no list")
    return records


def main():
    mode, path = sys.argv[1], sys.argv[2]
    expected = int(sys.argv[3])
    command = sys.argv[sys.argv.index("--") + 1:]
    if os.path.exists(path):
        os.remove(path)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stdout:
        if not ROW.match(line):
            continue
        rows.append(line.split()[:3])
        on_disk = load(path)
        if len(on_disk) < len(rows):
            fail(f"row {len(rows)} printed but {path} holds {len(on_disk)} records: {line.strip()}")
        if mode == "killed":
            proc.kill()
            break
    proc.wait()
    records = load(path)
    keys = [[r["op"], r["dtype"], r["layout"]] for r in records]
    if mode == "killed":
        if not rows:
            fail("no table row before the run ended")
        if keys[: len(rows)] != rows:
            fail(f"after the kill {path} holds {keys}, not the rows printed {rows}")
        if len(records) >= expected:
            fail(f"the run had measured all {len(records)} records before its first row showed (rows not flushed?)")
        print(f"OK: killed after {len(rows)} row(s); {path} holds {len(records)} complete record(s)")
        return
    if proc.returncode != 0:
        fail(f"epx-bench exited with {proc.returncode}")
    if keys != rows or len(records) != expected:
        fail(f"{path} holds {len(records)} records {keys}; expected {expected}, the rows printed: {rows}")
    if not all(r["verified"] for r in records):
        fail("a record is not verified")
    check_hbm_bytes(records)
    print(f"OK: {path} holds all {len(records)} records")


def check_hbm_bytes(records):
    """The bytes each floor is made of (tools/bench/floors.hpp): T rows of bf16 x in, T rows out, and the
    received rows between (the bf16 dispatch's output rows are what combine and the backward passes read
    or write)."""
    dispatched = {r["layout"]: r["hbm_write_bytes"] for r in records if r["op"] == "dispatch" and r["dtype"] == "bf16"}
    for r in records:
        row = 2 * r["hidden"] * r["tokens"]
        got = (r.get("hbm_read_bytes"), r.get("hbm_write_bytes"))
        received = dispatched.get(r["layout"])
        want = {"dispatch": (row, got[1]), "combine": (received, row), "dispatch_backward": (received, row),
                "combine_backward": (row + (received if r["layout"] == "expert_major" else 0), received)}[r["op"]]
        if got != want or not got[1] or got[1] <= 0:
            fail(f"{r['op']} {r['dtype']} {r['layout']}: HBM bytes (read, write) {got}, expected {want}")


main()
