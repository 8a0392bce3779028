"""epx as a backend of Megatron-LM's flex token dispatcher (``moe_token_dispatcher_type="flex"``).

Megatron's ``MoEFlexTokenDispatcher`` drives a *manager* (``_DeepepManager``, ``_HybridEPManager``):

    manager.setup_metadata(routing_map, probs)        # dispatch_preprocess; reads manager.token_probs
    out = manager.dispatch(hidden, async_finish, allocate_on_comm_stream)   # then manager.dispatched_probs
    hidden, probs = manager.get_permuted_hidden_states_by_experts(out)     # dispatch_postprocess
    counts = manager.get_number_of_tokens_per_expert()
    hidden = manager.get_restored_hidden_states_by_experts(expert_out)     # combine_preprocess
    out = manager.combine(hidden, async_finish, allocate_on_comm_stream)   # token_combine

:class:`EpxManager` implements that contract over :class:`epx.dispatcher.TokenDispatcher`, and
:func:`install` puts it in the place of Megatron's managers (docs/integrations.md, "Megatron"). The
experts multiply their output by the permuted probs (as Megatron's experts do), so the combine is an
unweighted sum; backward of the dispatch is a combine of the gradient together with the gradient of
the probs, backward of the combine a dispatch reusing the handle (epx.torch).
"""

import dataclasses
import importlib

import torch

from .dispatcher import BufferPool, DispatcherConfig, TokenDispatcher, as_epx_group
from .errors import InvalidArgument

# One epx group and buffer pool per EP process group, shared by the managers of every layer (Megatron
# makes one manager per layer): the buffers are created once per shape.
_POOLS = {}


def shared_pool(group, config):
    """The BufferPool of `group` (an epx.Group or a torch process group) and `config`, made at the first call."""
    key = (id(group), dataclasses.astuple(config))
    if key not in _POOLS:
        _POOLS[key] = (group, BufferPool(as_epx_group(group), config))  # the group is kept: its id stays unique
    return _POOLS[key][1]


def reset_pools():
    """Forgets every shared pool (tests; a new model with other shapes). Buffers go with their last user."""
    _POOLS.clear()


def quantization_alignment(config):
    """Rows of each expert padded for fp8 / fp4 grouped GEMMs, as Megatron pads them (1: no padding)."""
    if getattr(config, "fp4", None):
        return 32
    if getattr(config, "fp8", None):
        return 32 if getattr(config, "fp8_recipe", None) == "mxfp8" else 16
    return 1


def dispatcher_config(config, num_experts, router_topk, **overrides):
    """A DispatcherConfig from a Megatron TransformerConfig (read by attribute name; absent ones take the
    defaults), then ``config.moe_epx_options`` (a dict, if the config has one), then `overrides`."""
    num_sms = next((n for n in (getattr(config, name, None) for name in
                                ("moe_flex_dispatcher_num_sms", "moe_hybridep_num_sms", "moe_deepep_num_sms"))
                    if n), 0)
    fields = dict(num_experts=num_experts, topk=router_topk,
                  pad_multiple=quantization_alignment(config),
                  fused_permute=bool(getattr(config, "moe_permute_fusion", True)),
                  num_sms=int(num_sms), async_dispatch=True,
                  router_dtype=getattr(config, "moe_router_dtype", None) or "fp32")
    fields.update(getattr(config, "moe_epx_options", None) or {})
    fields.update(overrides)
    return DispatcherConfig(**fields)


# Keywords older managers are made with (Megatron before managers took the config; NeMo Automodel),
# as the DispatcherConfig fields they set.
_OLDER_KEYWORDS = {"permute_fusion": "fused_permute", "router_dtype": "router_dtype",
                   "moe_router_expert_pad_multiple": "pad_multiple"}


