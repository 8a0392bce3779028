"""Redundant experts (EPLB, docs/semantics.md "Redundant experts (EPLB)") through the Python surface on the
CPU backend: Buffer(num_physical_experts=, max_replicas=), dispatch(expert_replicas=), topk_physical,
expert_load() / reset_expert_load(), epx.torch's autograd and LowLatencyBuffer. The oracle, as in
tests/eplb_test.cpp: an EPLB dispatch equals a plain one (num_experts = P) of the routing rewritten to the
physical experts the rule picks, computed here on its own."""

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, make_buffers, random_bf16, run_all, run_ranks

RANKS, HIDDEN, EXPERTS, PHYSICAL, TOPK, TOKENS = 2, 64, 4, 8, 2, [10, 7]
WIDTH = PHYSICAL - EXPERTS + 1  # max_replicas' default
PER_RANK = PHYSICAL // RANKS

# Logical 0 on both ranks, 1 on rank 0 twice, 2 on rank 1 only, 3 on both; physical 7 unused.
TABLE = torch.tensor([[0, -1, 4, -1, -1],
                      [1, 2, -1, -1, -1],
                      [5, -1, -1, -1, -1],
                      [6, 3, -1, -1, -1]], dtype=torch.int32)


def expected_physical(table, idx, rank):
    """The rule on its own: the row's replicas on `rank` if any, else all, in table order; token t takes
    number (t + rank) mod n."""
    out = torch.full_like(idx, -1, dtype=torch.int32)
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            row = [int(p) for p in table[e] if p >= 0]
            own = [p for p in row if p // PER_RANK == rank]
            candidates = own or row
            out[t, k] = candidates[(t + rank) % len(candidates)]
    return out


def eplb_buffers(groups, **kwargs):
    return make_buffers(groups, hidden=HIDDEN, max_tokens_per_rank=max(TOKENS), num_experts=EXPERTS, topk=TOPK,
                        num_physical_experts=PHYSICAL, **kwargs)


def plain_buffers(groups, **kwargs):
    return make_buffers(groups, hidden=HIDDEN, max_tokens_per_rank=max(TOKENS), num_experts=PHYSICAL, topk=TOPK,
                        **kwargs)


def outputs_of(b, d, r, layout):
    """Every tensor of a dispatch and of the calls on its handle (inputs depend on the row count only)."""
    rows = d.recv_x.shape[0]
    y = random_bf16((rows, HIDDEN), 10 + r)
    weighted = layout == "expert_major"
    combined = b.combine(y, d.handle, weighted=weighted).out
    grad_recv_w = torch.linspace(-1, 1, rows if weighted else rows * TOPK).reshape((rows,) if weighted else (rows, TOPK))
    db = b.dispatch_backward(random_bf16((rows, HIDDEN), 20 + r), d.handle, grad_recv_w.contiguous())
    cb = b.combine_backward(random_bf16((TOKENS[r], HIDDEN), 30 + r), d.handle, y, weighted=weighted)
    fields = [t for t in d[:11] if t is not None]
    return fields + [combined, db.grad_x, db.grad_topk_weights, cb.grad_y] + (
        [cb.grad_topk_weights] if weighted else [])


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("dense", [False, True])
def test_eplb_dispatch_equals_a_plain_dispatch_of_the_physical_routing(layout, dense):
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=4, unused=0.2)
    groups = epx.Group.host(RANKS)
    eplb, plain = eplb_buffers(groups, expert_alignment=2), plain_buffers(groups, expert_alignment=2)

    def rank(g):
        r = g.rank
        if dense:
            routing_map, probs = p.dense(r)
            d = eplb[r].dispatch(p.x[r], routing_map=routing_map, probs=probs, layout=layout, expert_replicas=TABLE)
            idx, w = p.sorted_routing(r)  # the slots a dense row fills
        else:
            d = eplb[r].dispatch(p.x[r], p.idx[r], p.w[r], layout=layout, expert_replicas=TABLE)
            idx, w = p.idx[r], p.w[r]
        want_physical = expected_physical(TABLE, idx, r)
        ref = plain[r].dispatch(p.x[r], want_physical, w, layout=layout)
        return (d.topk_physical, want_physical, ref.topk_physical, outputs_of(eplb[r], d, r, layout),
                outputs_of(plain[r], ref, r, layout))

    for r, (chosen, want, plain_chosen, got, ref) in enumerate(run_all(groups, rank)):
        assert chosen.dtype == torch.int32 and torch.equal(chosen, want), f"rank {r}"
        assert plain_chosen is None
        assert len(got) == len(ref)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                                                      b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), \
                f"rank {r}, output {i}"


