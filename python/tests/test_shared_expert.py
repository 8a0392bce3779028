"""The fused shared expert (shared_expert=True, docs/semantics.md) on the CPU backend: a whole MoE
layer (routed experts and a gated shared expert, each a linear map) through one grouped GEMM over
epx's segments, forward and backward, against the same layer written densely in plain torch."""

import pytest
import torch

import epx
import epx.torch
from helpers import Problem, assert_close_sum, make_buffers, run_all, run_ranks

RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, ALIGN = 2, 64, 8, 2, [12, 7], 4
LOCAL = EXPERTS // RANKS


def weights(seed=3):
    g = torch.Generator().manual_seed(seed)
    routed = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    shared = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    return routed, shared


def grouped_gemm(rows, offsets, stacked):
    """rows [N, H] bf16 times the weight of each segment (stacked [segments, H, H]); padding rows too."""
    out = torch.zeros(rows.shape[0], HIDDEN)
    for s in range(stacked.shape[0]):
        a, b = int(offsets[s]), int(offsets[s + 1])
        out[a:b] = rows[a:b].float() @ stacked[s]
    return out.bfloat16()


def dense_layer(x, idx, w, gate, routed, shared):
    """out[t] = sum_k w[t,k] * x[t] @ W[idx[t,k]] + gate[t] * x[t] @ W_shared, in float64."""
    x, w, gate = x.double(), w.double(), gate.double()
    out = gate[:, None] * (x @ shared.double())
    for k in range(idx.shape[1]):
        e = idx[:, k]
        used = (e >= 0).double()[:, None]
        out = out + used * w[:, k:k + 1] * torch.einsum("th,thj->tj", x, routed.double()[e.clamp(min=0)])
    return out


def test_moe_layer_with_a_gated_shared_expert_matches_the_dense_layer():
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=11, unused=0.2)
    routed, shared = weights()
    gates = [torch.rand(t, generator=torch.Generator().manual_seed(5 + t)) for t in p.tokens]
    grad_outs = [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(9 + t)).bfloat16() for t in p.tokens]
    groups = epx.Group.host(RANKS)
    buffers = make_buffers(groups, hidden=HIDDEN, max_tokens_per_rank=max(p.tokens), num_experts=EXPERTS, topk=TOPK,
                           expert_alignment=ALIGN, shared_expert=True)

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        d = b.dispatch(p.x[r], p.idx[r], p.w[r], shared_gate=gates[r])
        assert d.expert_offsets.shape == (LOCAL + 2,) and int(d.tokens_per_expert[0]) == p.tokens[r]
        stacked = torch.cat([shared[None], routed[r * LOCAL:(r + 1) * LOCAL]])  # segment 0 is the shared expert
        y = grouped_gemm(d.recv_x, d.expert_offsets, stacked)
        out = b.combine(y, d.handle).out
        cb = b.combine_backward(grad_outs[r], d.handle, y)
        # grad of the rows through the linear maps, then back to the tokens
        transposed = stacked.transpose(1, 2).contiguous()
        grad_recv_x = grouped_gemm(cb.grad_y, d.expert_offsets, transposed)
        db = b.dispatch_backward(grad_recv_x, d.handle)
        return out, db.grad_x, cb.grad_topk_weights, cb.grad_shared_gate

    results = run_all(groups, rank)
    for r, (out, grad_x, grad_w, grad_gate) in enumerate(results):
        x = p.x[r].double().requires_grad_()
        w = p.w[r].double().requires_grad_()
        gate = gates[r].double().requires_grad_()
        want = dense_layer(x, p.idx[r], w, gate, routed, shared)
        want.backward(grad_outs[r].double())
        scale = want.detach().abs() + 1.0
        assert_close_sum(out, want.detach(), scale, f"rank {r} out", rel=2.0 ** -5)
        assert_close_sum(grad_x, x.grad, x.grad.abs() + 1.0, f"rank {r} grad_x", rel=2.0 ** -5)
        used = (p.idx[r] >= 0).double()
        assert_close_sum(grad_w, w.grad * used, w.grad.abs() + 1.0, f"rank {r} grad_topk_weights", rel=2.0 ** -5)
        assert_close_sum(grad_gate, gate.grad, gate.grad.abs() + 1.0, f"rank {r} grad_shared_gate", rel=2.0 ** -5)


def differentiable_grouped_gemm(rows, offsets, stacked):
    """grouped_gemm with autograd: each segment's rows times its weight (float32), as bf16."""
    parts = [rows[int(offsets[s]):int(offsets[s + 1])].float() @ stacked[s] for s in range(stacked.shape[0])]
    parts.append(rows[int(offsets[-1]):].float() * 0)  # rows past the last segment (none here)
    return torch.cat(parts).bfloat16()


