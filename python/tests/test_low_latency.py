"""epx.LowLatencyBuffer on the CPU backend: fused and split calls, device-side token counts,
weights at dispatch or at combine, the alternating sets' lifetimes, refusals on every rank."""

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, assert_close_sum, random_bf16, run_all, run_ranks

R, H, E, K, M = 2, 64, 8, 3, 8
L = E // R


def ll_buffers(groups, wire="bf16"):
    return run_all(groups, lambda g: epx.LowLatencyBuffer(g, H, M, E, K, wire=wire, timeout_ms=TIMEOUT_MS))


def expected_rows(p, counts, d):
    """For each local expert of rank d: the (source rank, token, slot) of its rows, in order."""
    rows = [[] for _ in range(L)]
    for s in range(R):
        for t in range(counts[s]):
            for k in range(K):
                e = int(p.idx[s][t, k])
                if e >= 0 and e // L == d:
                    rows[e % L].append((s, t, k))
    return rows


def check_dispatch(out, p, counts, d):
    rows = expected_rows(p, counts, d)
    assert out.recv_count.tolist() == [len(r) for r in rows]
    for l, entries in enumerate(rows):
        src = torch.full((R * M, 2), -1, dtype=torch.int32)
        x = torch.zeros(R * M, H, dtype=torch.bfloat16)
        for j, (s, t, _) in enumerate(entries):
            src[j] = torch.tensor([s, t])
            x[j] = p.x[s][t]
        assert torch.equal(out.recv_src[l], src), f"recv_src of expert {l}"
        assert torch.equal(out.recv_x[l], x), f"recv_x of expert {l}"
        for s in range(R):
            first = next((j for j, e in enumerate(entries) if e[0] == s), None)
            n = sum(1 for e in entries if e[0] == s)
            if n:
                assert out.recv_layout[l, s].tolist() == [first, n]


def expected_combine(p, counts, ys, s, weighted):
    out = torch.zeros(M, H, dtype=torch.float64)
    scale = torch.zeros(M, H, dtype=torch.float64)
    for d in range(R):
        rows = expected_rows(p, counts, d)
        for l, entries in enumerate(rows):
            for j, (src, t, k) in enumerate(entries):
                if src == s:
                    term = ys[d][l, j].double() * (float(p.w[s][t, k]) if weighted else 1.0)
                    out[t] += term
                    scale[t] += term.abs()
    return out, scale


@pytest.mark.parametrize("weights_at", ["combine", "dispatch", "unweighted"])
def test_fused_calls_match_reference(weights_at):
    p = Problem(R, H, E, K, M, seed=8, unused=0.1)
    counts = [M, 5]  # rank 1 counts only its first 5 rows
    groups = epx.Group.host(R)
    buffers = ll_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        num = torch.tensor([counts[r]], dtype=torch.int32)
        d = b.dispatch(p.x[r], p.idx[r], num_tokens=num, topk_weights=p.w[r] if weights_at == "dispatch" else None)
        y = random_bf16((L, R * M, H), 50 + r)
        out = b.combine(y, d.handle, topk_weights=p.w[r] if weights_at == "combine" else None,
                        weighted=weights_at != "unweighted")
        return d, y, out

    runs = run_all(groups, rank)
    ys = [run[1] for run in runs]
    for r, (d, _, out) in enumerate(runs):
        check_dispatch(d, p, counts, r)
        want, scale = expected_combine(p, counts, ys, r, weights_at != "unweighted")
        assert_close_sum(out, want, scale, f"rank {r} ll_combine")
        assert torch.equal(out[counts[r]:], torch.zeros(M - counts[r], H, dtype=torch.bfloat16))


