"""epx.megatron: the manager with Megatron's flex-dispatcher contract, driven the way Megatron's
MoEFlexTokenDispatcher drives its managers (a stand-in written from that contract: the calls, their
order and arguments), installed with epx.megatron.install() into a module laid out like Megatron's
token_dispatcher module; forward and backward against the dense float64 MoE of test_dispatcher.py,
at 1, 2 and 4 ranks on the CPU backend. GPU tests at the end (skipped without a GPU)."""

import types

import pytest
import torch

import epx
import epx.megatron
from epx.megatron import EpxManager
from helpers import Problem, TIMEOUT_MS, run_all
from reference import expected_layout
from test_dispatcher import (check_against_reference, close, dense_reference, expert_weights, experts_forward,
                             grads_for, has_calling_thread_backward, on_calling_thread, slot_grads)

H, E, K = 32, 8, 2


def megatron_config(**kw):
    """The TransformerConfig fields the managers read (by name, as Megatron's config has them)."""
    fields = dict(num_moe_experts=E, moe_router_topk=K, moe_router_dtype="fp32", moe_permute_fusion=True,
                  fp8=None, fp4=None, moe_hybridep_num_sms=None, moe_deepep_num_sms=None,
                  moe_epx_options={"timeout_ms": TIMEOUT_MS})
    fields.update(kw)
    return types.SimpleNamespace(**fields)


class _Missing:
    """Megatron's manager when its library is absent: it refuses to be built."""

    def __init__(self, *args, **kwargs):
        raise ImportError("DeepEP is not installed")


class FlexDispatcherStandIn:
    """The calls Megatron's flex dispatcher makes on its manager, in its order (TP = 1 here): the manager
    class is looked up in the module's globals at construction, as Megatron does."""

    module = None  # the token_dispatcher-like module the test builds

    def __init__(self, num_local_experts, local_expert_indices, config, group):
        self.num_local_experts, self.config = num_local_experts, config
        self.ep_size = group.size() if callable(group.size) else group.size  # a torch ProcessGroup, or an epx.Group
        if config.moe_flex_dispatcher_backend == "deepep":
            self._comm_manager = self.module._DeepepManager(
                group=group, num_local_experts=num_local_experts, router_topk=config.moe_router_topk,
                num_experts=config.num_moe_experts, config=config)
        else:
            self._comm_manager = self.module._HybridEPManager(
                group=group, num_local_experts=num_local_experts, num_experts=config.num_moe_experts, config=config)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        tokens = routing_map.shape[0]  # [T, E] -> [T, world, L], as the flex dispatcher lays it out
        routing_map = routing_map.reshape(tokens, self.ep_size, self.num_local_experts).contiguous()
        probs = probs.reshape(tokens, self.ep_size, self.num_local_experts).contiguous()
        self._comm_manager.setup_metadata(routing_map, probs)
        return hidden_states, self._comm_manager.token_probs

    def token_dispatch(self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True):
        return (self._comm_manager.dispatch(hidden_states, async_finish, allocate_on_comm_stream),
                self._comm_manager.dispatched_probs)

    def dispatch_postprocess(self, hidden_states, probs):
        hidden, permuted_probs = self._comm_manager.get_permuted_hidden_states_by_experts(hidden_states)
        return hidden, self._comm_manager.get_number_of_tokens_per_expert(), permuted_probs

    def combine_preprocess(self, hidden_states):
        return self._comm_manager.get_restored_hidden_states_by_experts(hidden_states)

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        return self._comm_manager.combine(hidden_states, async_finish, allocate_on_comm_stream)

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


@pytest.fixture
def megatron_module():
    """A module laid out like megatron.core.transformer.moe.token_dispatcher, epx installed into it."""
    module = types.ModuleType("token_dispatcher")
    module._DeepepManager, module._HybridEPManager = _Missing, _Missing
    module.MoEFlexTokenDispatcher = type("MoEFlexTokenDispatcher", (FlexDispatcherStandIn,), {"module": module})
    replaced = epx.megatron.install(module)
    yield module
    epx.megatron.uninstall(replaced, module)
    epx.megatron.reset_pools()


def megatron_layer(dispatcher, x, routing_map, probs, w_local):
    hidden, token_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    assert token_probs.dtype == torch.float32
    hidden, dispatched_probs = dispatcher.token_dispatch(hidden, token_probs)
    permuted, counts, permuted_probs = dispatcher.dispatch_postprocess(hidden, dispatched_probs)
    y = experts_forward(permuted, counts, permuted_probs, w_local).bfloat16()
    hidden = dispatcher.combine_preprocess(y)
    return dispatcher.combine_postprocess(dispatcher.token_combine(hidden)), counts, permuted_probs


