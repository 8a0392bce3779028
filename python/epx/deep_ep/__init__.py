"""DeepEP's Python API on epx: code written for ``deep_ep.Buffer`` runs with

    import epx.deep_ep as deep_ep          # or: sys.modules["deep_ep"] = epx.deep_ep

``Buffer`` (high-throughput intranode dispatch / combine, cached dispatch, low-latency calls with
hooks), ``Config`` and ``EventOverlap`` (epx's own). What differs from DeepEP and what is refused:
docs/integrations.md, "DeepEP".
"""

from ..streams import EventOverlap
from .buffer import Buffer, set_default_max_tokens_per_rank
from .config import Config
from .handles import DispatchHandle, LowLatencyHandle

__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "LowLatencyHandle", "set_default_max_tokens_per_rank"]