@pytest.mark.parametrize("weights_in_combine", [True, False])
def test_autograd_reaches_the_shared_gate(weights_in_combine):
    """epx.torch.dispatch(shared_gate=) and combine: the gradients of x, the router weights and the gate
    against the dense layer, with the weights applied by combine (weighted) or by the experts through
    recv_weights (the shared rows' being the gate) and an unweighted combine."""
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=17, unused=0.2)
    routed, shared = weights(seed=4)
    gates = [torch.rand(t, generator=torch.Generator().manual_seed(15 + t)) for t in p.tokens]
    grad_outs = [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(19 + t)) for t in p.tokens]
    groups = epx.Group.host(RANKS)
    buffers = make_buffers(groups, hidden=HIDDEN, max_tokens_per_rank=max(p.tokens), num_experts=EXPERTS, topk=TOPK,
                           expert_alignment=ALIGN, shared_expert=True)

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        x = p.x[r].clone().requires_grad_()
        w = p.w[r].clone().requires_grad_()
        gate = gates[r].clone().requires_grad_()
        d = epx.torch.dispatch(b, x, p.idx[r], w, shared_gate=gate)
        stacked = torch.cat([shared[None], routed[r * LOCAL:(r + 1) * LOCAL]])
        y = differentiable_grouped_gemm(d.recv_x, d.expert_offsets, stacked)
        if weights_in_combine:
            out = epx.torch.combine(b, y, d.handle)
        else:
            out = epx.torch.combine(b, (y.float() * d.recv_weights[:, None]).bfloat16(), d.handle, weighted=False)
        (out.float() * grad_outs[r]).sum().backward()
        return out.detach(), x.grad, w.grad, gate.grad

    for r, (out, grad_x, grad_w, grad_gate) in enumerate(run_all(groups, rank)):
        x = p.x[r].double().requires_grad_()
        w = p.w[r].double().requires_grad_()
        gate = gates[r].double().requires_grad_()
        want = dense_layer(x, p.idx[r], w, gate, routed, shared)
        want.backward(grad_outs[r].double())
        used = (p.idx[r] >= 0).double()
        for got, ref, what in ((out, want.detach(), "out"), (grad_x, x.grad, "grad x"),
                               (grad_w, w.grad * used, "grad topk_weights"), (grad_gate, gate.grad, "grad gate")):
            assert got is not None, what
            assert_close_sum(got, ref, ref.abs() + 1.0, f"rank {r} {what}", rel=2.0 ** -4)


def test_low_latency_shared_expert_matches_the_dense_layer():
    """LowLatencyBuffer(shared_expert=True): the outputs lead with the shared expert (this rank's own rows
    0..T-1), and a weighted ll_combine adds its rows times the gate: a decode MoE layer (routed and gated
    shared experts, each a linear map) against the dense layer; also through torch.ops.epx.ll_dispatch."""
    tokens = [5, 3]
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, tokens, seed=23, unused=0.2)
    routed, shared = weights(seed=6)
    gates = [torch.rand(t, generator=torch.Generator().manual_seed(25 + t)) for t in tokens]
    groups = epx.Group.host(RANKS)

    def rank(g):  # creation is collective: on each rank's thread
        r = g.rank
        b = epx.LowLatencyBuffer(g, HIDDEN, max(tokens), EXPERTS, TOPK, shared_expert=True, timeout_ms=20000)
        d = b.dispatch(p.x[r], p.idx[r], topk_weights=p.w[r], shared_gate=gates[r])
        slots = RANKS * max(tokens)
        assert d.recv_x.shape == (1 + LOCAL, slots, HIDDEN) and int(d.recv_count[0]) == tokens[r]
        assert torch.equal(d.recv_x[0, :tokens[r]], p.x[r])
        stacked = torch.cat([shared[None], routed[r * LOCAL:(r + 1) * LOCAL]])
        y = torch.stack([(d.recv_x[e].float() @ stacked[e]).bfloat16() for e in range(1 + LOCAL)])
        out = b.combine(y, d.handle)
        op = torch.ops.epx.ll_dispatch(b.id, p.x[r], p.idx[r], None, p.w[r], 0.0, None, gates[r])
        assert op[1].shape == (1 + LOCAL, slots, HIDDEN) and torch.equal(op[1][0, :tokens[r]], p.x[r])
        return out

    for r, out in enumerate(run_all(groups, rank)):
        want = dense_layer(p.x[r], p.idx[r], p.w[r], gates[r], routed, shared)
        assert_close_sum(out, want, want.abs() + 1.0, f"rank {r} out", rel=2.0 ** -5)


def test_low_latency_gate_needs_the_shared_expert():
    groups = epx.Group.host(2)
    x = torch.zeros(4, 64).bfloat16()
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    _, errors = run_ranks(groups, lambda g: epx.LowLatencyBuffer(g, 64, 4, 4, 2, timeout_ms=20000).dispatch(
        x, idx, shared_gate=torch.ones(4)))
    for e in errors:
        assert isinstance(e, epx.InvalidArgument) and "shared_gate given but the buffer has no shared expert" in str(e)
