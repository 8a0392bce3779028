"""Dispatch, combine and both backward passes through epx.Buffer on the CPU backend (ranks as
threads), against the plain-torch reference: layouts, copied rows and gathered values exactly,
sums to bf16 rounding."""

import pytest
import torch

import epx
from helpers import Problem, assert_close_sum, make_buffers, random_bf16, run_all
from reference import (check_dispatch, expected_combine, expected_grad_weights_gather, expected_grad_w_dot,
                       expected_grad_y, expected_layout, kept_routing)

CASES = [
    # ranks, hidden, experts, topk, tokens, layout, alignment, extras
    (2, 128, 8, 2, 16, "expert_major", 1, {}),
    (2, 256, 8, 3, [24, 9], "expert_major", 4, {"unused": 0.2}),
    (3, 128, 12, 4, 20, "rank_major", 1, {}),
    (4, 128, 16, 4, 12, "expert_major", 8, {"skew": True}),
    (4, 128, 16, 2, [10, 0, 7, 12], "rank_major", 1, {"unused": 0.3}),
    (2, 128, 8, 2, 16, "expert_major", 2, {"dense": True}),
    (3, 128, 12, 3, 18, "expert_major", 1, {"capacity_factor": 0.8, "skew": True}),
    (2, 128, 8, 4, 16, "expert_major", 4, {"capacity_rows": 40}),  # overflows
    (2, 128, 8, 2, 16, "rank_major", 1, {"capacity_rows": 64}),
]


def run_problem(p, layout, alignment, dense=False, capacity_factor=0.0, capacity_rows=0, shared=True):
    groups = epx.Group.host(p.ranks)
    buffers = make_buffers(groups, hidden=p.hidden, max_tokens_per_rank=max(p.tokens), num_experts=p.experts,
                           topk=p.topk, expert_alignment=alignment, capacity_factor=capacity_factor,
                           capacity_rows=capacity_rows)
    expert_major = layout == "expert_major"

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        if dense:
            routing_map, probs = p.dense(r)
            d = b.dispatch(p.x[r], routing_map=routing_map, probs=probs, layout=layout)
        else:
            d = b.dispatch(p.x[r], p.idx[r], p.w[r], layout=layout)
        rows = d.recv_x.shape[0]
        y = random_bf16((rows, p.hidden), 100 + r)
        shared_out = random_bf16((p.tokens[r], p.hidden), 200 + r) if shared else None
        c = b.combine(y, d.handle, shared_out=shared_out)
        grad_recv_x = random_bf16((rows, p.hidden), 300 + r)
        grad_recv_w = torch.rand((rows,) if expert_major else (rows, p.topk), generator=torch.Generator().manual_seed(r))
        db = b.dispatch_backward(grad_recv_x, d.handle, grad_recv_w)
        grad_out = random_bf16((p.tokens[r], p.hidden), 400 + r)
        cb = b.combine_backward(grad_out, d.handle, y)
        return dict(d=d, y=y, shared=shared_out, out=c.out, overflow=c.overflow, grad_recv_x=grad_recv_x,
                    grad_recv_w=grad_recv_w, db=db, grad_out=grad_out, cb=cb)

    return run_all(groups, rank)


def case_id(c):
    return "_".join([f"R{c[0]}_H{c[1]}_E{c[2]}_K{c[3]}_{c[5]}_A{c[6]}", *c[7]])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case):
    ranks, hidden, experts, topk, tokens, layout, alignment, extras = case
    p = Problem(ranks, hidden, experts, topk, tokens, seed=hash(str(case)) % 1000, unused=extras.get("unused", 0.0),
                skew=extras.get("skew", False))
    dense = extras.get("dense", False)
    capacity_rows = extras.get("capacity_rows", 0)
    runs = run_problem(p, layout, alignment, dense=dense, capacity_factor=extras.get("capacity_factor", 0.0),
                       capacity_rows=capacity_rows)
    if dense:  # epx turns a dense row into top-k form with the experts ascending
        for r in range(ranks):
            p.idx[r], p.w[r] = p.sorted_routing(r)
    expert_major = layout == "expert_major"
    kept = kept_routing(p.idx, experts, topk, extras.get("capacity_factor", 0.0))
    layouts = [expected_layout(kept, ranks, experts, d, alignment, expert_major, capacity_rows or None)
               for d in range(ranks)]
    for d, run in enumerate(runs):
        check_dispatch(run["d"], layouts[d], p, kept, expert_major, topk)
        assert run["d"].num_rows == layouts[d].num_rows
        assert run["d"].overflow == (capacity_rows > 0 and layouts[d].num_rows > capacity_rows)
    weighted = expert_major
    ys = [run["y"] for run in runs]
    for s, run in enumerate(runs):
        want, scale = expected_combine(layouts, ys, s, p.tokens[s], hidden, p.w, weighted, expert_major, run["shared"])
        assert_close_sum(run["out"], want, scale, f"rank {s} combine out")
        want_gx, scale_gx = expected_combine(layouts, [r["grad_recv_x"] for r in runs], s, p.tokens[s], hidden, p.w,
                                             False, expert_major)
        assert_close_sum(run["db"].grad_x, want_gx, scale_gx, f"rank {s} grad_x")
        want_gw = expected_grad_weights_gather(layouts, [r["grad_recv_w"] for r in runs], s, p.tokens[s], topk,
                                               expert_major)
        assert torch.equal(run["db"].grad_topk_weights, want_gw), f"rank {s} dispatch_backward grad_topk_weights"
        want_gy = expected_grad_y(layouts[s], [r["grad_out"] for r in runs], p.w, hidden, weighted, expert_major)
        assert torch.equal(run["cb"].grad_y, want_gy), f"rank {s} grad_y"
        if weighted:
            want_dot, scale_dot = expected_grad_w_dot(layouts, [r["grad_out"] for r in runs], ys, s, p.tokens[s], topk)
            assert_close_sum(run["cb"].grad_topk_weights, want_dot, scale_dot, f"rank {s} grad w", rel=1e-5)
        else:
            assert run["cb"].grad_topk_weights is None


