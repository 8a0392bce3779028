#!/usr/bin/env python3
"""Prints the GPU timeline of the last call of an nsys capture, one line per kernel or copy.

usage: timeline.py trace.csv [window_us]
trace.csv is `nsys stats --report cuda_gpu_trace --format csv` output. The last `window_us`
microseconds (default 1500) before the last activity are printed with start times relative to the
first activity in that window, per device and stream, so overlap (or its absence) shows.
"""
import csv
import sys

rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.strip()]
start = next(i for i, l in enumerate(lines) if l.startswith("Start") or l.startswith('"Start'))
for r in csv.DictReader(lines[start:]):
    try:
        t0 = float(r["Start (ns)"])
        dur = float(r["Duration (ns)"])
    except (KeyError, ValueError):
        continue
    dev = r.get("Device", r.get("GPU", "?"))
    rows.append((t0, dur, dev, r.get("Strm", "?"), r.get("Name", "?")[:60], r.get("Bytes (MB)", "")))
window = float(sys.argv[2]) * 1000 if len(sys.argv) > 2 else 1.5e6
end = max(t + d for t, d, *_ in rows)
shown = sorted(r for r in rows if r[0] + r[1] >= end - window)
base = shown[0][0]
print(f"{'start_us':>9} {'dur_us':>8} {'end_us':>9}  device stream  name (MB)")
for t, d, dev, strm, name, mb in shown:
    print(f"{(t - base) / 1e3:9.1f} {d / 1e3:8.1f} {(t + d - base) / 1e3:9.1f}  {dev[:12]:>6} {strm:>6}  {name} {mb}")
