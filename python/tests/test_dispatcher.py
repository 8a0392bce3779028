"""epx.dispatcher.TokenDispatcher: a MoE layer through it (permute, per-expert weights, probs applied by
the experts, unpermute) against a dense float64 MoE of every rank's tokens (index_select / index_add),
forward and backward, at 1, 2 and 4 ranks on the CPU backend; the torch permute step against
reference.py's layout; dropping; the pre/post split; capacity calibration, its cross-rank agreement
and overflow; buffers shared by layers. GPU tests at the end (skipped without a GPU)."""

import contextlib
import math

import pytest
import torch

import epx
from epx.dispatcher import BufferPool, CapacityOverflow, DispatcherConfig, TokenDispatcher
from helpers import TIMEOUT_MS, Problem, run_all
from reference import expected_layout, kept_routing

H, E, K = 32, 8, 3


# --- the layer and its reference ------------------------------------------------------------------

def expert_weights(experts, hidden, seed=5):
    return torch.randn(experts, hidden, hidden, generator=torch.Generator().manual_seed(seed)) / hidden ** 0.5


def experts_forward(permuted, tokens_per_expert, permuted_probs, w_local):
    """Megatron's experts: each local expert's segment through its weight, times the permuted probs."""
    parts, start = [], 0
    for l, rows in enumerate(tokens_per_expert.tolist()):
        parts.append(permuted[start:start + rows].float() @ w_local[l])
        start += rows
    return torch.cat(parts) * permuted_probs.float().unsqueeze(1)


def layer(dispatcher, x, routing, w_local, compact):
    """One MoE layer through the dispatcher; routing = (routing_map, probs) or (indices, probs)."""
    if compact:
        permuted, counts, probs = dispatcher.token_permutation2(x, x.shape[0], routing[1], routing[0])
    else:
        permuted, counts, probs = dispatcher.token_permutation(x, routing[0], routing[1])
    return dispatcher.token_unpermutation(experts_forward(permuted, counts, probs, w_local).bfloat16())


def dense_reference(p, kept, expert_w, grad_outs):
    """out[t] = sum over kept slots of w[t,k] * x[t] @ W[e_k], in float64, with the grads of x and of w."""
    xs = [x.double().requires_grad_() for x in p.x]
    ws = [w.double().requires_grad_() for w in p.w]
    outs, loss = [], 0.0
    for r in range(p.ranks):
        out = torch.zeros(p.tokens[r], p.hidden, dtype=torch.float64)
        for k in range(p.topk):
            used = torch.nonzero(kept[r][:, k] >= 0).flatten()
            rows = torch.index_select(xs[r], 0, used)
            w_e = torch.index_select(expert_w.double(), 0, kept[r][used, k])
            y = torch.bmm(rows.unsqueeze(1), w_e).squeeze(1) * ws[r][used, k].unsqueeze(1)
            out = out.index_add(0, used, y)
        outs.append(out.detach())
        loss = loss + (out * grad_outs[r].double()).sum()
    loss.backward()
    return outs, [x.grad for x in xs], [w.grad for w in ws]


def close(got, want, what, rel=0.02):
    err = (got.double() - want).abs().max()
    assert err <= rel * want.abs().max() + 1e-9, f"{what}: max error {float(err):.3g}, scale {float(want.abs().max()):.3g}"


def slot_grads(grad_probs, idx):
    """The [T, E] grad of dense probs at each slot's expert -> [T, K] (0 for unused slots)."""
    safe = idx.clamp(min=0)
    return torch.where(idx >= 0, torch.gather(grad_probs, 1, safe), torch.zeros_like(grad_probs[:, :1]))


def config(**kw):
    kw.setdefault("timeout_ms", TIMEOUT_MS)
    return DispatcherConfig(num_experts=kw.pop("experts", E), topk=kw.pop("topk", K), **kw)


def local_range(g, experts):
    local = experts // g.size
    return range(g.rank * local, (g.rank + 1) * local)


def run_layer(p, cfg, compact, expert_w, grad_outs, dispatcher_of=None):
    """Every rank's layer forward and backward: (out, grad x, grad of probs as [T, K] slot grads)."""
    groups = epx.Group.host(p.ranks)
    local = p.experts // p.ranks

    def rank(g):
        r = g.rank
        d = dispatcher_of(g) if dispatcher_of else TokenDispatcher(g, local_range(g, p.experts), cfg)
        x = p.x[r].clone().requires_grad_()
        if compact:
            probs = p.w[r].clone().requires_grad_()
            routing = (p.idx[r], probs)
        else:
            routing_map, dense = p.dense(r)
            probs = dense.clone().requires_grad_()
            routing = (routing_map, probs)
        w_local = expert_w[r * local:(r + 1) * local]
        out = layer(d, x, routing, w_local, compact)
        (out.float() * grad_outs[r]).sum().backward()
        grad_w = probs.grad if compact else slot_grads(probs.grad, p.idx[r])
        return out.detach(), x.grad, grad_w

    return run_all(groups, rank)


