"""The adapters given a torch.distributed process group, as the stacks give them one (docs/integrations.md):
epx.deep_ep.Buffer, TokenDispatcher and the Megatron EpxManager over a gloo group of one rank, against the
same references as their epx.Group tests. Without CUDA (a build without it, or a torch that sees no GPU), Group.from_torch makes a group of one rank
the CPU backend's single rank; with CUDA it is the NCCL group (one GPU)."""

import pytest
import torch

import epx
import epx.deep_ep as deep_ep
from epx.dispatcher import DispatcherConfig, TokenDispatcher
from helpers import TIMEOUT_MS, Problem, assert_close_sum, random_bf16
from test_deep_ep import M, RefDispatch, check_ll_dispatch, ll_expected_combine, nvl_bytes, \
    problem, ref_combine
from test_dispatcher import check_against_reference, expert_weights, experts_forward, grads_for, layer, slot_grads
from test_megatron import megatron_config, megatron_layer, megatron_module  # noqa: F401 (a fixture)

E = 8


def on_device(group, *tensors):
    """Copies on the group's device (never the problem's own tensors, which the references read)."""
    return [t.to(group.device, copy=True) for t in tensors]


def test_from_torch_takes_a_group_of_one_rank(torch_world):
    g = epx.Group.from_torch(torch_world)
    assert (g.rank, g.size) == (0, 1)
    assert g.backend == ("cuda" if epx.has_cuda and torch.cuda.is_available() else "host")
    assert g.all_gather_object("only") == ["only"]


def test_deep_ep_buffer_over_a_process_group(torch_world):
    """High-throughput dispatch / combine and the low-latency pair, as vLLM builds its Buffer (group=...)."""
    p = problem(1, seed=500, tokens=M, hidden=512)
    b = deep_ep.Buffer(group=torch_world, num_nvl_bytes=nvl_bytes(1, 512),
                       num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, 512, 1, E),
                       low_latency_mode=True, explicitly_destroy=True, epx_timeout_ms=TIMEOUT_MS)
    try:
        assert b.group is torch_world and (b.rank, b.group_size) == (0, 1)
        eg = b.epx_group
        x, idx, w = on_device(eg, p.x[0], p.idx[0], p.w[0])
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, E)
        recv_x, _, _, counts, handle, _ = b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        ref = RefDispatch(p, 0)
        assert torch.equal(recv_x.cpu(), ref.x) and counts == ref.counts
        y = random_bf16(recv_x.shape, 501).to(eg.device)
        combined, _, _ = b.combine(y, handle)
        want, scale = ref_combine([ref], [y.cpu()], 0, p)
        assert_close_sum(combined.cpu(), want, scale, "combined")
        recv, count, ll_handle, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        host_handle = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in ll_handle)
        check_ll_dispatch(p, 0, recv.cpu(), count.cpu(), host_handle, "bf16")
        ll_y = random_bf16(recv.shape, 502).to(eg.device)
        ll_out, _, _ = b.low_latency_combine(ll_y, idx, w, ll_handle)
        want, scale = ll_expected_combine(p, [host_handle], [ll_y.cpu()], 0, p.w[0])
        assert_close_sum(ll_out.cpu(), want, scale, "low-latency combined")
    finally:
        b.destroy()


@pytest.mark.parametrize("compact", [False, True])
def test_token_dispatcher_over_a_process_group(torch_world, compact):
    p = Problem(1, 32, E, 3, 10, seed=510)
    expert_w, grad_outs = expert_weights(E, 32), grads_for(p)
    cfg = DispatcherConfig(num_experts=E, topk=3, pad_multiple=4, timeout_ms=TIMEOUT_MS)
    d = TokenDispatcher(torch_world, range(E), cfg)
    try:
        dev = d.group.device
        (x,) = on_device(d.group, p.x[0])
        x.requires_grad_()
        if compact:
            probs, topk_idx = on_device(d.group, p.w[0], p.idx[0])
            routing = (topk_idx, probs.requires_grad_())
        else:
            routing_map, dense = on_device(d.group, *p.dense(0))
            probs = dense.requires_grad_()
            routing = (routing_map, probs)
        out = layer(d, x, routing, expert_w.to(dev), compact)
        (out.float() * grad_outs[0].to(dev)).sum().backward()
        grad_w = probs.grad.cpu() if compact else slot_grads(probs.grad.cpu(), p.idx[0])
        check_against_reference(p, [(out.detach().cpu(), x.grad.cpu(), grad_w)], p.idx, expert_w, grad_outs)
    finally:
        d.pool.close()


def test_megatron_manager_over_a_process_group(torch_world, megatron_module):  # noqa: F811
    """Megatron builds its managers with group=<the TPxEP process group>: every layer's manager of that group
    shares one pool, and the layer matches the reference, forward and backward."""
    p = Problem(1, 32, E, 2, 10, seed=520)
    expert_w, grad_outs = expert_weights(E, 32), grads_for(p)
    config = megatron_config(moe_flex_dispatcher_backend="deepep")
    layers = [megatron_module.MoEFlexTokenDispatcher(E, list(range(E)), config, torch_world) for _ in range(2)]
    managers = [dispatcher._comm_manager for dispatcher in layers]
    assert managers[0].group is torch_world
    assert managers[0].dispatcher.pool is managers[1].dispatcher.pool, "one pool per process group"
    pool = managers[0].dispatcher.pool
    try:
        dev = pool.device
        (x,) = on_device(pool.group, p.x[0])
        x.requires_grad_()
        routing_map, dense = on_device(pool.group, *p.dense(0))
        probs = dense.requires_grad_()
        out, _, _ = megatron_layer(layers[1], x, routing_map, probs, expert_w.to(dev))
        (out.float() * grad_outs[0].to(dev)).sum().backward()
        check_against_reference(p, [(out.detach().cpu(), x.grad.cpu(), slot_grads(probs.grad.cpu(), p.idx[0]))],
                                p.idx, expert_w, grad_outs)
    finally:
        pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the CUDA group is made")
def test_from_torch_without_cuda_refuses_a_cuda_device(torch_world):
    with pytest.raises(epx.Unsupported, match="device cuda:0 asks for the CUDA backend"):
        epx.Group.from_torch(torch_world, device="cuda:0")
