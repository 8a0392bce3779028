"""Errors: epx.Error subclasses with the C++ code and message; a tensor refused by the Python
layer (dtype, device, dimensions, layout) or by epx (shape) names it, before anything runs, and
fails the same call on every rank at once (not after the timeout); the buffer stays usable."""

import time

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, make_buffers, run_all, run_ranks

P = Problem(3, 64, 6, 2, 8, seed=1)
P4 = Problem(2, 64, 4, 2, 8, seed=2)  # for two ranks of four experts


def buffers_of(ranks=3, **kwargs):
    groups = epx.Group.host(ranks)
    args = dict(hidden=64, max_tokens_per_rank=8, num_experts=6, topk=2)
    args.update(kwargs)
    return groups, make_buffers(groups, **args)


def dispatch_with_bad_rank(bad, change):
    """Every rank dispatches; rank `bad` passes change(x, idx, w). Returns (errors, seconds, buffers, groups)."""
    groups, buffers = buffers_of()

    def rank(g):
        x, idx, w = P.x[g.rank], P.idx[g.rank], P.w[g.rank]
        if g.rank == bad:
            x, idx, w = change(x, idx, w)
        return buffers[g.rank].dispatch(x, idx, w)

    start = time.monotonic()
    _, errors = run_ranks(groups, rank)
    return errors, time.monotonic() - start, buffers, groups


BAD_INPUTS = {
    "dtype": (lambda x, i, w: (x.float(), i, w), "dispatch: x: expected dtype bfloat16"),
    "index_dtype": (lambda x, i, w: (x, i.to(torch.int16), w), "dispatch: topk_idx: expected dtype int32 or int64"),
    "device": (lambda x, i, w: (x.to("meta"), i, w), "dispatch: x: is on meta"),
    "not_contiguous": (lambda x, i, w: (x, i.t().contiguous().t(), w), "dispatch: topk_idx: must be contiguous"),
    "transposed_3d": (lambda x, i, w: (x.reshape(8, 8, 8).transpose(1, 2), i, w), "dispatch: x: must be contiguous"),
    "dimensions": (lambda x, i, w: (x.reshape(1, 1, 1, 1, 8, 64), i, w), "dispatch: x: must have 1 to 4 dimensions"),
    "not_a_tensor": (lambda x, i, w: (x.tolist(), i, w), "dispatch: x: expected a torch.Tensor, got list"),
    "shape": (lambda x, i, w: (torch.zeros(8, 65, dtype=torch.bfloat16), i, w), "dispatch: x: expected shape"),
    "weights_shape": (lambda x, i, w: (x, i, w[:, :1]), "dispatch: topk_weights"),
    "expert_id": (lambda x, i, w: (x, torch.full_like(i, 99), w), "99"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_refused_input_names_it_and_fails_every_rank_fast(name):
    change, message = BAD_INPUTS[name]
    errors, seconds, buffers, groups = dispatch_with_bad_rank(1, change)
    assert isinstance(errors[1], epx.InvalidArgument) and isinstance(errors[1], ValueError), errors[1]
    assert errors[1].code == epx.ErrorCode.invalid_argument
    assert message in str(errors[1]), str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], epx.PeerFailed), errors[r]
        assert errors[r].code == epx.ErrorCode.peer_failed
        assert "rank 1" in str(errors[r]) and message in str(errors[r]), str(errors[r])
    assert seconds < TIMEOUT_MS / 1000 / 4, f"took {seconds:.1f} s: the peers waited instead of failing"
    # The buffer stays usable: the next dispatch pairs up and succeeds on every rank.
    run_all(groups, lambda g: buffers[g.rank].dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank]))


