"""A plain-torch statement of docs/semantics.md for the tests: layouts exactly, sums in float64.

It sees every rank's inputs at once and builds each rank's expected outputs by scanning all
(rank, token, slot) triples, as tools/verify does in C++, independently of epx.
"""

import math

import torch


def kept_routing(idx, experts, topk, capacity_factor):
    """Per rank [T, K]: the routing after capacity-factor dropping (dropped slots become -1)."""
    if capacity_factor <= 0:
        return [i.clone() for i in idx]
    total = sum(i.shape[0] for i in idx)
    cap = math.ceil(capacity_factor * total * topk / experts)
    seen = [0] * experts
    kept = []
    for i in idx:  # order: source rank, then token, then slot
        k = i.clone()
        for t in range(k.shape[0]):
            for s in range(topk):
                e = int(k[t, s])
                if e >= 0:
                    if seen[e] >= cap:
                        k[t, s] = -1
                    seen[e] += 1
        kept.append(k)
    return kept


class Layout:
    """Rank d's expected dispatch output: one entry per row, and the offsets."""

    def __init__(self):
        self.src = []  # (rank, token) per row, (-1, -1) padding
        self.slots = []  # expert-major: (rank, token, slot) of the row; rank-major: list of (slot, local) pairs
        self.expert_offsets = [0]
        self.tokens_per_expert = []
        self.rank_offsets = [0]


def expected_layout(kept, ranks, experts, d, alignment, expert_major, capacity=None):
    local = experts // ranks
    lay = Layout()
    received = []  # rank-major order: (s, t) with an expert on d
    for s, k in enumerate(kept):
        for t in range(k.shape[0]):
            if any(int(e) >= 0 and int(e) // local == d for e in k[t]):
                received.append((s, t))
        lay.rank_offsets.append(len(received))
    if expert_major:
        for e_local in range(local):
            count = 0
            for s, t in received:
                for slot, e in enumerate(kept[s][t].tolist()):
                    if e == d * local + e_local:
                        lay.src.append((s, t))
                        lay.slots.append((s, t, slot))
                        count += 1
            lay.tokens_per_expert.append(count)
            while len(lay.src) % alignment:
                lay.src.append((-1, -1))
                lay.slots.append(None)
            lay.expert_offsets.append(len(lay.src))
    else:
        counts = [0] * local
        for s, t in received:
            lay.src.append((s, t))
            pairs = [(slot, e - d * local) for slot, e in enumerate(kept[s][t].tolist()) if e >= 0 and e // local == d]
            lay.slots.append(pairs)
            for _, l in pairs:
                counts[l] += 1
        lay.tokens_per_expert = counts
    lay.num_rows = len(lay.src)
    if capacity is not None:  # capacity mode: rows past num_rows are empty; rows past capacity are lost
        lay.src = (lay.src + [(-1, -1)] * capacity)[:capacity]
        lay.slots = (lay.slots + [None] * capacity)[:capacity]
    return lay


def check_dispatch(d, lay, problem, kept, expert_major, topk):
    """Exact comparison of rank d's dispatch output (host tensors) with the expected layout."""
    src = torch.tensor(lay.src, dtype=torch.int32).reshape(-1, 2)
    assert torch.equal(d.recv_src.cpu(), src), "recv_src"
    assert d.tokens_per_expert.tolist() == lay.tokens_per_expert, "tokens_per_expert"
    assert d.rank_offsets.tolist() == lay.rank_offsets, "rank_offsets"
    rows = len(lay.src)
    want_x = torch.zeros(rows, problem.hidden, dtype=torch.bfloat16)
    for row, (s, t) in enumerate(lay.src):
        if s >= 0:
            want_x[row] = problem.x[s][t]
    if d.recv_x.dtype == torch.bfloat16:
        assert torch.equal(d.recv_x.cpu(), want_x), "recv_x"
    if expert_major:
        assert d.expert_offsets.tolist() == lay.expert_offsets, "expert_offsets"
        want_w = torch.tensor([problem.w[sl[0]][sl[1], sl[2]].item() if sl else 0.0 for sl in lay.slots])
        assert torch.equal(d.recv_weights.cpu(), want_w), "recv_weights"
    else:
        want_idx = torch.full((rows, topk), -1, dtype=torch.int32)
        want_w = torch.zeros(rows, topk)
        for row, pairs in enumerate(lay.slots):
            for slot, l in pairs or []:
                s, t = lay.src[row]
                want_idx[row, slot] = l
                want_w[row, slot] = problem.w[s][t, slot]
        assert torch.equal(d.recv_topk_idx.cpu(), want_idx), "recv_topk_idx"
        assert torch.equal(d.recv_topk_weights.cpu(), want_w), "recv_topk_weights"
    return want_x


def expected_combine(layouts, ys, s, tokens, hidden, weights, weighted, expert_major, shared=None):
    """out of source rank s in float64, and the sum of the magnitudes it adds (for the tolerance)."""
    out = torch.zeros(tokens, hidden, dtype=torch.float64)
    scale = torch.zeros(tokens, hidden, dtype=torch.float64)
    for d, lay in enumerate(layouts):
        for row, (src, t) in enumerate(lay.src):
            if src != s:
                continue
            y = ys[d][row].double()
            if expert_major:
                w = float(weights[s][t, lay.slots[row][2]]) if weighted else 1.0
                term = w * y
            else:
                term = y
            out[t] += term
            scale[t] += term.abs()
    if shared is not None:
        out += shared.double()
        scale += shared.double().abs()
    return out, scale


def expected_grad_weights_gather(layouts, grads, s, tokens, topk, expert_major):
    """dispatch_backward's grad_topk_weights of rank s: each kept slot gets the value at its row."""
    want = torch.zeros(tokens, topk)
    for d, lay in enumerate(layouts):
        for row, (src, t) in enumerate(lay.src):
            if src != s:
                continue
            if expert_major:
                want[t, lay.slots[row][2]] = grads[d][row]
            else:
                for slot, _ in lay.slots[row]:
                    want[t, slot] = grads[d][row, slot]
    return want


def expected_grad_y(lay, grad_outs, weights, hidden, weighted, expert_major):
    """combine_backward's grad_y on expert rank d (exact: one fp32 product, rounded to bf16)."""
    want = torch.zeros(len(lay.src), hidden, dtype=torch.bfloat16)
    for row, (s, t) in enumerate(lay.src):
        if s < 0:
            continue
        g = grad_outs[s][t]
        if expert_major and weighted:
            w = weights[s][t, lay.slots[row][2]]
            want[row] = (g.double() * w.double()).float().bfloat16()
        else:
            want[row] = g
    return want


def expected_grad_w_dot(layouts, grad_outs, ys, s, tokens, topk):
    """combine_backward's grad_topk_weights of rank s (weighted, expert-major) in float64, and magnitudes."""
    want = torch.zeros(tokens, topk, dtype=torch.float64)
    scale = torch.zeros(tokens, topk, dtype=torch.float64)
    for d, lay in enumerate(layouts):
        for row, (src, t) in enumerate(lay.src):
            if src == s:
                prod = grad_outs[s][t].double() * ys[d][row].double()
                want[t, lay.slots[row][2]] = prod.sum()
                scale[t, lay.slots[row][2]] = prod.abs().sum()
    return want, scale