def older_keywords(overrides):
    """`overrides` with the older managers' keywords as DispatcherConfig fields. Their capacity_factor (the
    router's moe_expert_capacity_factor, whose drops the router has made already) is refused unless None:
    epx's own drop rule differs (docs/semantics.md) and goes through config.moe_epx_options."""
    out = {}
    for name, value in overrides.items():
        if name == "capacity_factor" and value is not None:
            raise InvalidArgument(f"epx.megatron.EpxManager: capacity_factor={value}: Megatron's router drops tokens "
                                  "over moe_expert_capacity_factor before the dispatch; epx's own drop rule is set "
                                  "with config.moe_epx_options={'capacity_factor': ...} (docs/integrations.md)")
        if name == "capacity_factor":
            continue
        if name in _OLDER_KEYWORDS and value is None:
            continue  # the manager's default: the config's value
        out[_OLDER_KEYWORDS.get(name, name)] = value
    return out


class EpxManager:
    """Megatron's _DispatchManager contract over epx (module docstring).

    Takes the arguments Megatron gives its managers, by keyword: ``group`` (the TPxEP process group, or
    an epx.Group), ``num_local_experts``, ``router_topk`` (TP * moe_router_topk; HybridEP's manager gets
    none: then moe_router_topk times the TP factor), ``num_experts`` (TP * num_moe_experts) and
    ``config`` (the TransformerConfig). Extra keywords override fields of the DispatcherConfig.
    """

    def __init__(self, group, num_local_experts, router_topk=None, num_experts=None, config=None, **overrides):
        overrides = older_keywords(overrides)
        num_experts = num_experts or config.num_moe_experts
        if router_topk is None:
            router_topk = config.moe_router_topk * (num_experts // config.num_moe_experts)
        self.group, self.config = group, config
        self.num_local_experts, self.num_experts, self.router_topk = num_local_experts, num_experts, router_topk
        self.dispatcher_config = dispatcher_config(config, num_experts, router_topk, **overrides)
        pool = shared_pool(group, self.dispatcher_config)
        epx_group = pool.group
        first = epx_group.rank * num_local_experts
        self.dispatcher = TokenDispatcher(epx_group, range(first, first + num_local_experts),
                                          self.dispatcher_config, pool=pool)
        self.router_dtype = self.dispatcher_config.router_dtype
        # What Megatron's dispatcher and its CUDA-graph code read from a manager.
        self.routing_map = self.token_probs = self.token_indices = None
        self.handle = None
        self.dispatched_probs = self.dispatched_indices = None
        self.tokens_per_expert = None

    def setup_metadata(self, routing_map, probs):
        """routing_map [T, E] or [T, ranks, L] bool and probs of the same shape (Megatron's flex dispatcher
        passes the latter); keeps them as [T, E] with probs in float32. The older managers' form
        ``setup_metadata(num_local_tokens, probs)`` (NeMo Automodel): the experts are probs' top-k, a zero
        probability an unused slot."""
        if routing_map is None or isinstance(routing_map, int):
            tokens = probs.numel() // self.num_experts
            token_probs, token_indices = torch.topk(probs.reshape(tokens, self.num_experts).float(),
                                                    self.router_topk, dim=-1)
            self.setup_metadata_from_indices(token_indices.masked_fill(token_probs == 0, -1), token_probs)
            return
        tokens = routing_map.shape[0]
        self.routing_map = routing_map.reshape(tokens, self.num_experts)
        self.token_probs = probs.reshape(tokens, self.num_experts).float()
        self.token_indices = None

    def setup_metadata_from_indices(self, token_indices, token_probs):
        """The compact routing: token_indices [T, K] (-1 unused), token_probs [T, K]."""
        self.routing_map, self.token_indices, self.token_probs = None, token_indices, token_probs.float()

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False, previous_event=None):
        """Sends the tokens (collective). Returns the received rows: expert-major (padded to the quantization
        alignment) with fused permute, else rank-major. Sets dispatched_probs, tokens_per_expert, handle. The
        result is ordered on torch's current stream when this returns (as Megatron's managers leave it); the
        call itself ran on the communication stream (async_finish / allocate_on_comm_stream: accepted)."""
        d = self.dispatcher
        if self.token_indices is not None:
            d.dispatch_preprocess2(hidden_states, None, self.token_probs, self.token_indices)
        else:
            d.dispatch_preprocess(hidden_states, self.routing_map, self.token_probs)
        # async_finish=None: the pool's choice (async_dispatch, which dispatcher_config sets; moe_epx_options may
        # turn it off): the manager waits below either way.
        received, self.dispatched_probs = d.dispatch_all_to_all(hidden_states.reshape(-1, hidden_states.shape[-1]),
                                                                async_finish=None, previous_event=previous_event)
        d.dispatch_event.current_stream_wait()
        output = d.last_dispatch
        self.handle = output.handle
        self.dispatched_indices = output.recv_topk_idx
        return received

    def get_dispached_metadata(self):
        """(dispatched_indices (rank-major only, else None), dispatched_probs); Megatron's spelling."""
        return self.dispatched_indices, self.dispatched_probs

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        """(rows grouped by local expert [N, H], their probs [N] in float32, float64 with router dtype fp64)."""
        permuted, self.tokens_per_expert, permuted_probs = self.dispatcher.dispatch_postprocess(
            hidden_states, self.dispatched_probs)
        return permuted, permuted_probs

    def get_number_of_tokens_per_expert(self):
        """Rows of each local expert's segment of the permuted rows (padding included; sums to their count), on
        the group's device (a CPU tensor with tokens_per_expert_on_host=True)."""
        return self.tokens_per_expert

    def get_restored_hidden_states_by_experts(self, hidden_states):
        """Expert outputs (weighted by the permuted probs) -> the rows the combine takes."""
        return self.dispatcher.combine_preprocess(hidden_states)

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        """Brings the rows back and sums them per token (collective): [T, H] bf16, ordered on the current
        stream when this returns. Releases the dispatch's handle."""
        d = self.dispatcher
        out = d.combine_all_to_all(hidden_states, async_finish=None)
        d.combine_event.current_stream_wait()
        out = d.combine_postprocess(out).reshape(-1, out.shape[-1])
        self.handle = None
        return out

    def check_overflow(self):
        """Capacity mode with on_overflow="count": raises epx.dispatcher.CapacityOverflow on every rank if a
        dispatch overflowed since the last check (collective)."""
        self.dispatcher.check_overflow()

    def destroy(self):
        """Megatron calls it when the dispatcher goes; the shared buffers stay for the other layers."""
        self.handle = None


