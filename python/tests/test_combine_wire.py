"""The low-precision combine wire (combine_wire="fp8" / "fp8_ue8m0") through epx.Buffer and
epx.LowLatencyBuffer on the CPU backend, bit for bit against a plain-torch statement of
docs/semantics.md's rule: each (token, rank) partial, summed in fp32 in slot order and rounded to
bf16, is quantized per 128 channels (scale = max(amax, 1e-4) / 448, UE8M0 rounded up to a power
of two; codes e4m3, round to nearest even), dequantized as code * scale, and the source adds the
partials in rank order in fp32, then shared_out, and rounds once to bf16. dispatch_backward keeps
bf16 partials. The sums here are unweighted, so fp32 torch additions state them exactly."""

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, make_buffers, random_bf16, run_all
from reference import expected_layout, kept_routing

BLOCK = 128


def e4m3_round(v):
    """float32 -> the nearest e4m3 value (ties to even), saturating at +-448; float32 out."""
    a = v.abs()
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1)
    step = torch.where(a < 2.0 ** -6, torch.full_like(a, 2.0 ** -9), torch.ldexp(torch.ones_like(a), exponent - 4))
    q = torch.clamp(torch.round(a / step) * step, max=448.0)  # torch.round: half to even; a / step is exact
    return torch.copysign(q, v)


def fp8_scale(amax, ue8m0):
    s = torch.clamp(amax, min=1e-4) / 448.0
    if not ue8m0:
        return s
    bits = s.view(torch.int32)
    up = torch.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
    return up.view(torch.float32)


def after_wire(partial, wire):
    """What the source adds for one fp32 partial row [H]: bf16, or bf16 quantized and dequantized."""
    row = partial.bfloat16().float()
    if wire == "bf16":
        return row
    blocks = row.reshape(-1, BLOCK)
    scale = fp8_scale(blocks.abs().amax(dim=1, keepdim=True), wire == "fp8_ue8m0")
    codes = e4m3_round(blocks * (1.0 / scale))
    return (codes * scale).reshape(-1)


def expected_sum(partials_by_rank, hidden, wire, shared=None):
    """partials_by_rank: fp32 rows in rank order (None where the token did not go)."""
    acc = torch.zeros(hidden, dtype=torch.float32)
    for p in partials_by_rank:
        if p is not None:
            acc = acc + after_wire(p, wire)
    if shared is not None:
        acc = acc + shared.float()
    return acc.bfloat16()


def ht_expected(layouts, ys, s, tokens, hidden, wire, expert_major, shared=None):
    """Unweighted combine of source rank s: per rank d, its rows of each token in slot order."""
    out = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    for t in range(tokens):
        partials = []
        for d, lay in enumerate(layouts):
            if expert_major:
                rows = sorted((sl[2], row) for row, sl in enumerate(lay.slots) if sl and sl[0] == s and sl[1] == t)
            else:
                rows = [(0, row) for row, src in enumerate(lay.src) if src == (s, t)]
            if not rows:
                partials.append(None)
                continue
            p = torch.zeros(hidden, dtype=torch.float32)
            for _, row in rows:
                p = p + ys[d][row].float()
            partials.append(p)
        out[t] = expected_sum(partials, hidden, wire, None if shared is None else shared[t])
    return out


@pytest.mark.parametrize("wire", ["fp8", "fp8_ue8m0"])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_buffer_combine_quantizes_partials_and_dispatch_backward_stays_bf16(wire, layout):
    ranks, hidden, experts, topk, tokens = 3, 256, 12, 4, 10
    p = Problem(ranks, hidden, experts, topk, tokens, seed=21, unused=0.1)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=hidden, max_tokens_per_rank=tokens, num_experts=experts, topk=topk,
                           combine_wire=wire)
    assert buffers[0]._config.combine_wire == int(epx.WireFormat[wire])
    expert_major = layout == "expert_major"

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        d = b.dispatch(p.x[r], p.idx[r], p.w[r], layout=layout)
        rows = d.recv_x.shape[0]
        y = random_bf16((rows, hidden), 10 + r) * 4
        shared = random_bf16((tokens, hidden), 20 + r)
        out = b.combine(y, d.handle, shared_out=shared, weighted=False).out
        grad = random_bf16((rows, hidden), 30 + r)
        grad_x = b.dispatch_backward(grad, d.handle).grad_x
        return y, shared, out, grad, grad_x

    runs = run_all(groups, rank)
    kept = kept_routing(p.idx, experts, topk, 0.0)
    layouts = [expected_layout(kept, ranks, experts, d, 1, expert_major) for d in range(ranks)]
    ys, grads = [run[0] for run in runs], [run[3] for run in runs]
    for s, (_, shared, out, _, grad_x) in enumerate(runs):
        want = ht_expected(layouts, ys, s, tokens, hidden, wire, expert_major, shared)
        assert torch.equal(out, want), f"rank {s} combine out"
        assert not torch.equal(want, ht_expected(layouts, ys, s, tokens, hidden, "bf16", expert_major, shared))
        want_gx = ht_expected(layouts, grads, s, tokens, hidden, "bf16", expert_major)
        assert torch.equal(grad_x, want_gx), f"rank {s} dispatch_backward grad_x (bf16 partials)"


@pytest.mark.parametrize("wire", ["fp8", "fp8_ue8m0"])
def test_low_latency_combine_quantizes_partials(wire):
    ranks, hidden, experts, topk, tokens = 2, 256, 8, 3, 8
    local = experts // ranks
    p = Problem(ranks, hidden, experts, topk, tokens, seed=22, unused=0.1)
    groups = epx.Group.host(ranks)
    buffers = run_all(groups, lambda g: epx.LowLatencyBuffer(g, hidden, tokens, experts, topk, combine_wire=wire,
                                                             timeout_ms=TIMEOUT_MS))

    def rank(g):
        r, b = g.rank, buffers[g.rank]
        d = b.dispatch(p.x[r], p.idx[r])
        y = random_bf16((local, ranks * tokens, hidden), 40 + r) * 4
        return d.recv_src.clone(), y, b.combine(y, d.handle, weighted=False)

    runs = run_all(groups, rank)
    for s in range(ranks):
        want = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        for t in range(tokens):
            partials = []
            for d, (src, y, _) in enumerate(runs):
                p_d = None
                for k in range(topk):  # the rank's slots in slot order
                    e = int(p.idx[s][t, k])
                    if e < 0 or e // local != d:
                        continue
                    j = next(j for j in range(ranks * tokens) if src[e % local, j].tolist() == [s, t])
                    p_d = (p_d if p_d is not None else torch.zeros(hidden)) + y[e % local, j].float()
                partials.append(p_d)
            want[t] = expected_sum(partials, hidden, wire)
        assert torch.equal(runs[s][2], want), f"rank {s} ll_combine out"


def test_refused_combine_wires_name_the_reason():
    groups = epx.Group.host(1)
    for wire, hidden, words in [("nvfp4", 256, "combine_wire nvfp4 is not supported"),
                                ("bogus", 256, "combine_wire: unknown 'bogus'"),
                                ("fp8", 192, "combine_wire fp8 needs hidden to be a multiple of 128")]:
        for make in (epx.Buffer, epx.LowLatencyBuffer):
            with pytest.raises(epx.InvalidArgument, match=words):
                make(groups[0], hidden, 8, 4, 2, combine_wire=wire, timeout_ms=TIMEOUT_MS)