def check_against_reference(p, runs, kept, expert_w, grad_outs):
    """Each rank's (out, grad x, grad probs) against the dense reference; a forward-only run is (out,)."""
    want_out, want_x, want_w = dense_reference(p, kept, expert_w, grad_outs)
    for r, run in enumerate(runs):
        assert run[0].dtype == torch.bfloat16
        close(run[0], want_out[r], f"rank {r} out")
        if len(run) == 1:
            continue
        gx, gw = run[1], run[2]
        assert gx.dtype == torch.bfloat16
        close(gx, want_x[r], f"rank {r} grad x")
        close(gw, torch.where(kept[r] >= 0, want_w[r], torch.zeros_like(want_w[r])), f"rank {r} grad probs")


def grads_for(p, seed=40):
    return [torch.randn(t, p.hidden, generator=torch.Generator().manual_seed(seed + r)) for r, t in enumerate(p.tokens)]


# --- forward and backward against the dense reference -----------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("compact", [False, True])
def test_layer_matches_dense_reference(ranks, fused, compact):
    p = Problem(ranks, H, E, K, [10, 7, 12, 9][:ranks], seed=11 + ranks, unused=0.1 if compact else 0.0)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    runs = run_layer(p, config(fused_permute=fused, pad_multiple=4), compact, expert_w, grad_outs)
    check_against_reference(p, runs, p.idx, expert_w, grad_outs)


@pytest.mark.parametrize("ranks", [1, 2])
def test_nemo_form_takes_the_token_count_and_dense_probs(ranks):
    """token_permutation(hidden_states, num_local_tokens, probs): the experts are probs' top-k (zero where a
    token has none), as Megatron's managers read dense probs."""
    p = Problem(ranks, H, E, K, [9, 6][:ranks], seed=21 + ranks)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    groups = epx.Group.host(ranks)
    local = E // ranks

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config())
        x = p.x[r].clone().requires_grad_()
        dense = p.dense(r)[1].clone().requires_grad_()
        permuted, counts, probs = d.token_permutation(x, x.shape[0], dense)
        out = d.token_unpermutation(experts_forward(permuted, counts, probs, expert_w[r * local:(r + 1) * local])
                                    .bfloat16())
        (out.float() * grad_outs[r]).sum().backward()
        return out.detach(), x.grad, slot_grads(dense.grad, p.idx[r])

    check_against_reference(p, run_all(groups, rank), p.idx, expert_w, grad_outs)


@pytest.mark.parametrize("compact", [False, True])
def test_wrong_num_local_tokens_fails_the_dispatch_on_every_rank(compact):
    """num_local_tokens other than the routing's token count, on one rank, in the dense (NeMo) form or the
    compact one: that rank's dispatch raises InvalidArgument, its peer's the same dispatch PeerFailed; the
    next dispatch (right counts) works and matches the reference."""
    p = Problem(2, H, E, K, [9, 6], seed=23)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    groups = epx.Group.host(2)
    local = E // 2

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config())

        def permutation(count):
            if compact:
                return d.token_permutation2(p.x[r], count, p.w[r], p.idx[r])
            return d.token_permutation(p.x[r], count, p.dense(r)[1])

        try:
            permutation(5 if r == 1 else p.tokens[r])
            error = None
        except epx.Error as e:
            error = e
        permuted, counts, probs = permutation(p.tokens[r])
        out = d.token_unpermutation(experts_forward(permuted, counts, probs, expert_w[r * local:(r + 1) * local])
                                    .bfloat16())
        return error, out

    runs = run_all(groups, rank)
    assert isinstance(runs[1][0], epx.InvalidArgument) and "num_local_tokens=5" in str(runs[1][0]), runs[1][0]
    assert isinstance(runs[0][0], epx.PeerFailed) and "num_local_tokens=5" in str(runs[0][0]), runs[0][0]
    check_against_reference(p, [(run[1],) for run in runs], p.idx, expert_w, grad_outs)