def install(token_dispatcher=None, backends=("deepep", "hybridep")):
    """Makes Megatron's flex dispatcher use epx for the given backends (any of deepep, hybridep, ncclep,
    deepepv2): their manager classes in
    ``megatron.core.transformer.moe.token_dispatcher`` (or the module given) become EpxManager
    subclasses, so ``moe_flex_dispatcher_backend="deepep"`` (or another of them) builds an EpxManager
    with the arguments Megatron passes. Call it before the model is built. Returns the replaced classes
    by name (for uninstall)."""
    module = token_dispatcher or importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    names = {"deepep": "_DeepepManager", "hybridep": "_HybridEPManager", "ncclep": "_NCCLEPManager",
             "deepepv2": "_DeepepV2Manager"}
    unknown = [b for b in backends if b not in names]
    if unknown:
        raise InvalidArgument(f"epx.megatron.install: backends {unknown}: epx stands in for {sorted(names)}")
    replaced = {}
    for backend in backends:
        name = names[backend]
        replaced[name] = getattr(module, name, None)
        setattr(module, name, type(name, (EpxManager,), {"__doc__": f"EpxManager in the place of {name}."}))
    return replaced


def uninstall(replaced, token_dispatcher=None):
    """Puts back the classes install() replaced."""
    module = token_dispatcher or importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    for name, cls in replaced.items():
        setattr(module, name, cls)
