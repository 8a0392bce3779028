"""epx.torch.dispatch / combine under autograd: the gradients of x, of the router weights (or
probs) and of the experts' parameters match a plain-torch dense MoE in float64 (index_select /
index_add over all ranks' tokens at once), on the CPU backend."""

import pytest
import torch

import epx
from helpers import Problem, make_buffers, run_all

RANKS, HIDDEN, EXPERTS, TOPK, TOKENS = 2, 64, 8, 3, 12
LOCAL = EXPERTS // RANKS


def dense_reference(p, weights, expert_w, grad_outs):
    """Every rank's out[t] = sum_k w[t,k] x[t] @ W[e_k] in float64, and the grads of x, w, W."""
    xs = [x.double().requires_grad_() for x in p.x]
    ws = [w.double().requires_grad_() for w in weights]
    big_w = expert_w.double().requires_grad_()
    loss = 0.0
    for r in range(p.ranks):
        idx = p.idx[r]
        out = torch.zeros(p.tokens[r], p.hidden, dtype=torch.float64)
        for k in range(p.topk):
            used = torch.nonzero(idx[:, k] >= 0).flatten()
            rows = torch.index_select(xs[r], 0, used)
            experts = torch.index_select(big_w, 0, idx[used, k])
            y = torch.bmm(rows.unsqueeze(1), experts).squeeze(1) * ws[r][used, k].unsqueeze(1)
            out = out.index_add(0, used, y)
        loss = loss + (out * grad_outs[r].double()).sum()
    loss.backward()
    return [x.grad for x in xs], [w.grad for w in ws], big_w.grad


def experts_expert_major(d, w_local):
    """y rows in d's layout: each local expert's segment through its weight, padding rows zero."""
    offsets, counts = d.expert_offsets.tolist(), d.tokens_per_expert.tolist()
    parts = []
    for l in range(len(counts)):
        seg = d.recv_x[offsets[l]:offsets[l] + counts[l]].float() @ w_local[l]
        parts.append(seg)
        parts.append(seg.new_zeros(offsets[l + 1] - offsets[l] - counts[l], d.recv_x.shape[1]))
    return torch.cat(parts)


def experts_rank_major(d, w_local):
    """Each received row once: sum over its slots on this rank of weight * expert(row)."""
    y = d.recv_x.new_zeros(d.recv_x.shape, dtype=torch.float32)
    for k in range(d.recv_topk_idx.shape[1]):
        for l in range(w_local.shape[0]):
            rows = torch.nonzero(d.recv_topk_idx[:, k] == l).flatten()
            term = (d.recv_x[rows].float() @ w_local[l]) * d.recv_topk_weights[rows, k].unsqueeze(1)
            y = y.index_add(0, rows, term)
    return y


def grads_close(got, want, what):
    err = (got.double() - want).abs().max()
    assert err <= 0.02 * want.abs().max() + 1e-12, f"{what}: max error {float(err):.3g}, scale {float(want.abs().max()):.3g}"


@pytest.mark.parametrize("mode", ["weighted_combine", "weights_at_experts", "rank_major", "dense_probs"])
def test_gradients_match_dense_reference(mode):
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=21, unused=0.1)
    expert_w = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(4)) / HIDDEN ** 0.5
    grad_outs = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(40 + r)) for r in range(RANKS)]
    groups = epx.Group.host(RANKS)
    buffers = make_buffers(groups, hidden=HIDDEN, max_tokens_per_rank=TOKENS, num_experts=EXPERTS, topk=TOPK,
                           expert_alignment=4)
    dense = mode == "dense_probs"
    if dense:
        maps_probs = [p.dense(r) for r in range(RANKS)]
        for r in range(RANKS):
            p.idx[r], p.w[r] = p.sorted_routing(r)

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        x = p.x[r].clone().requires_grad_()
        w_local = expert_w[r * LOCAL:(r + 1) * LOCAL].clone().requires_grad_()
        if dense:
            routing_map, probs = maps_probs[r]
            probs = probs.clone().requires_grad_()
            d = epx.torch.dispatch(b, x, routing_map=routing_map, probs=probs)
            weights = probs
        else:
            weights = p.w[r].clone().requires_grad_()
            layout = "rank_major" if mode == "rank_major" else "expert_major"
            d = epx.torch.dispatch(b, x, p.idx[r], weights, layout=layout)
        if mode == "rank_major":
            out = epx.torch.combine(b, experts_rank_major(d, w_local).bfloat16(), d.handle)
        elif mode == "weights_at_experts":
            y = experts_expert_major(d, w_local) * d.recv_weights.unsqueeze(1)
            out = epx.torch.combine(b, y.bfloat16(), d.handle, weighted=False)
        else:
            out = epx.torch.combine(b, experts_expert_major(d, w_local).bfloat16(), d.handle)
        (out.float() * grad_outs[r]).sum().backward()
        return x.grad, weights.grad, w_local.grad

    runs = run_all(groups, rank)
    want_x, want_w, want_big = dense_reference(p, p.w, expert_w, grad_outs)
    for r, (gx, gw, gW) in enumerate(runs):
        assert gx.dtype == torch.bfloat16
        grads_close(gx, want_x[r], f"rank {r} grad x")
        if dense:  # the probs' grad [T, E]: the slot grads at their experts
            want = torch.zeros(TOKENS, EXPERTS, dtype=torch.float64)
            for k in range(TOPK):
                used = p.idx[r][:, k] >= 0
                want[used, p.idx[r][used, k]] = want_w[r][used, k]
            grads_close(gw, want, f"rank {r} grad probs")
        else:
            grads_close(gw, want_w[r], f"rank {r} grad topk_weights")
        grads_close(gW, want_big[r * LOCAL:(r + 1) * LOCAL], f"rank {r} grad expert weights")


def test_shared_expert_gradient_passes_through():
    p = Problem(2, 64, 4, 2, 8, seed=2)
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)

    def rank(g):
        b = buffers[g.rank]
        d = epx.torch.dispatch(b, p.x[g.rank], p.idx[g.rank], p.w[g.rank])
        shared = torch.randn(8, 64).bfloat16().requires_grad_()
        out = epx.torch.combine(b, d.recv_x, d.handle, shared_out=shared)
        out.float().sum().backward()
        return shared.grad

    for grad in run_all(groups, rank):
        assert torch.equal(grad, torch.ones(8, 64, dtype=torch.bfloat16))


def test_outputs_not_needing_grad_run_no_backward_collective():
    """Without inputs that require grad, nothing is recorded: no backward call on any rank."""
    p = Problem(2, 64, 4, 2, 8, seed=3)
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)

    def rank(g):
        b = buffers[g.rank]
        d = epx.torch.dispatch(b, p.x[g.rank], p.idx[g.rank], p.w[g.rank])
        out = epx.torch.combine(b, d.recv_x, d.handle)
        return out.requires_grad

    assert run_all(groups, rank) == [False, False]
