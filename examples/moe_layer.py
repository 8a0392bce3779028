"""A small MoE layer trained with epx, and the same layer in plain torch: the same loss curve.

    python3 examples/moe_layer.py                     # CPU backend: 2 ranks, one thread each
    python3 examples/moe_layer.py --ranks 4
    python3 examples/moe_layer.py --device cuda       # one GPU (EP1 over NCCL)
    torchrun --nproc-per-node 2 examples/moe_layer.py --device cuda   # one process per GPU

Each rank holds num_experts / ranks experts (a two-layer MLP each) and a copy of the router; its
tokens go to their top-k experts' ranks with epx.torch.dispatch, through the experts in the
expert-major layout (one segment per local expert, what a grouped GEMM takes), and back with
epx.torch.combine, weighted by the router's probabilities. The router's gradients are summed over
the ranks (data parallel); the experts' gradients come back through epx's backward passes. The
reference is one dense layer over every rank's tokens (index_select / index_add), in float32.
Run from the repository root with PYTHONPATH=build/python:python (or after `pip install .`).
"""

import argparse
import os
import threading

import torch
import torch.nn.functional as F

import epx

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 64, 128, 8, 2, 32


def init_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(HIDDEN, EXPERTS, generator=g) / HIDDEN ** 0.5,
            "w1": torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN ** 0.5,
            "w2": torch.randn(EXPERTS, FFN, HIDDEN, generator=g) / FFN ** 0.5}


def rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    return x, torch.tanh(x @ torch.randn(HIDDEN, HIDDEN, generator=g) / 4)


class EpxMoE(torch.nn.Module):
    """One rank's share of the layer: the router and this rank's experts."""

    def __init__(self, buffer, params, rank, device):
        super().__init__()
        local = buffer.num_local_experts
        mine = slice(rank * local, (rank + 1) * local)
        self.buffer = buffer
        self.router = torch.nn.Parameter(params["router"].clone().to(device))
        self.w1 = torch.nn.Parameter(params["w1"][mine].clone().to(device))
        self.w2 = torch.nn.Parameter(params["w2"][mine].clone().to(device))

    def forward(self, x):
        probs = torch.softmax(x @ self.router, dim=-1)
        weights, idx = torch.topk(probs, TOPK)
        d = epx.torch.dispatch(self.buffer, x.bfloat16(), idx, weights)
        # The experts: one segment of rows per local expert (then padding rows, which combine ignores).
        offsets, counts = d.expert_offsets.tolist(), d.tokens_per_expert.tolist()
        parts = []
        for e in range(len(counts)):
            rows = d.recv_x[offsets[e]:offsets[e] + counts[e]].float()
            parts.append(F.silu(rows @ self.w1[e]) @ self.w2[e])
            parts.append(rows.new_zeros(offsets[e + 1] - offsets[e] - counts[e], HIDDEN))
        y = torch.cat(parts).bfloat16()
        return epx.torch.combine(self.buffer, y, d.handle).float()


class DenseMoE(torch.nn.Module):
    """The reference: every expert, every rank's tokens, in plain torch."""

    def __init__(self, params):
        super().__init__()
        self.router = torch.nn.Parameter(params["router"].clone())
        self.w1 = torch.nn.Parameter(params["w1"].clone())
        self.w2 = torch.nn.Parameter(params["w2"].clone())

    def forward(self, x):
        probs = torch.softmax(x @ self.router, dim=-1)
        weights, idx = torch.topk(probs, TOPK)
        xb = x.bfloat16().float()  # the layer sends bf16 rows
        out = torch.zeros_like(x)
        for k in range(TOPK):
            for e in range(EXPERTS):
                rows = torch.nonzero(idx[:, k] == e).flatten()
                h = F.silu(torch.index_select(xb, 0, rows) @ self.w1[e]) @ self.w2[e]
                out = out.index_add(0, rows, h * weights[rows, k].unsqueeze(1))
        return out


def train(model, x, target, steps, lr, total_tokens, allreduce_router):
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(x), target, reduction="sum") / (total_tokens * HIDDEN)
        loss.backward()
        allreduce_router(model.router.grad)  # data parallel: the router's gradient summed over ranks
        losses.append(allreduce_router(loss.detach().clone()).item())
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses


def reference_losses(ranks, steps, lr):
    data = [rank_data(r) for r in range(ranks)]
    model = DenseMoE(init_params(0))
    x, target = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    return train(model, x, target, steps, lr, ranks * TOKENS, lambda t: t)


def cpu_losses(ranks, steps, lr):
    """Ranks as threads of this process on the CPU backend; the router's all-reduce through a barrier."""
    groups = epx.Group.host(ranks)
    barrier = threading.Barrier(ranks)
    partial = [None] * ranks
    results = [None] * ranks

    def allreduce(rank):
        def reduce(t):
            partial[rank] = t.clone()
            barrier.wait()
            total = sum(partial)
            barrier.wait()
            t.copy_(total)
            return t
        return reduce

    def run(rank):
        buffer = epx.Buffer(groups[rank], HIDDEN, TOKENS, EXPERTS, TOPK, expert_alignment=8)
        model = EpxMoE(buffer, init_params(0), rank, torch.device("cpu"))
        x, target = rank_data(rank)
        results[rank] = train(model, x, target, steps, lr, ranks * TOKENS, allreduce(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results[0]


def gpu_losses(steps, lr):
    """One process per GPU: under torchrun the world it starts, else a world of one."""
    import torch.distributed as dist

    if "RANK" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    group = epx.Group.from_torch(dist.group.WORLD)
    buffer = epx.Buffer(group, HIDDEN, TOKENS, EXPERTS, TOPK, expert_alignment=8)
    model = EpxMoE(buffer, init_params(0), rank, group.device)
    x, target = (t.to(group.device) for t in rank_data(rank))

    def allreduce(t):
        if ranks > 1:
            dist.all_reduce(t)
        return t

    losses = train(model, x, target, steps, lr, ranks * TOKENS, allreduce)
    return rank, ranks, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="CPU backend: ranks (threads)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cpu":
        rank, ranks, losses = 0, args.ranks, cpu_losses(args.ranks, args.steps, args.lr)
    else:
        rank, ranks, losses = gpu_losses(args.steps, args.lr)
    if rank != 0:
        return
    want = reference_losses(ranks, args.steps, args.lr)
    print(f"MoE layer, {ranks} rank(s) on {args.device}: hidden {HIDDEN}, top-{TOPK} of {EXPERTS} experts")
    print(f"{'step':>4}  {'epx loss':>12}  {'torch loss':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step, (got, ref) in enumerate(zip(losses, want)):
        diff = abs(got - ref) / abs(ref)
        worst = max(worst, diff)
        print(f"{step:>4}  {got:>12.6f}  {ref:>12.6f}  {diff:>9.2e}")
    same = worst < 1e-2 and losses[-1] < losses[0]
    print(f"largest relative difference {worst:.2e}: {'the same curve' if same else 'DIFFERENT CURVES'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
