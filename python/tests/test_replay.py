"""Layout replay for activation recompute (epx.LayoutRecorder, epx.torch.checkpoint)."""

import warnings

import torch

import epx
from helpers import Problem, make_buffers, run_all, run_ranks

P = Problem(2, 64, 4, 2, 8, seed=13)


def layer(buffer, x, idx, w):
    d = epx.torch.dispatch(buffer, x, idx, w)
    return epx.torch.combine(buffer, (d.recv_x.float() * 2).bfloat16(), d.handle)


def test_recompute_replays_the_recorded_routing_and_layout():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2, expert_alignment=2)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        calls = [0]

        def routed_layer(x, w):
            # A router that picks differently when recomputed: the recorder must serve the first pick.
            idx = P.idx[r] if calls[0] == 0 else P.idx[r].flip(1)
            calls[0] += 1
            return layer(b, x, idx, w)

        x = P.x[r].clone().requires_grad_()
        w = P.w[r].clone().requires_grad_()
        recorder = epx.LayoutRecorder()
        out = epx.torch.checkpoint(routed_layer, x, w, recorder=recorder)
        out.float().sum().backward()
        x_ref = P.x[r].clone().requires_grad_()
        w_ref = P.w[r].clone().requires_grad_()
        layer(b, x_ref, P.idx[r], w_ref).float().sum().backward()
        return recorder.stats, (x.grad, w.grad), (x_ref.grad, w_ref.grad), calls[0]

    for stats, got, want, calls in run_all(groups, rank):
        assert calls == 2
        assert stats == {"recorded": 1, "replayed": 1, "misses": 0, "routing_changes": 1}
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_record_rewind_take_and_misses():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        rec = epx.LayoutRecorder()
        with rec.recording():
            first = epx.torch.dispatch(b, P.x[r], P.idx[r], P.w[r])
        with rec.replaying():
            again = epx.torch.dispatch(b, P.x[r], P.idx[r], P.w[r])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                epx.torch.dispatch(b, P.x[r], P.idx[r], P.w[r])  # nothing left to replay: a miss
        rec.rewind()
        entry = rec.take()
        return rec.stats, first, again, [str(w.message) for w in caught], entry, rec.take()

    for stats, first, again, caught, entry, after in run_all(groups, rank):
        assert stats["replayed"] == 1 and stats["misses"] == 1 and stats["routing_changes"] == 0
        assert torch.equal(first.recv_src, again.recv_src) and first.num_rows == again.num_rows
        assert caught and "has no record" in caught[0]
        assert entry is not None and after is None


def test_shape_change_fails_every_rank_with_a_clear_error():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)
    recorders = [epx.LayoutRecorder(), epx.LayoutRecorder()]

    def rank(g):
        b, r, rec = buffers[g.rank], g.rank, recorders[g.rank]
        with rec.recording():
            epx.torch.dispatch(b, P.x[r], P.idx[r], P.w[r])
        n = 5 if r == 1 else 8  # rank 1's recompute has fewer tokens
        with rec.replaying():
            epx.torch.dispatch(b, P.x[r][:n], P.idx[r][:n], P.w[r][:n])

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.ReplayError) and "another shape than the recorded one" in str(errors[1])
    assert "(8, 64)" in str(errors[1]) and "(5, 64)" in str(errors[1])
    assert isinstance(errors[0], epx.PeerFailed) and "another shape" in str(errors[0])