def test_one_dispatcher_serves_two_layers_forward_and_backward():
    """Two MoE layers through one TokenDispatcher (one shared per model), the gradients of both layers' probs
    and of x through the second and the first, against the dense reference composed."""
    p1 = Problem(2, H, E, K, [8, 6], seed=71)
    p2 = Problem(2, H, E, K, [8, 6], seed=72)
    w1, w2 = expert_weights(E, H, seed=5), expert_weights(E, H, seed=6)
    grad_outs = grads_for(p1)
    groups = epx.Group.host(2)
    local = E // 2

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config(num_sms=6))
        x = p1.x[r].clone().requires_grad_()
        probs1, probs2 = p1.w[r].clone().requires_grad_(), p2.w[r].clone().requires_grad_()
        h = layer(d, x, (p1.idx[r], probs1), w1[r * local:(r + 1) * local], compact=True)
        assert d.pool._blocking[H].config.num_sms == 6, "num_sms reaches the epx buffer"
        out = layer(d, h, (p2.idx[r], probs2), w2[r * local:(r + 1) * local], compact=True)
        (out.float() * grad_outs[r]).sum().backward()
        return out.detach(), x.grad, probs1.grad, probs2.grad

    runs = run_all(groups, rank)
    xs = [x.double().requires_grad_() for x in p1.x]
    ws1 = [w.double().requires_grad_() for w in p1.w]
    ws2 = [w.double().requires_grad_() for w in p2.w]

    def dense_layer(xr, idx, w, expert_w):
        out = torch.zeros_like(xr)
        for k in range(K):
            used = torch.nonzero(idx[:, k] >= 0).flatten()
            y = torch.bmm(xr[used].unsqueeze(1), expert_w.double()[idx[used, k]]).squeeze(1) * w[used, k:k + 1]
            out = out.index_add(0, used, y)
        return out

    for r, (out, gx, gp1, gp2) in enumerate(runs):
        want = dense_layer(dense_layer(xs[r], p1.idx[r], ws1[r], w1), p2.idx[r], ws2[r], w2)
        (want * grad_outs[r].double()).sum().backward()
        close(out, want.detach(), f"rank {r} out", rel=0.04)
        close(gx, xs[r].grad, f"rank {r} grad x", rel=0.04)
        close(gp1, ws1[r].grad, f"rank {r} grad probs, layer 1", rel=0.04)
        close(gp2, ws2[r].grad, f"rank {r} grad probs, layer 2", rel=0.04)


@pytest.mark.parametrize("static_capacity", [False, True])
def test_checkpointed_layer_replays_its_dispatch_and_matches_the_reference(static_capacity):
    """epx.torch.checkpoint around the layer: the recompute replays the recorded dispatch on the buffer that
    made it (with static_capacity the pool has made its capacity buffer by then) and measures nothing again."""
    p = Problem(2, H, E, K, [10, 7], seed=17)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    cfg = config(pad_multiple=4, static_capacity=static_capacity, calibration_dispatches=1, max_tokens_per_rank=12)
    groups = epx.Group.host(p.ranks)
    local = E // p.ranks

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), cfg)
        x, probs = p.x[r].clone().requires_grad_(), p.w[r].clone().requires_grad_()
        w_local = expert_w[r * local:(r + 1) * local]
        recorder = epx.LayoutRecorder()
        out = epx.torch.checkpoint(lambda x, probs: layer(d, x, (p.idx[r], probs), w_local, True), x, probs,
                                   recorder=recorder)
        (out.float() * grad_outs[r]).sum().backward()
        assert recorder.stats["replayed"] == 1 and recorder.stats["misses"] == 0
        return out.detach(), x.grad, probs.grad

    check_against_reference(p, run_all(groups, rank), p.idx, expert_w, grad_outs)


@pytest.mark.parametrize("ranks", [2, 4])
def test_capacity_factor_drops_as_epx_specifies(ranks):
    p = Problem(ranks, H, E, K, 12, seed=3, skew=True)
    kept = kept_routing(p.idx, E, K, 0.5)
    assert sum(int((k < 0).sum()) for k in kept) > 0, "the problem must drop something"
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    runs = run_layer(p, config(capacity_factor=0.5), True, expert_w, grad_outs)
    check_against_reference(p, runs, kept, expert_w, grad_outs)


def test_router_dtype_fp64_gives_fp64_probs_with_gradients():
    p = Problem(2, H, E, K, 8, seed=4)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    cfg = config(router_dtype="fp64")
    seen = []

    def dispatcher_of(g):
        d = TokenDispatcher(g, local_range(g, E), cfg)
        post = d.dispatch_postprocess

        def spy(*args):
            result = post(*args)
            seen.append(result[2].dtype)
            return result
        d.dispatch_postprocess = spy
        return d

    runs = run_layer(p, cfg, True, expert_w, grad_outs, dispatcher_of)
    assert seen == [torch.float64, torch.float64]
    check_against_reference(p, runs, p.idx, expert_w, grad_outs)