def test_the_rule_keeps_tokens_on_their_rank_where_a_replica_is():
    groups = epx.Group.host(RANKS)
    buffers = eplb_buffers(groups)
    idx = torch.tensor([[0, 1], [0, 1], [2, 3], [3, -1]])

    def rank(g):
        x = random_bf16((4, HIDDEN), 1)
        return buffers[g.rank].dispatch(x, idx, expert_replicas=TABLE).topk_physical

    got = run_all(groups, rank)
    assert got[0].tolist() == [[0, 1], [0, 2], [5, 3], [3, -1]]  # logical 3: rank 0's replica is 3
    assert got[1].tolist() == [[4, 2], [4, 1], [5, 6], [6, -1]]  # logical 1 has no replica on rank 1


def test_a_rewritten_table_is_read_by_the_next_call():
    groups = epx.Group.host(RANKS)
    buffers = eplb_buffers(groups)
    tables = [TABLE.clone() for _ in range(RANKS)]

    def rank(g):
        b, table = buffers[g.rank], tables[g.rank]
        x, idx = random_bf16((2, HIDDEN), 2), torch.tensor([[2, -1], [2, -1]])
        before = b.dispatch(x, idx, expert_replicas=table).topk_physical[:, 0].tolist()
        table[2] = torch.tensor([7, -1, -1, -1, -1], dtype=torch.int32)  # a rebalance: logical 2 moves to 7
        after = b.dispatch(x, idx, expert_replicas=table).topk_physical[:, 0].tolist()
        return before, after

    for before, after in run_all(groups, rank):
        assert before == [5, 5] and after == [7, 7]


def test_autograd_through_epx_torch_equals_the_plain_buffer():
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=8, unused=0.1)
    groups = epx.Group.host(RANKS)
    eplb, plain = eplb_buffers(groups), plain_buffers(groups)

    def layer(b, x, idx, w, **kw):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        d = epx.torch.dispatch(b, x, idx, w, **kw)
        out = epx.torch.combine(b, d.recv_x * 2, d.handle)
        out.float().square().sum().backward()
        return out, x.grad, w.grad, d.topk_physical

    def rank(g):
        r = g.rank
        got = layer(eplb[r], p.x[r], p.idx[r], p.w[r], expert_replicas=TABLE)
        ref = layer(plain[r], p.x[r], expected_physical(TABLE, p.idx[r], r), p.w[r])
        return got, ref

    for r, (got, ref) in enumerate(run_all(groups, rank)):
        assert torch.equal(got[3], expected_physical(TABLE, p.idx[r], r)) and ref[3] is None
        for a, b, what in zip(got[:3], ref[:3], ("out", "grad x", "grad topk_weights")):
            assert torch.equal(a, b), f"rank {r}: {what}"


def test_expert_load_accumulates_skips_cached_dispatches_and_resets():
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, TOKENS, seed=6, unused=0.2)
    groups = epx.Group.host(RANKS)
    buffers = eplb_buffers(groups, expert_alignment=4)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        load = b.expert_load()
        assert load.shape == (PER_RANK,) and load.dtype == torch.int64 and not load.any()
        d = b.dispatch(p.x[r], p.idx[r], expert_replicas=TABLE)
        b.dispatch(p.x[r], handle=d.handle)  # cached: counts nothing
        b.dispatch(p.x[r], p.idx[r], layout="rank_major", expert_replicas=TABLE)
        counted = b.expert_load().clone()
        seen_by_view = load.clone()  # the first view shows the later counts
        b.reset_expert_load()
        cleared = b.expert_load().clone()
        return d.topk_physical, d.tokens_per_expert, counted, seen_by_view, cleared

    results = run_all(groups, rank)
    chosen = torch.cat([c.flatten() for c, *_ in results])
    for r, (_, tokens_per_expert, counted, seen_by_view, cleared) in enumerate(results):
        want = torch.tensor([int((chosen == r * PER_RANK + l).sum()) for l in range(PER_RANK)])
        assert torch.equal(counted, 2 * want) and torch.equal(seen_by_view, counted), f"rank {r}"
        assert torch.equal(tokens_per_expert, want)
        assert not cleared.any()


def test_a_bad_table_fails_every_rank_and_the_next_call_works():
    groups = epx.Group.host(RANKS)
    buffers = eplb_buffers(groups)
    bad = TABLE.clone()
    bad[3, 1] = 1  # physical 1 serves logical 1 already

    def rank(g):
        b = buffers[g.rank]
        x, idx = random_bf16((2, HIDDEN), 3), torch.tensor([[0, 1], [2, 3]])
        with pytest.raises(epx.Error) as raised:
            b.dispatch(x, idx, expert_replicas=bad if g.rank == 1 else TABLE)
        b.dispatch(x, idx, expert_replicas=TABLE)  # the buffer stays usable
        return raised.value

    errors = run_all(groups, rank)
    assert isinstance(errors[1], epx.InvalidArgument) and isinstance(errors[0], epx.PeerFailed)
    for e in errors:
        assert "expert_replicas[3][1] = 1 repeats expert_replicas[1][0]" in str(e)