def run_megatron(module, p, config, expert_w, grad_outs):
    groups = epx.Group.host(p.ranks)
    local = E // p.ranks

    def rank(g):
        r = g.rank
        dispatcher = module.MoEFlexTokenDispatcher(local, list(range(r * local, (r + 1) * local)), config, g)
        assert isinstance(dispatcher._comm_manager, EpxManager)
        x = p.x[r].clone().requires_grad_()
        routing_map, dense = p.dense(r)
        probs = dense.clone().requires_grad_()
        out, counts, permuted_probs = megatron_layer(dispatcher, x, routing_map, probs,
                                                     expert_w[r * local:(r + 1) * local])
        (out.float() * grad_outs[r]).sum().backward()
        return out.detach(), x.grad, slot_grads(probs.grad, p.idx[r]), counts, permuted_probs.dtype

    return run_all(groups, rank)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
@pytest.mark.parametrize("permute_fusion", [True, False])
def test_installed_manager_matches_dense_reference(megatron_module, ranks, backend, permute_fusion):
    p = Problem(ranks, H, E, K, [10, 7, 12, 9][:ranks], seed=100 + ranks)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    config = megatron_config(moe_flex_dispatcher_backend=backend, moe_permute_fusion=permute_fusion)
    runs = run_megatron(megatron_module, p, config, expert_w, grad_outs)
    want_out, want_x, want_w = dense_reference(p, p.idx, expert_w, grad_outs)
    for r, (out, gx, gw, counts, probs_dtype) in enumerate(runs):
        close(out, want_out[r], f"rank {r} out")
        close(gx, want_x[r], f"rank {r} grad x")
        close(gw, want_w[r], f"rank {r} grad probs")
        assert counts.tolist() == expected_layout(p.idx, ranks, E, r, 1, True).tokens_per_expert
        assert probs_dtype == torch.float32


def test_fp8_pads_each_expert_and_fp64_router_dtype(megatron_module):
    """config.fp8: each expert's rows padded to 16 (Megatron's fp8 alignment); moe_router_dtype fp64: the
    permuted probs come as float64, and the gradients still match."""
    p = Problem(2, H, E, K, 9, seed=110)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    config = megatron_config(moe_flex_dispatcher_backend="hybridep", fp8="hybrid", moe_router_dtype="fp64")
    runs = run_megatron(megatron_module, p, config, expert_w, grad_outs)
    want_out, want_x, want_w = dense_reference(p, p.idx, expert_w, grad_outs)
    for r, (out, gx, gw, counts, probs_dtype) in enumerate(runs):
        lay = expected_layout(p.idx, 2, E, r, 16, True)
        assert counts.tolist() == [b - a for a, b in zip(lay.expert_offsets, lay.expert_offsets[1:])]
        assert all(c % 16 == 0 for c in counts.tolist())
        assert probs_dtype == torch.float64
        close(out, want_out[r], f"rank {r} out")
        close(gx, want_x[r], f"rank {r} grad x")
        close(gw, want_w[r], f"rank {r} grad probs")


def test_managers_of_all_layers_share_buffers(megatron_module):
    groups = epx.Group.host(2)
    config = megatron_config(moe_flex_dispatcher_backend="deepep")

    def rank(g):
        layers = [megatron_module.MoEFlexTokenDispatcher(4, list(range(g.rank * 4, g.rank * 4 + 4)), config, g)
                  for _ in range(3)]
        return {id(layer._comm_manager.dispatcher.pool) for layer in layers}

    for pools in run_all(groups, rank):
        assert len(pools) == 1


def test_uninstall_puts_megatron_managers_back():
    module = types.ModuleType("token_dispatcher")
    module._DeepepManager, module._HybridEPManager = _Missing, _Missing
    replaced = epx.megatron.install(module, backends=("deepep",))
    assert issubclass(module._DeepepManager, EpxManager) and module._HybridEPManager is _Missing
    epx.megatron.uninstall(replaced, module)
    assert module._DeepepManager is _Missing


def test_dispatcher_config_from_megatron_fields():
    c = epx.megatron.dispatcher_config(megatron_config(moe_hybridep_num_sms=32, fp8="e4m3", fp8_recipe="mxfp8",
                                                       moe_permute_fusion=False), 16, 4)
    assert (c.num_sms, c.pad_multiple, c.fused_permute, c.topk, c.num_experts) == (32, 32, False, 4, 16)
    assert epx.megatron.dispatcher_config(megatron_config(fp4=True), 8, 2).pad_multiple == 32
    assert epx.megatron.dispatcher_config(megatron_config(), 8, 2, static_capacity=True).static_capacity


def test_install_covers_ncclep_and_deepepv2_and_refuses_unknown_backends():
    module = types.ModuleType("token_dispatcher")
    module._NCCLEPManager = module._DeepepV2Manager = _Missing
    replaced = epx.megatron.install(module, backends=("ncclep", "deepepv2"))
    assert issubclass(module._NCCLEPManager, EpxManager) and issubclass(module._DeepepV2Manager, EpxManager)
    epx.megatron.uninstall(replaced, module)
    assert module._NCCLEPManager is _Missing
    with pytest.raises(epx.InvalidArgument, match="backends"):
        epx.megatron.install(module, backends=("deepep", "nvshmem"))


