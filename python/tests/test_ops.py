"""torch.library registration: torch.ops.epx.* run the calls (every torch), their fake / meta
kernels give the outputs' shapes, and (torch >= 2.1) a compiled MoE layer calls them without graph
breaks, forward and backward."""

import pytest
import torch

import epx
import epx.ops as ops
from helpers import Problem, make_buffers, run_all

P = Problem(2, 64, 4, 2, 8, seed=17)


def test_ops_run_the_calls():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        outs = torch.ops.epx.dispatch(b.id, P.x[r], None, P.idx[r], P.w[r], None, None, 0, 0.0)
        token, recv_x = outs[0], outs[1]
        y = torch.ops.epx.combine(b.id, recv_x, token, None, True, 8)
        gx, gw, gs = torch.ops.epx.dispatch_backward(b.id, recv_x, None, token, 8)
        gy, gtw, gys = torch.ops.epx.combine_backward(b.id, y, recv_x, token, True, recv_x.shape[0])
        assert gs.numel() == 0 and gys.numel() == 0  # no shared expert: no gate gradient
        ref = b.dispatch(P.x[r], P.idx[r], P.w[r])
        return outs, ref, y, gx, gw, gy, gtw

    for outs, ref, y, gx, gw, gy, gtw in run_all(groups, rank):
        # the token, DISPATCH_TENSORS, then topk_physical (empty without EPLB)
        assert len(outs) == 13 and outs[0].dtype == torch.int64 and outs[0].shape == (4,)
        assert outs[12].numel() == 0
        assert torch.equal(outs[1], ref.recv_x) and torch.equal(outs[4], ref.recv_src)
        assert outs[6].numel() == 0 and outs[7].numel() == 0  # rank-major outputs: absent
        assert y.shape == (8, 64) and gx.shape == (8, 64) and gw.numel() == 0
        assert gy.shape == ref.recv_x.shape and gtw.shape == (8, 2)


def fake_inputs(shape, dtype):
    """Inputs without data: fake tensors where torch has them for custom ops, else meta tensors."""
    return torch.empty(shape, dtype=dtype, device="meta")


def run_fake(fn):
    if hasattr(torch.library, "register_fake") or hasattr(torch.library, "impl_abstract"):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return fn(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    with torch.no_grad():
        return fn(fake_inputs)


@pytest.mark.parametrize("wire,layout", [("bf16", 0), ("fp8", 0), ("nvfp4", 1)])
def test_fake_kernels_give_capacity_mode_shapes(wire, layout):
    (group,) = epx.Group.host(1)
    b = epx.Buffer(group, hidden=128, max_tokens_per_rank=8, num_experts=4, topk=2, wire=wire, capacity_rows=24)

    def call(make):
        x, idx = make((8, 128), torch.bfloat16), make((8, 2), torch.int64)
        w = make((8, 2), torch.float32)
        outs = torch.ops.epx.dispatch(b.id, x, None, idx, w, None, None, layout, 0.0)
        y = torch.ops.epx.combine(b.id, make((24, 128), torch.bfloat16), outs[0], None, layout == 0, 8)
        ll = torch.ops.epx.dispatch_backward(b.id, make((24, 128), torch.bfloat16), None, outs[0], 8)
        return [tuple(t.shape) for t in outs], [t.dtype for t in outs], tuple(y.shape), tuple(ll[0].shape)

    shapes, dtypes, combined, grad_x = run_fake(call)
    want = ops.dispatch_outputs(b, layout, 24)
    assert shapes[0] == (4,)
    for got, got_dtype, spec in zip(shapes[1:], dtypes[1:], want):
        if spec is None:
            assert got == (0,)
        else:
            assert got == spec[0] and got_dtype == spec[1]
    assert combined == (8, 128) and grad_x == (8, 128)


def test_ll_fake_kernel_shapes():
    (group,) = epx.Group.host(1)
    b = epx.LowLatencyBuffer(group, 128, 8, 4, 2, wire="fp8")

    def call(make):
        outs = torch.ops.epx.ll_dispatch(b.id, make((8, 128), torch.bfloat16), make((8, 2), torch.int64), None,
                                         None, 0.0)
        out = torch.ops.epx.ll_combine(b.id, make((4, 8, 128), torch.bfloat16), outs[0], None, False, 8)
        return [tuple(t.shape) for t in outs], tuple(out.shape)

    shapes, combined = run_fake(call)
    assert shapes[1:] == [(4, 8, 128), (4, 8, 1), (0,), (4,), (4, 8, 2), (4, 1, 2), (0,)]  # no EPLB: no topk_physical
    assert combined == (8, 128)


needs_compile = pytest.mark.skipif(not hasattr(torch, "compile") or not hasattr(torch.library, "impl_abstract")
                                   and not hasattr(torch.library, "register_fake"),
                                   reason="torch.compile with custom-op fake kernels needs torch >= 2.1")


class TinyMoE(torch.nn.Module):
    """Router, top-k, dispatch, one linear expert per local expert, combine (capacity mode: static shapes)."""

    def __init__(self, buffer, hidden, experts, topk):
        super().__init__()
        self.buffer, self.topk = buffer, topk
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(buffer.num_local_experts, hidden, hidden) / hidden ** 0.5)

    def forward(self, x):
        weights, idx = torch.topk(torch.softmax(self.router(x.float()), dim=-1), self.topk)
        d = epx.torch.dispatch(self.buffer, x, idx, weights)
        # Grouped GEMM stand-in with static shapes: every row through every local expert, masked by segment.
        rows = torch.arange(d.recv_x.shape[0], device=x.device)
        seg = (rows[:, None] >= d.expert_offsets[None, 1:]).sum(dim=1).clamp(max=self.experts.shape[0] - 1)
        y = torch.einsum("nh,nhk->nk", d.recv_x.float(), self.experts[seg])
        return epx.torch.combine(self.buffer, y.bfloat16(), d.handle)


@needs_compile
def test_compiled_moe_layer_has_no_graph_breaks():
    (group,) = epx.Group.host(1)
    b = epx.Buffer(group, hidden=64, max_tokens_per_rank=16, num_experts=4, topk=2, capacity_rows=64)
    torch.manual_seed(0)
    layer = TinyMoE(b, 64, 4, 2)
    x = torch.randn(16, 64).bfloat16().requires_grad_()
    want = layer(x)
    want.float().sum().backward()
    want_grad, x.grad = x.grad, None
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    got.float().sum().backward()
    assert torch.equal(got, want) and torch.equal(x.grad, want_grad)
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_break_count == 0, explain.break_reasons


def test_ll_ops_match_the_buffer_calls():
    groups = epx.Group.host(2)
    buffers = run_all(groups, lambda g: epx.LowLatencyBuffer(g, 64, 8, 4, 2, timeout_ms=20000))

    def rank(g):
        b, r = buffers[g.rank], g.rank
        d = epx.torch.ll_dispatch(b, P.x[r], P.idx[r], topk_weights=P.w[r])
        out = epx.torch.ll_combine(b, d.recv_x, d.handle)
        ref = b.dispatch(P.x[r], P.idx[r], topk_weights=P.w[r], clone=True)
        return d, out.clone(), ref, b.combine(ref.recv_x, ref.handle)

    for d, out, ref, ref_out in run_all(groups, rank):
        assert d.recv_scales is None and torch.equal(d.recv_count, ref.recv_count)
        assert torch.equal(d.recv_src, ref.recv_src) and torch.equal(out, ref_out)
