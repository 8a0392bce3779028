"""``deep_ep.utils`` as code written for DeepEP imports it (Megatron's fused_a2a:
``from deep_ep.utils import EventHandle, EventOverlap``): epx's own classes (epx.streams). The
import is absolute so that this module also loads as ``deep_ep.utils`` where
``sys.modules["deep_ep"] = epx.deep_ep`` stands in for DeepEP."""

from epx.streams import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