# --- the permuted rows themselves ---------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
def test_permuted_rows_follow_the_expert_major_layout(fused):
    """Rows, counts and probs of both permute paths equal reference.py's expert-major layout."""
    ranks, align = 2, 4
    p = Problem(ranks, H, E, K, [9, 6], seed=8, unused=0.2)
    groups = epx.Group.host(ranks)
    cfg = config(fused_permute=fused, pad_multiple=align)

    def rank(g):
        d = TokenDispatcher(g, local_range(g, E), cfg)
        permuted, counts, probs = d.token_permutation_topk(p.x[g.rank], p.idx[g.rank], p.w[g.rank])
        d.token_unpermutation(permuted)
        return permuted, counts, probs

    for r, (permuted, counts, probs) in enumerate(run_all(groups, rank)):
        lay = expected_layout(p.idx, ranks, E, r, align, True)
        want_x = torch.stack([p.x[s][t] if s >= 0 else torch.zeros(H, dtype=torch.bfloat16) for s, t in lay.src])
        want_p = torch.tensor([float(p.w[sl[0]][sl[1], sl[2]]) if sl else 0.0 for sl in lay.slots])
        assert torch.equal(permuted, want_x)
        assert torch.equal(probs, want_p)
        assert counts.tolist() == [b - a for a, b in zip(lay.expert_offsets, lay.expert_offsets[1:])]


# --- the pre/post split and async ---------------------------------------------------------------------

def test_split_steps_with_async_events_match_whole_calls():
    """The six steps called one by one, async_finish on (events are no-ops on the CPU), give the same
    results as token_permutation / token_unpermutation, forward and backward."""
    p = Problem(2, H, E, K, 9, seed=6)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)

    def split_dispatcher(g):
        d = TokenDispatcher(g, local_range(g, E), config(async_dispatch=True))

        def permutation(x, routing_map, probs):
            hidden, probs_f32 = d.dispatch_preprocess(x, routing_map, probs)
            assert probs_f32.dtype == torch.float32 and hidden.shape == (x.shape[0], H)
            hidden, recv_probs = d.dispatch_all_to_all(hidden, probs_f32, async_finish=True,
                                                       allocate_on_comm_stream=True)
            assert isinstance(d.dispatch_event, epx.EventOverlap)
            with d.dispatch_event:  # work here would overlap the dispatch
                pass
            return d.dispatch_postprocess(hidden, recv_probs)

        def unpermutation(y):
            hidden = d.combine_preprocess(y)
            out = d.combine_all_to_all(hidden, async_finish=True)
            d.combine_event.current_stream_wait()
            return d.combine_postprocess(out)

        d.token_permutation, d.token_unpermutation = permutation, unpermutation
        return d

    split = run_layer(p, None, False, expert_w, grad_outs, split_dispatcher)
    whole = run_layer(p, config(), False, expert_w, grad_outs)
    check_against_reference(p, split, p.idx, expert_w, grad_outs)  # not only equal to the whole calls: right
    assert len(split) == len(whole) == 2
    for r, (a, b) in enumerate(zip(split, whole)):
        assert len(a) == len(b) == 3
        for what, u, v in zip(("out", "grad x", "grad probs"), a, b):
            assert torch.equal(u, v), f"rank {r} {what}"


@pytest.mark.parametrize("compact", [False, True])
def test_dispatch_all_to_all_sends_the_probs_it_is_given(compact):
    """probs given to dispatch_all_to_all (here twice those preprocess returned) are the ones that travel:
    the layer equals the reference with doubled weights, and the gradient reaches the router's probs through
    them."""
    p = Problem(2, H, E, K, [9, 7], seed=26)
    doubled = Problem(2, H, E, K, [9, 7], seed=26)
    doubled.w = [w * 2 for w in p.w]
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    local = E // 2

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config())
        x = p.x[r].clone().requires_grad_()
        if compact:
            probs = p.w[r].clone().requires_grad_()
            hidden, stored = d.dispatch_preprocess2(x, None, probs, p.idx[r])
        else:
            routing_map, dense = p.dense(r)
            probs = dense.clone().requires_grad_()
            hidden, stored = d.dispatch_preprocess(x, routing_map, probs)
        hidden, recv_probs = d.dispatch_all_to_all(hidden, stored * 2)
        permuted, counts, permuted_probs = d.dispatch_postprocess(hidden, recv_probs)
        y = experts_forward(permuted, counts, permuted_probs, expert_w[r * local:(r + 1) * local]).bfloat16()
        out = d.token_unpermutation(y)
        (out.float() * grad_outs[r]).sum().backward()
        # d loss / d probs = 2 * d loss / d (the doubled weights), which the reference gives
        return out.detach(), x.grad, (probs.grad if compact else slot_grads(probs.grad, p.idx[r])) / 2

    check_against_reference(doubled, run_all(epx.Group.host(2), rank), p.idx, expert_w, grad_outs)


