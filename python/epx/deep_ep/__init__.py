"""DeepEP's Python API on epx: code written for ``deep_ep.Buffer`` runs with

    import epx.deep_ep as deep_ep          # or: sys.modules["deep_ep"] = epx.deep_ep

``Buffer`` (high-throughput intranode dispatch / combine, cached dispatch, low-latency calls with
hooks), ``Config``, ``EventOverlap`` and ``EventHandle`` (epx's own, also as ``deep_ep.utils``),
``topk_idx_t`` (the dtype of topk_idx, int64). What differs from DeepEP and what is refused:
docs/integrations.md, "DeepEP".
"""

import torch

from . import utils
from ..streams import EventHandle, EventOverlap
from .buffer import Buffer, set_default_max_tokens_per_rank
from .config import Config
from .handles import DispatchHandle, LowLatencyHandle

topk_idx_t = torch.int64  # DeepEP's default build; epx also takes int32 topk_idx

__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap", "LowLatencyHandle",
           "set_default_max_tokens_per_rank", "topk_idx_t", "utils"]
