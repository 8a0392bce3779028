"""Layout replay for activation recompute.

A checkpointed forward runs twice: once without saving activations, once again in backward. If
the recompute's router picks even one expert differently (non-determinism, a peer's different
drop), its dispatch returns a different layout than the one the rest of the step was built on.
A LayoutRecorder removes that: while recording it keeps each dispatch's routing and layout, in
order; while replaying it serves them back (``take``): every recomputed dispatch is a cached
dispatch (``Buffer.dispatch(x, handle=...)``) with the recorded handle, so it moves the
recomputed rows in the recorded layout with no routing work and no plan exchange, and returns
the recorded layout tensors. Gradients flow as through a dispatch: to x, and to the recompute's
router weights (the weights' values are the recorded ones, which the recorded handle's combine
uses too).

Counters: ``recorded``, ``replayed``, ``misses`` (a recompute dispatch with nothing recorded: it
runs as a plain dispatch, and warns), ``routing_changes`` (with ``check=True``: the recompute's
own routing differed from the recorded one, which was used). A recompute whose dispatch has
another shape than the recorded one fails on every rank with ReplayError.
"""

import contextlib
import threading
import warnings
from typing import NamedTuple, Optional

import torch

from .config import Op
from .errors import InvalidArgument

_state = threading.local()
_totals = {"recorded": 0, "replayed": 0, "misses": 0, "routing_changes": 0}
_totals_lock = threading.Lock()


class ReplayError(InvalidArgument):
    """A replayed dispatch does not match its recording (its shape, or its layout)."""


def active():
    """The recorder the current thread's dispatches go through, if any."""
    return getattr(_state, "recorder", None)


def replaying():
    """Whether the current thread's dispatches are a recompute's (an active recorder replaying)."""
    recorder = active()
    return recorder is not None and recorder.mode == "replay"


def totals():
    """Counters summed over every recorder of this process."""
    with _totals_lock:
        return dict(_totals)


class _Entry(NamedTuple):
    signature: tuple
    topk_idx: Optional[torch.Tensor]
    routing_map: Optional[torch.Tensor]
    output: object  # the DispatchOutput, its layout tensors cloned (not its rows: their memory goes)


class LayoutRecorder:
    """Records the dispatches of one checkpointed forward and serves them back during its recompute."""

    def __init__(self, check=True):
        self.check = check
        self._entries = []
        self._cursor = 0
        self._mode = None
        self.recorded = self.replayed = self.misses = self.routing_changes = 0

    @contextlib.contextmanager
    def recording(self):
        """Dispatches in this block are recorded (anew: earlier records are dropped)."""
        self._entries = []
        with self._as("record"):
            yield self

    @contextlib.contextmanager
    def replaying(self):
        """Dispatches in this block take the records in order, from the first."""
        self.rewind()
        with self._as("replay"):
            yield self

    def rewind(self):
        self._cursor = 0

    def take(self):
        """The next record (None when every record was taken: a miss)."""
        if self._cursor >= len(self._entries):
            return None
        self._cursor += 1
        return self._entries[self._cursor - 1]

    @property
    def mode(self):
        """"record", "replay", or None outside both blocks."""
        return self._mode

    @property
    def stats(self):
        return {"recorded": self.recorded, "replayed": self.replayed, "misses": self.misses,
                "routing_changes": self.routing_changes}

    def dispatch(self, buffer, x, topk_idx, topk_weights, *, x_scales, routing_map, probs, layout,
                 nvfp4_global_scale, run, replay):
        """One dispatch through the recorder: `run` is the dispatch itself, `replay` the cached
        dispatch with a recorded output (epx.torch's)."""
        signature = _signature(x, topk_idx, routing_map, layout)
        if self._mode == "record":
            d = run(buffer, x, topk_idx, topk_weights, x_scales, routing_map, probs, layout, nvfp4_global_scale)
            self._entries.append(_Entry(signature, _keep(topk_idx), _keep(routing_map), _layout_of(d)))
            self._count("recorded")
            return d
        entry = self.take()
        if entry is None:
            self._count("misses")
            warnings.warn(f"epx layout replay: dispatch #{self._cursor} of the recompute has no record "
                          f"({len(self._entries)} recorded); it runs with its own routing", stacklevel=3)
            return run(buffer, x, topk_idx, topk_weights, x_scales, routing_map, probs, layout, nvfp4_global_scale)
        if signature != entry.signature:
            reason = (f"layout replay: dispatch #{self._cursor - 1} of the recompute has another shape than the "
                      f"recorded one: recorded {entry.signature}, got {signature}")
            try:
                buffer.reject(Op.cached_dispatch, reason)  # every rank's replay fails, not only this one
            except InvalidArgument as e:
                raise ReplayError(reason) from e
        if self.check and not _same(topk_idx if routing_map is None else routing_map,
                                    entry.topk_idx if routing_map is None else entry.routing_map):
            self._count("routing_changes")
        d = replay(buffer, x, x_scales, topk_weights if routing_map is None else probs, entry.output,
                   nvfp4_global_scale)
        self._count("replayed")
        return d

    @contextlib.contextmanager
    def _as(self, mode):
        previous = (active(), self._mode)
        _state.recorder, self._mode = self, mode
        try:
            yield
        finally:
            _state.recorder, self._mode = previous

    def _count(self, name):
        setattr(self, name, getattr(self, name) + 1)
        with _totals_lock:
            _totals[name] += 1


def _signature(x, topk_idx, routing_map, layout):
    routing = routing_map if routing_map is not None else topk_idx
    return (tuple(x.shape), str(x.dtype), int(layout), "dense" if routing_map is not None else "topk",
            None if routing is None else tuple(routing.shape))


def _keep(t):
    return None if t is None else t.detach().clone()


def _layout_of(d):
    """d without its rows, its layout tensors cloned (views of the rows' allocation would keep it)."""
    return d._replace(recv_x=None, recv_scales=None, recv_global_scale=None,
                      **{f: _keep(getattr(d, f)) for f in ("recv_src", "recv_weights", "recv_topk_idx",
                                                            "recv_topk_weights", "expert_offsets",
                                                            "tokens_per_expert", "rank_offsets", "recv_info")})


def _same(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