def test_probs_not_of_the_routing_fail_the_dispatch_on_every_rank():
    """probs of another shape than the routing's, on one rank: that rank's dispatch raises, its peer's fails
    with PeerFailed quoting it; the probs preprocess returned (or none) are accepted."""
    p = Problem(2, H, E, K, 8, seed=27)
    groups = epx.Group.host(2)

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config())
        hidden, stored = d.dispatch_preprocess2(p.x[r], None, p.w[r], p.idx[r])
        try:
            d.dispatch_all_to_all(hidden, stored[:, :1] if r == 1 else stored)
            error = None
        except epx.Error as e:
            error = e
        hidden, stored = d.dispatch_preprocess2(p.x[r], None, p.w[r], p.idx[r])
        received = d.dispatch_all_to_all(hidden, stored)
        d.dispatch_postprocess(*received)
        d.combine_postprocess(d.combine_all_to_all(d.combine_preprocess(received[0])))
        return error

    errors = run_all(groups, rank)
    assert isinstance(errors[1], epx.InvalidArgument) and "is not of the routing" in str(errors[1]), errors[1]
    assert isinstance(errors[0], epx.PeerFailed) and "is not of the routing" in str(errors[0]), errors[0]


@pytest.mark.parametrize("step", ["dispatch", "combine"])
def test_async_finish_without_async_dispatch_fails_every_rank(step):
    """async_dispatch=False runs every call on the current stream: async_finish=True cannot be honoured and is
    refused (one rank passing it fails the call on every rank); previous_event is accepted (the current stream
    waits for it; on the CPU there is none); the step then works without async_finish."""
    p = Problem(2, H, E, K, 8, seed=28)
    groups = epx.Group.host(2)

    def rank(g):
        r = g.rank
        d = TokenDispatcher(g, local_range(g, E), config(async_dispatch=False))
        asynchronous = dict(async_finish=True if r == 1 else None)
        hidden, stored = d.dispatch_preprocess2(p.x[r], None, p.w[r], p.idx[r])
        error = None
        try:
            received = d.dispatch_all_to_all(hidden, stored, **(asynchronous if step == "dispatch" else {}))
        except epx.Error as e:
            error = e
            hidden, stored = d.dispatch_preprocess2(p.x[r], None, p.w[r], p.idx[r])
            received = d.dispatch_all_to_all(hidden, stored, previous_event=epx.EventOverlap())
        permuted, _, _ = d.dispatch_postprocess(*received)
        y = d.combine_preprocess(permuted)
        try:
            out = d.combine_all_to_all(y, **(asynchronous if step == "combine" else {}))
        except epx.Error as e:
            error = e
            out = d.combine_all_to_all(y, previous_event=epx.EventOverlap())
        return error, d.combine_postprocess(out)

    runs = run_all(groups, rank)
    assert isinstance(runs[1][0], epx.InvalidArgument) and "async_dispatch=False" in str(runs[1][0]), runs[1][0]
    assert isinstance(runs[0][0], epx.PeerFailed) and "async_dispatch=False" in str(runs[0][0]), runs[0][0]
    for r, (_, out) in enumerate(runs):  # experts = identity: each token's rows summed over its kept slots
        used = (p.idx[r] >= 0).sum(dim=1, keepdim=True)
        assert torch.equal(out, (p.x[r].double() * used).bfloat16()), f"rank {r}"


def test_hidden_states_keep_their_shape_and_dtype():
    """[S, B, H] float32 in -> [S, B, H] float32 out (epx moves bf16 in between)."""
    groups = epx.Group.host(2)
    p = Problem(2, H, E, K, 12, seed=9)

    def rank(g):
        d = TokenDispatcher(g, local_range(g, E), config())
        x = p.x[g.rank].float().reshape(4, 3, H)
        permuted, counts, probs = d.token_permutation_topk(x, p.idx[g.rank], p.w[g.rank])
        return d.token_unpermutation(permuted * probs.unsqueeze(1))

    for out in run_all(groups, rank):
        assert out.shape == (4, 3, H) and out.dtype == torch.float32


# --- capacity mode: calibration, agreement, overflow ------------------------------------------------------

def expected_rows(p, align):
    """Rows each rank receives in the expert-major layout (reference.py)."""
    return [expected_layout(p.idx, p.ranks, p.experts, d, align, True).num_rows for d in range(p.ranks)]


