"""Times dispatch and combine through the Python API as epx-bench times them, for the same call.

epx-bench (tools/bench) records CUDA events on the buffer's stream around each call, after every
rank arrived (at one rank: at once), and reports the median of the timed calls (2 warm-up, 20 timed). This does the same
through epx.Buffer on torch's current stream (by default a stream of its own, as epx-bench's
buffer stream; --stream default: torch's legacy default stream), so the difference is what Python
adds: its checks, the DLPack crossings and the outputs' wrapping (no copies). Defaults: the V3 shape (4096
tokens/rank, hidden 7168, top-8 of 256 experts), uniform routing, bf16 wire, expert-major.

    torchrun --nproc-per-node 2 python/bench/bench_ht.py          # EP2, one process per GPU
    python3 python/bench/bench_ht.py                               # EP1
    # the same call in C++ (one process per rank, as torchrun):
    build/epx-bench --backend cuda --ranks 2 --processes --preset v3 --ops dispatch,combine \\
        --wire bf16 --layout expert_major --json epx-bench.json

Run with PYTHONPATH=build/python:python (or after pip install .). Prints one JSON line per op on
rank 0: {"op", "median_us", "min_us", "max_us", ...}.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import epx


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--wire", default="bf16")
    parser.add_argument("--layout", default="expert_major")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sms", type=int, default=0)
    parser.add_argument("--stream", choices=("own", "default"), default="own",
                        help="own: the calls run on a torch stream of their own, as epx-bench's run on the buffer's "
                             "own stream (the same call); default: on torch's default (legacy) stream")
    args = parser.parse_args()
    if args.stream == "own":
        torch.cuda.set_stream(torch.cuda.Stream())

    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("gloo")  # the id's carrier and the barrier; epx moves the data over NCCL
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    group = epx.Group.from_torch(dist.group.WORLD)
    buffer = epx.Buffer(group, args.hidden, args.tokens, args.experts, args.topk, wire=args.wire, num_sms=args.sms)

    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).bfloat16().cuda()
    idx = torch.rand(args.tokens, args.experts, generator=gen).argsort(dim=1)[:, :args.topk].contiguous().cuda()
    w = torch.rand(args.tokens, args.topk, generator=gen).cuda()
    weighted = args.layout == "expert_major"

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(call):
        times, host = [], []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            # Every rank arrives, as epx-bench's arrive(). At one rank that returns at once there; a
            # gloo barrier would not (its worker thread's hand-off sleeps and wakes this thread before
            # every call, which made the calls after it ~40 us slower: docs/lab/2026-12-02-host-read.md).
            if ranks > 1:
                dist.barrier()
            start.record()
            began = time.perf_counter()
            result = call()
            returned = time.perf_counter()
            stop.record()
            stop.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(stop) * 1000.0)
                host.append((returned - began) * 1e6)  # the call's host time (it includes blocking's sync)
        return sorted(times), sorted(host), result

    dispatch_times, dispatch_host, d = timed(lambda: buffer.dispatch(x, idx, w, layout=args.layout))
    y = torch.randn(d.recv_x.shape, generator=gen).bfloat16().cuda() if args.wire == "bf16" else \
        torch.randn(d.recv_x.shape[0], args.hidden, generator=gen).bfloat16().cuda()
    combine_times, combine_host, _ = timed(lambda: buffer.combine(y, d.handle, weighted=weighted))
    if rank == 0:
        for op, t, host in (("dispatch", dispatch_times, dispatch_host), ("combine", combine_times, combine_host)):
            n = len(t)
            median = t[n // 2] if n % 2 else 0.5 * (t[n // 2 - 1] + t[n // 2])
            print(json.dumps({"op": op, "median_us": round(median, 2), "min_us": round(t[0], 2),
                              "max_us": round(t[-1], 2), "host_median_us": round(host[len(host) // 2], 2),
                              "ranks": ranks, "tokens": args.tokens,
                              "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
                              "wire": args.wire, "layout": args.layout, "api": "python",
                              "stream": args.stream}))
    buffer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