def test_dropped_slots_are_counted():
    p = Problem(2, 128, 8, 4, 32, seed=5, skew=True)
    runs = run_problem(p, "expert_major", 1, capacity_factor=0.5)
    kept = kept_routing(p.idx, 8, 4, 0.5)
    for r, run in enumerate(runs):
        assert run["d"].dropped_slots == int(((p.idx[r] >= 0) & (kept[r] < 0)).sum())


@pytest.mark.parametrize("wire", ["fp8", "fp8_ue8m0", "nvfp4"])
def test_quantized_wire_keeps_the_layout_and_dequantizes_close(wire):
    p = Problem(2, 256, 8, 2, 16, seed=7)
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=256, max_tokens_per_rank=16, num_experts=8, topk=2, wire=wire)

    def rank(g):
        return buffers[g.rank].dispatch(p.x[g.rank], p.idx[g.rank], p.w[g.rank])

    runs = run_all(groups, rank)
    kept = kept_routing(p.idx, 8, 2, 0.0)
    for d, out in enumerate(runs):
        lay = expected_layout(kept, 2, 8, d, 1, True)
        want_x = check_dispatch(out, lay, p, kept, True, 2)
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if wire == "nvfp4":
            assert out.recv_x.dtype == torch.uint8 and out.recv_x.shape == (lay.num_rows, 128)
            assert out.recv_scales.shape == (lay.num_rows, 16) and out.recv_global_scale.shape == (lay.num_rows,)
            continue
        assert out.recv_x.dtype == (fp8 or torch.uint8) and out.recv_scales.shape == (lay.num_rows, 2)
        deq = e4m3_to_float(out.recv_x).reshape(-1, 2, 128) * out.recv_scales.unsqueeze(-1)
        assert_close_sum(deq.reshape(-1, 256), want_x.double(), want_x.double().abs().amax(1, keepdim=True),
                         "dequantized recv_x", rel=2.0 ** -3)


def test_prequantized_fp8_codes_travel_unchanged():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=128, max_tokens_per_rank=8, num_experts=4, topk=1, wire="fp8")
    gen = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, 0x7e, (8, 128), generator=gen, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.rand(8, 1, generator=gen) for _ in range(2)]
    idx = [torch.arange(8).remainder(4).reshape(8, 1) for _ in range(2)]
    fp8 = getattr(torch, "float8_e4m3fn", None)

    def rank(g):
        x = codes[g.rank] if fp8 is None else codes[g.rank].view(fp8)
        return buffers[g.rank].dispatch(x, idx[g.rank], x_scales=scales[g.rank])

    runs = run_all(groups, rank)
    for d, out in enumerate(runs):
        for row, (s, t) in enumerate(out.recv_src.tolist()):
            assert torch.equal(out.recv_x[row].view(torch.uint8), codes[s][t])
            assert torch.equal(out.recv_scales[row], scales[s][t])


def test_strided_rows_are_read_in_place():
    p = Problem(2, 128, 8, 2, 8, seed=11)
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=128, max_tokens_per_rank=8, num_experts=8, topk=2)

    def rank(g):
        wide = torch.zeros(8, 256, dtype=torch.bfloat16)
        wide[:, :128] = p.x[g.rank]
        return buffers[g.rank].dispatch(wide[:, :128], p.idx[g.rank], p.w[g.rank])

    runs = run_all(groups, rank)
    kept = kept_routing(p.idx, 8, 2, 0.0)
    for d, out in enumerate(runs):
        check_dispatch(out, expected_layout(kept, 2, 8, d, 1, True), p, kept, True, 2)


def e4m3_to_float(codes):
    """OCP E4M3 ('fn') codes to float64, from the bits (no torch float8 needed)."""
    b = codes.view(torch.uint8).to(torch.int64)
    sign = torch.where(b >> 7 == 1, -1.0, 1.0).double()
    exp, man = (b >> 3) & 0xF, (b & 0x7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    sub = man / 8 * 2.0 ** -6
    return sign * torch.where(exp == 0, sub, normal)