def capacity_run(problems, cfg, check_between=None):
    """Every rank runs the layer once per problem on one dispatcher; per rank, per problem: (out, grad x,
    grad w, capacity rows of the buffer used, rows of permuted) or the exception raised."""
    ranks = problems[0].ranks
    groups = epx.Group.host(ranks)
    expert_w = expert_weights(E, H)

    def rank(g):
        d = TokenDispatcher(g, local_range(g, E), cfg)
        local = E // ranks
        w_local = expert_w[g.rank * local:(g.rank + 1) * local]
        results = []
        for i, p in enumerate(problems):
            x = p.x[g.rank].clone().requires_grad_()
            w = p.w[g.rank].clone().requires_grad_()
            try:
                permuted, counts, probs = d.token_permutation_topk(x, p.idx[g.rank], w)
            except CapacityOverflow as e:
                results.append(e)
                continue
            buffer = d._pending.buffer
            out = d.token_unpermutation(experts_forward(permuted, counts, probs, w_local).bfloat16())
            (out.float() * grads_for(p)[g.rank]).sum().backward()
            results.append((out.detach(), x.grad, w.grad, buffer.capacity_rows, permuted.shape[0], int(counts.sum())))
            if check_between is not None:
                check_between(d, i, results)
        return results

    return run_all(groups, rank), expert_w


def test_calibration_then_capacity_mode_matches_reference():
    headroom, align = 1.5, 4
    problems = [Problem(2, H, E, K, [10, 6], seed=20 + i) for i in range(3)]
    cfg = config(static_capacity=True, capacity_headroom=headroom, pad_multiple=align)
    runs, expert_w = capacity_run(problems, cfg)
    # calibrated on the first dispatch: the largest rows of any rank, times the headroom, rounded up
    largest = max(expected_rows(problems[0], align))
    capacity = math.ceil(largest * headroom)
    capacity = (capacity + align - 1) // align * align
    for r in range(2):
        assert runs[r][0][3] == 0, "the calibration dispatch runs in blocking mode"
        for i in (1, 2):
            assert runs[r][i][3] == capacity, "later dispatches: the agreed capacity"
            assert runs[r][i][4] == capacity and runs[r][i][5] == capacity, "static shapes, counts cover them"
    for i, p in enumerate(problems):
        want_out, want_x, want_w = dense_reference(p, p.idx, expert_w, grads_for(p))
        for r in range(2):
            out, gx, gw = runs[r][i][:3]
            close(out, want_out[r], f"dispatch {i} rank {r} out")
            close(gx, want_x[r], f"dispatch {i} rank {r} grad x")
            close(gw, want_w[r], f"dispatch {i} rank {r} grad w")


def test_capacity_is_the_max_over_ranks_and_calibration_spans_several_dispatches():
    """Ranks with very different loads agree on one capacity (BufferConfig must be identical); with
    calibration_dispatches=2 the capacity covers the larger of the two measured dispatches."""
    problems = [Problem(4, H, E, K, [2, 3, 1, 2], seed=30), Problem(4, H, E, K, [12, 3, 1, 9], seed=31),
                Problem(4, H, E, K, [12, 3, 1, 9], seed=32)]
    cfg = config(static_capacity=True, calibration_dispatches=2, capacity_headroom=1.0, max_tokens_per_rank=12)
    runs, _ = capacity_run(problems, cfg)
    largest = max(max(expected_rows(p, 1)) for p in problems[:2])
    assert [runs[r][2][3] for r in range(4)] == [largest] * 4
    assert [runs[r][1][3] for r in range(4)] == [0] * 4, "the second dispatch still calibrates"


def test_overflow_raises_on_every_rank_then_recalibrates():
    small = Problem(2, H, E, K, [2, 2], seed=40)
    big = Problem(2, H, E, K, [12, 12], seed=41)
    cfg = config(static_capacity=True, capacity_headroom=1.0, max_tokens_per_rank=12)
    runs, expert_w = capacity_run([small, big, big, big], cfg)
    needed = max(expected_rows(big, 1))
    for r in range(2):
        error = runs[r][1]
        assert isinstance(error, CapacityOverflow), f"rank {r}: {error!r}"
        assert error.capacity_rows == max(expected_rows(small, 1)) and error.rows_needed == needed
        assert runs[r][2][3] == 0, "the dispatch after an overflow recalibrates (blocking)"
        assert runs[r][3][3] >= needed, "then capacity mode with room for what was needed"
    want_out = dense_reference(big, big.idx, expert_w, grads_for(big))[0]
    for r in range(2):
        for i in (2, 3):
            close(runs[r][i][0], want_out[r], f"dispatch {i} rank {r} out")