def test_split_halves_with_two_layers_in_flight():
    problems = [Problem(R, H, E, K, M, seed=30 + i) for i in range(2)]
    groups = epx.Group.host(R)
    buffers = ll_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        outs = []
        b.dispatch_send(problems[0].x[r], problems[0].idx[r])
        d0 = b.dispatch_recv()
        b.dispatch_send(problems[1].x[r], problems[1].idx[r])
        y0 = random_bf16((L, R * M, H), 60 + r)
        b.combine_send(y0, d0.handle, topk_weights=problems[0].w[r])  # layer 0's combine beside layer 1's dispatch
        d1 = b.dispatch_recv()
        outs.append(b.combine_recv())
        y1 = random_bf16((L, R * M, H), 70 + r)
        outs.append(b.combine(y1, d1.handle, topk_weights=problems[1].w[r]))
        return (d0, d1), (y0, y1), outs

    runs = run_all(groups, rank)
    for i, p in enumerate(problems):
        ys = [run[1][i] for run in runs]
        for r, run in enumerate(runs):
            check_dispatch(run[0][i], p, [M, M], r)
            want, scale = expected_combine(p, [M, M], ys, r, True)
            assert_close_sum(run[2][i], want, scale, f"layer {i} rank {r}")


def test_stale_handle_is_refused_on_every_rank_and_clone_keeps_data():
    p = Problem(R, H, E, K, M, seed=9)
    groups = epx.Group.host(R)
    buffers = ll_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        first = b.dispatch(p.x[r], p.idx[r])
        kept = b.dispatch(p.x[r], p.idx[r], clone=True)
        assert b.is_current(first) and b.is_current(kept)
        third = b.dispatch(p.x[r], p.idx[r])
        assert not b.is_current(first) and b.is_current(third)
        y = torch.zeros(L, R * M, H, dtype=torch.bfloat16)
        try:
            b.combine(y, first.handle if r == 0 else third.handle, topk_weights=p.w[r])
        except epx.Error as e:
            return e, kept

    results = run_all(groups, rank)
    assert isinstance(results[0][0], epx.InvalidArgument) and "is stale" in str(results[0][0])
    assert isinstance(results[1][0], epx.PeerFailed)
    for r in range(R):
        check_dispatch(results[r][1], p, [M, M], r)


def test_bad_input_is_refused_on_every_rank():
    p = Problem(R, H, E, K, M, seed=10)
    groups = epx.Group.host(R)
    buffers = ll_buffers(groups)

    def rank(g):
        x = p.x[g.rank].float() if g.rank == 1 else p.x[g.rank]
        return buffers[g.rank].dispatch(x, p.idx[g.rank])

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.InvalidArgument) and "ll_dispatch: x: expected dtype bfloat16" in str(errors[1])
    assert isinstance(errors[0], epx.PeerFailed)
    # The buffer stays usable, its calls still paired.
    for r, d in enumerate(run_all(groups, lambda g: buffers[g.rank].dispatch(p.x[g.rank], p.idx[g.rank]))):
        check_dispatch(d, p, [M, M], r)


def test_fp8_wire_shapes():
    p = Problem(R, 128, E, K, M, seed=12)
    groups = epx.Group.host(R)
    buffers = run_all(groups, lambda g: epx.LowLatencyBuffer(g, 128, M, E, K, wire="fp8", timeout_ms=TIMEOUT_MS))
    runs = run_all(groups, lambda g: buffers[g.rank].dispatch(p.x[g.rank], p.idx[g.rank]))
    fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)
    for d in runs:
        assert d.recv_x.dtype == fp8 and d.recv_x.shape == (L, R * M, 128)
        assert d.recv_scales.shape == (L, R * M, 1) and d.recv_scales.dtype == torch.float32


def test_a_dispatch_send_between_a_combines_halves_keeps_the_combines_inputs():
    """The send halves of both kinds may be in flight together: each keeps its own inputs alive."""
    groups = epx.Group.host(R)
    buffers = ll_buffers(groups)
    p = Problem(R, H, E, K, M, seed=61)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        d = b.dispatch(p.x[r], p.idx[r])
        y = random_bf16(tuple(d.recv_x.shape), 70 + r)
        want = b.combine(y, d.handle, topk_weights=p.w[r], clone=True)
        b.combine_send(y.clone(), d.handle, topk_weights=p.w[r].clone())  # held only by the buffer
        b.dispatch_send(p.x[r], p.idx[r])
        scratch = [torch.full((M, K), 1e9) for _ in range(8)]  # would take freed memory
        got = b.combine_recv(clone=True)
        b.dispatch_recv()
        del scratch
        return got, want

    for got, want in run_all(groups, rank):
        assert torch.equal(got, want)