def test_older_managers_keywords_and_their_num_local_tokens_form():
    """Megatron before managers took the config (and NeMo Automodel) builds them with permute_fusion=,
    capacity_factor=, router_dtype=, moe_router_expert_pad_multiple= and calls setup_metadata(num_local_tokens,
    probs): the same layer as the routing-map form."""
    p = Problem(2, H, E, K, [7, 5], seed=41)
    expert_w = expert_weights(E, H)
    groups = epx.Group.host(2)
    local = E // 2

    def rank(g):
        r = g.rank
        outs = []
        for older in (False, True):
            if older:
                m = EpxManager(group=g, router_topk=K, permute_fusion=False, capacity_factor=None, num_experts=E,
                               num_local_experts=local, router_dtype="fp64", moe_router_expert_pad_multiple=4,
                               timeout_ms=TIMEOUT_MS)
                assert (m.dispatcher_config.fused_permute, m.dispatcher_config.router_dtype,
                        m.dispatcher_config.pad_multiple) == (False, "fp64", 4)
                m.setup_metadata(p.x[r].shape[0], p.dense(r)[1])
            else:
                m = EpxManager(g, local, router_topk=K, num_experts=E, config=megatron_config())
                m.setup_metadata(*p.dense(r))
            hidden, probs = m.get_permuted_hidden_states_by_experts(m.dispatch(p.x[r]))
            counts = m.get_number_of_tokens_per_expert()
            y = experts_forward(hidden, torch.as_tensor(counts), probs, expert_w[r * local:(r + 1) * local])
            outs.append(m.combine(m.get_restored_hidden_states_by_experts(y.bfloat16())))
        return outs

    want = dense_reference(p, p.idx, expert_w, grads_for(p))[0]
    for r, (plain, older) in enumerate(run_all(groups, rank)):
        close(plain, want[r], f"rank {r} routing-map form")  # both right, not only alike
        close(older, want[r], f"rank {r} older form")
    with pytest.raises(epx.InvalidArgument, match="moe_epx_options"):
        EpxManager(group=groups[0], router_topk=K, num_experts=E, num_local_experts=E, capacity_factor=1.0)


# --- GPU (skipped without one) -------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (epx.has_cuda and epx.cuda_available()), reason="needs the CUDA backend and a GPU")


def gpu_megatron_rank(module, g, p, config, expert_w, grad_outs, backward, stream):
    local = E // g.size
    device = g.device
    with torch.cuda.stream(stream):
        dispatcher = module.MoEFlexTokenDispatcher(local, list(range(g.rank * local, (g.rank + 1) * local)), config, g)
        x = p.x[g.rank].to(device).requires_grad_(backward)
        routing_map, dense = (t.to(device) for t in p.dense(g.rank))
        probs = dense.requires_grad_(backward)
        out, _, _ = megatron_layer(dispatcher, x, routing_map, probs,
                                   expert_w[g.rank * local:(g.rank + 1) * local].to(device))
        result = [out.detach().cpu()]
        if backward:
            with on_calling_thread():  # ranks that are threads of one process (docs/python.md)
                (out.float() * grad_outs[g.rank].to(device)).sum().backward()
            result += [x.grad.cpu(), slot_grads(probs.grad.cpu(), p.idx[g.rank])]
        torch.cuda.current_stream().synchronize()
    pool = dispatcher._comm_manager.dispatcher.pool
    pool.close()  # collective on the shared GPU
    return result


@needs_gpu
@pytest.mark.parametrize("permute_fusion", [True, False])
def test_gpu_ep1_manager_forward_backward(megatron_module, ep1_group, permute_fusion):
    p = Problem(1, H, E, K, 24, seed=120)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    config = megatron_config(moe_flex_dispatcher_backend="deepep", moe_permute_fusion=permute_fusion)
    out, gx, gw = gpu_megatron_rank(megatron_module, ep1_group, p, config, expert_w, grad_outs, True,
                                    torch.cuda.Stream(0))
    want_out, want_x, want_w = dense_reference(p, p.idx, expert_w, grad_outs)
    close(out, want_out[0], "out")
    close(gx, want_x[0], "grad x")
    close(gw, want_w[0], "grad probs")


@needs_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("backward", [False, True])
def test_gpu_shared_manager_forward(megatron_module, ranks, backward):
    """Thread ranks on one GPU, each rank's backward on its own thread (docs/python.md); async_finish and
    allocate_on_comm_stream as Megatron passes them (the manager runs on the comm stream)."""
    if backward and not has_calling_thread_backward:
        pytest.skip("backward of thread ranks on one GPU needs torch.autograd.set_multithreading_enabled")
    p = Problem(ranks, H, E, K, 24, seed=130 + ranks)
    expert_w, grad_outs = expert_weights(E, H), grads_for(p)
    config = megatron_config(moe_flex_dispatcher_backend="hybridep")
    groups = epx.Group.shared_gpu(ranks, 0)
    runs = run_all(groups, lambda g: gpu_megatron_rank(megatron_module, g, p, config, expert_w, grad_outs, backward,
                                                       torch.cuda.Stream(0)))
    check_against_reference(p, runs, p.idx, expert_w, grad_outs)