def test_overflow_count_mode_is_read_with_check_overflow():
    small = Problem(2, H, E, K, [2, 2], seed=50)
    big = Problem(2, H, E, K, [12, 12], seed=51)
    cfg = config(static_capacity=True, capacity_headroom=1.0, on_overflow="count", max_tokens_per_rank=12)
    checks = {}

    def check_between(d, i, results):
        try:
            d.check_overflow()
            checks.setdefault(d.group.rank, []).append(None)
        except CapacityOverflow as e:
            checks.setdefault(d.group.rank, []).append(e.rows_needed)

    runs, _ = capacity_run([small, small, big, small], cfg, check_between)
    needed = max(expected_rows(big, 1))
    for r in range(2):
        assert all(not isinstance(x, Exception) for x in runs[r]), "count mode does not raise at the dispatch"
        assert checks[r] == [None, None, needed, None], "only the check after the overflowing dispatch raises"
        assert runs[r][3][3] == 0, "and the next dispatch recalibrates"


# --- buffers shared by layers, groups --------------------------------------------------------------------

def test_layers_share_one_pool_and_its_buffers():
    p1, p2 = Problem(2, H, E, K, 8, seed=60), Problem(2, H, E, K, 8, seed=61)
    expert_w = expert_weights(E, H)
    groups = epx.Group.host(2)
    cfg = config()

    def rank(g):
        pool = BufferPool(g, cfg)
        layers = [TokenDispatcher(g, local_range(g, E), cfg, pool=pool) for _ in range(2)]
        outs, buffers = [], []
        for d, p in zip(layers + layers, [p1, p2, p2, p1]):
            permuted, counts, probs = d.token_permutation_topk(p.x[g.rank], p.idx[g.rank], p.w[g.rank])
            buffers.append(d._pending.buffer)
            local = E // 2
            y = experts_forward(permuted, counts, probs, expert_w[g.rank * local:(g.rank + 1) * local])
            outs.append(d.token_unpermutation(y.bfloat16()))
        assert len({id(b) for b in buffers}) == 1, "one buffer for every layer of the same shape"
        return outs

    for r, outs in enumerate(run_all(groups, rank)):
        for p, out in zip([p1, p2, p2, p1], outs):
            close(out, dense_reference(p, p.idx, expert_w, grads_for(p))[0][r], f"rank {r}")


def test_local_expert_indices_must_be_epx_block():
    g = epx.Group.host(1)[0]
    with pytest.raises(epx.InvalidArgument, match="local_expert_indices"):
        TokenDispatcher(g, [1, 2, 3, 4, 5, 6, 7, 0], config())


def test_group_all_gather_and_agree_max():
    groups = epx.Group.host(3)

    def rank(g):
        return g.all_gather_object({"rank": g.rank}), g.agree_max(10 - 3 * g.rank), g.all_gather_bytes(b"r%d" % g.rank)

    for objs, largest, raw in run_all(groups, rank):
        assert objs == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert largest == 10
        assert raw == [b"r0", b"r1", b"r2"]
    with pytest.raises(epx.InvalidArgument, match="at most 1024 bytes"):
        epx.Group.host(1)[0].all_gather_bytes(b"x" * 3000)


# --- GPU (skipped without one) -------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (epx.has_cuda and epx.cuda_available()), reason="needs the CUDA backend and a GPU")
has_calling_thread_backward = hasattr(torch.autograd, "set_multithreading_enabled")  # torch >= 2.0


def on_calling_thread():
    """Autograd's backward on the calling thread (torch >= 2.0), not on the engine's one thread per device."""
    return torch.autograd.set_multithreading_enabled(False) if has_calling_thread_backward else contextlib.nullcontext()


def gpu_layer_rank(g, p, cfg, expert_w, grad_outs, backward, stream=None):
    """One rank's layer on the GPU (host copies out); closes the pool (collective on the shared GPU)."""
    device = g.device
    pool = BufferPool(g, cfg)
    local = E // g.size
    try:
        with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
            d = TokenDispatcher(g, local_range(g, E), cfg, pool=pool)
            x = p.x[g.rank].to(device).requires_grad_(backward)
            w = p.w[g.rank].to(device).requires_grad_(backward)
            permuted, counts, probs = d.token_permutation_topk(x, p.idx[g.rank].to(device), w)
            w_local = expert_w[g.rank * local:(g.rank + 1) * local].to(device)
            out = d.token_unpermutation(experts_forward(permuted, counts, probs, w_local).bfloat16())
            result = [out.detach().cpu()]
            if backward:
                with on_calling_thread():  # ranks that are threads of one process (docs/python.md)
                    (out.float() * grad_outs[g.rank].to(device)).sum().backward()
                result += [x.grad.cpu(), w.grad.cpu()]
            torch.cuda.current_stream().synchronize()
    finally:
        pool.close()
    return result