def test_the_table_is_required_with_eplb_refused_without_and_not_taken_by_a_cached_dispatch():
    groups = epx.Group.host(RANKS)
    eplb, plain = eplb_buffers(groups), plain_buffers(groups)
    x, idx = random_bf16((2, HIDDEN), 3), torch.tensor([[0, 1], [2, 3]])

    def rank(g):
        r = g.rank
        with pytest.raises(epx.InvalidArgument, match="expert_replicas is missing"):
            eplb[r].dispatch(x, idx)
        with pytest.raises(epx.InvalidArgument, match="no redundant experts"):
            plain[r].dispatch(x, idx, expert_replicas=TABLE)
        with pytest.raises(epx.InvalidArgument, match="dispatch: expert_replicas"):
            eplb[r].dispatch(x, idx, expert_replicas=TABLE.long())  # int32 only
        d = eplb[r].dispatch(x, idx, expert_replicas=TABLE)
        with pytest.raises(epx.InvalidArgument, match="replica choice too"):
            eplb[r].dispatch(x, handle=d.handle, expert_replicas=TABLE)

    run_all(groups, rank)


def test_config_fields_are_agreed_and_checked():
    groups = epx.Group.host(RANKS)
    buffers = eplb_buffers(groups, max_replicas=3)
    assert buffers[0].config.num_physical_experts == PHYSICAL and buffers[0].config.max_replicas == 3
    assert buffers[0].num_local_experts == PER_RANK and buffers[0].eplb
    _, errors = run_ranks(groups, lambda g: epx.Buffer(g, HIDDEN, 8, EXPERTS, TOPK, num_physical_experts=7,
                                                       timeout_ms=TIMEOUT_MS))
    for e in errors:
        assert isinstance(e, epx.InvalidArgument) and "multiple of the group size" in str(e)
    _, errors = run_ranks(groups, lambda g: epx.Buffer(g, HIDDEN, 8, EXPERTS, TOPK, timeout_ms=TIMEOUT_MS,
                                                       num_physical_experts=PHYSICAL if g.rank else 0))
    for e in errors:
        assert isinstance(e, epx.ConfigMismatch), repr(e)


@pytest.mark.parametrize("through_ops", [False, True])
def test_low_latency_equals_a_plain_buffer_of_the_physical_routing(through_ops):
    p = Problem(RANKS, HIDDEN, EXPERTS, TOPK, 6, seed=12, unused=0.2)
    groups = epx.Group.host(RANKS)
    eplb = run_all(groups, lambda g: epx.LowLatencyBuffer(g, HIDDEN, 6, EXPERTS, TOPK, num_physical_experts=PHYSICAL,
                                                          timeout_ms=TIMEOUT_MS))
    plain = run_all(groups, lambda g: epx.LowLatencyBuffer(g, HIDDEN, 6, PHYSICAL, TOPK, timeout_ms=TIMEOUT_MS))

    def run(b, x, idx, w, r, **kw):
        if through_ops:
            d = epx.torch.ll_dispatch(b, x, idx, topk_weights=w, **kw)
        else:
            d = b.dispatch(x, idx, topk_weights=w, clone=True, **kw)
        y = random_bf16(tuple(d.recv_x.shape), 40 + r)
        out = epx.torch.ll_combine(b, y, d.handle) if through_ops else b.combine(y, d.handle)
        return [d.recv_x, d.recv_count, d.recv_src, d.recv_layout, out], d.topk_physical, b.expert_load().clone()

    def rank(g):
        r = g.rank
        got = run(eplb[r], p.x[r], p.idx[r], p.w[r], r, expert_replicas=TABLE)
        ref = run(plain[r], p.x[r], expected_physical(TABLE, p.idx[r], r), p.w[r], r)
        return got, ref

    for r, (got, ref) in enumerate(run_all(groups, rank)):
        for a, b in zip(got[0], ref[0]):
            assert torch.equal(a, b), f"rank {r}"
        assert torch.equal(got[1], expected_physical(TABLE, p.idx[r], r)) and ref[1] is None
        assert torch.equal(got[2], ref[2]) and int(got[2].sum()) == int(got[0][1].sum())
    run_all(groups, lambda g: eplb[g.rank].reset_expert_load())
    assert not eplb[0].expert_load().any()