def test_bad_combine_input_fails_every_rank_and_the_handle_stays_usable():
    groups, buffers = buffers_of()

    def rank(g):
        b = buffers[g.rank]
        d = b.dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank])
        y = d.recv_x.float() if g.rank == 2 else d.recv_x
        try:
            b.combine(y, d.handle)
        except epx.Error as e:
            first = e
        return first, b.combine(d.recv_x, d.handle).out.shape

    results = run_all(groups, rank)
    assert isinstance(results[2][0], epx.InvalidArgument) and "combine: y: expected dtype bfloat16" in str(results[2][0])
    assert all(isinstance(r[0], epx.PeerFailed) for r in results[:2])
    assert all(r[1] == (8, 64) for r in results)


def test_foreign_and_vanished_handles_are_refused_on_every_rank():
    groups, buffers = buffers_of()
    _, others = buffers_of()  # a second set of buffers on another world

    def rank(g):
        b = buffers[g.rank]
        d = b.dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank])
        errors = []
        for handle in (d.handle._replace(buffer_id=others[g.rank].id) if g.rank == 0 else d.handle,
                       d.handle._replace(token=torch.tensor([10 ** 9, 0, 0, 0])) if g.rank == 1 else d.handle,
                       "not a handle" if g.rank == 2 else d.handle):
            try:
                b.combine(d.recv_x, handle)
                errors.append(None)
            except epx.Error as e:
                errors.append(e)
        return errors

    results = run_all(groups, rank)
    assert "made by another buffer" in str(results[0][0])
    assert "its handle is gone" in str(results[1][1])
    assert "expected the Handle a dispatch of this buffer returned, got str" in str(results[2][2])
    for call in range(3):
        for r in range(3):
            assert isinstance(results[r][call], epx.PeerFailed if r != call else epx.InvalidArgument)


def test_config_mismatch_and_unknown_names():
    groups = epx.Group.host(2)

    def differing(g):
        return epx.Buffer(g, hidden=64 * (1 + g.rank), max_tokens_per_rank=8, num_experts=4, topk=2,
                          timeout_ms=TIMEOUT_MS)

    _, errors = run_ranks(groups, differing)
    assert all(isinstance(e, epx.ConfigMismatch) and e.code == epx.ErrorCode.config_mismatch for e in errors)

    def unknown_wire(g):
        return epx.Buffer(g, hidden=128, max_tokens_per_rank=8, num_experts=4, topk=2,
                          wire="fp9" if g.rank == 1 else "fp8", timeout_ms=TIMEOUT_MS)

    _, errors = run_ranks(groups, unknown_wire)
    assert isinstance(errors[1], epx.InvalidArgument) and "wire: unknown 'fp9'; use one of bf16, fp8" in str(errors[1])
    assert isinstance(errors[0], epx.PeerFailed)
    # The group stays usable.
    make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)


def test_unknown_layout_is_refused_on_every_rank():
    groups, buffers = buffers_of(ranks=2, num_experts=4)
    _, errors = run_ranks(groups, lambda g: buffers[g.rank].dispatch(
        P4.x[g.rank], P4.idx[g.rank], P4.w[g.rank], layout="token_major" if g.rank == 0 else "expert_major"))
    assert isinstance(errors[0], epx.InvalidArgument) and "layout: unknown 'token_major'" in str(errors[0])
    assert isinstance(errors[1], epx.PeerFailed)


def test_a_rank_that_never_arrives_times_out():
    groups, buffers = buffers_of(ranks=2, num_experts=4, timeout_ms=300)

    def rank(g):
        if g.rank == 0:
            return buffers[0].dispatch(P4.x[0], P4.idx[0], P4.w[0])
        return None

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[0], epx.Timeout) and errors[0].code == epx.ErrorCode.timeout
    assert "rank(s) 1" in str(errors[0])


def test_reject_from_python_joins_the_call():
    groups, buffers = buffers_of(ranks=2, num_experts=4)

    def rank(g):
        if g.rank == 0:
            buffers[0].reject("dispatch", "my framework refused this batch")
        return buffers[1].dispatch(P4.x[1], P4.idx[1], P4.w[1])

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[0], epx.InvalidArgument) and str(errors[0]).endswith("my framework refused this batch")
    assert isinstance(errors[1], epx.PeerFailed) and "my framework refused this batch" in str(errors[1])