@needs_gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("async_dispatch", [False, True])
def test_gpu_ep1_forward_backward_matches_reference(ep1_group, fused, async_dispatch):
    p = Problem(1, 256, 8, 4, 32, seed=70)
    expert_w, grad_outs = expert_weights(8, 256), grads_for(p)
    cfg = config(experts=8, topk=4, fused_permute=fused, async_dispatch=async_dispatch, pad_multiple=16)
    out, gx, gw = gpu_layer_rank(ep1_group, p, cfg, expert_w, grad_outs, backward=True)
    want_out, want_x, want_w = dense_reference(p, p.idx, expert_w, grad_outs)
    close(out, want_out[0], "out")
    close(gx, want_x[0], "grad x")
    close(gw, want_w[0], "grad w")


@needs_gpu
def test_gpu_ep1_capacity_calibration(ep1_group):
    problems = [Problem(1, 256, 8, 4, 32, seed=80 + i) for i in range(3)]
    expert_w = expert_weights(8, 256)
    cfg = config(experts=8, topk=4, static_capacity=True, capacity_headroom=1.25)
    pool = BufferPool(ep1_group, cfg)
    try:
        d = TokenDispatcher(ep1_group, range(8), cfg, pool=pool)
        for p in problems:
            x, idx, w = (t.to("cuda") for t in (p.x[0], p.idx[0], p.w[0]))
            permuted, counts, probs = d.token_permutation_topk(x, idx, w)
            out = d.token_unpermutation(experts_forward(permuted, counts, probs, expert_w.to("cuda")).bfloat16())
            close(out.cpu(), dense_reference(p, p.idx, expert_w, grads_for(p))[0][0], "out")
        assert d.last_dispatch is None and pool._calibrations[256].buffer is not None
    finally:
        pool.close()


@needs_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("async_dispatch", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("backward", [False, True])
def test_gpu_shared_forward_matches_reference(ranks, async_dispatch, fused, backward):
    """Ranks that are threads on one GPU: backward runs each rank's on its own thread (docs/python.md)."""
    if backward and not has_calling_thread_backward:
        pytest.skip("backward of thread ranks on one GPU needs torch.autograd.set_multithreading_enabled")
    p = Problem(ranks, 256, 8, 4, 32, seed=90 + ranks)
    expert_w, grad_outs = expert_weights(8, 256), grads_for(p)
    cfg = config(experts=8, topk=4, async_dispatch=async_dispatch, fused_permute=fused, pad_multiple=8)
    groups = epx.Group.shared_gpu(ranks, 0)
    runs = run_all(groups, lambda g: gpu_layer_rank(g, p, cfg, expert_w, grad_outs, backward, torch.cuda.Stream(0)))
    check_against_reference(p, runs, p.idx, expert_w, grad_outs)


@needs_gpu
def test_gpu_previous_event_orders_the_call_without_async_dispatch(ep1_group):
    """async_dispatch=False: the dispatch runs on the current stream, which first waits for previous_event. The
    rows are written on another stream after a long sleep, then the event: a dispatch that did not wait would
    send the zeros that were there before."""
    p = Problem(1, 256, 8, 4, 32, seed=76)
    expert_w, grad_outs = expert_weights(8, 256), grads_for(p)
    cfg = config(experts=8, topk=4, async_dispatch=False, max_tokens_per_rank=32)
    pool = BufferPool(ep1_group, cfg)
    try:
        d = TokenDispatcher(ep1_group, range(8), cfg, pool=pool)
        source, idx, w = (t.to("cuda") for t in (p.x[0], p.idx[0], p.w[0]))
        x = torch.zeros_like(source)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # far longer than the dispatch's own launch and run
            x.copy_(source)
            written = torch.cuda.Event()
            written.record(side)
        hidden, probs = d.dispatch_preprocess2(x, None, w, idx)
        received = d.dispatch_all_to_all(hidden, probs, previous_event=epx.EventOverlap(written))
        permuted, counts, permuted_probs = d.dispatch_postprocess(*received)
        out = d.token_unpermutation(experts_forward(permuted, counts, permuted_probs, expert_w.to("cuda")).bfloat16())
        close(out.cpu(), dense_reference(p, p.idx, expert_w, grad_outs)[0][0], "out")
    finally:
        pool.close()
