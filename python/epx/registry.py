"""Buffers by id: torch.library ops take a buffer as an int (an op's schema has no place for a
Python object), and look it up here when they run."""

import itertools
import weakref

from .errors import InvalidArgument

_buffers = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def add(buffer):
    buffer_id = next(_ids)
    _buffers[buffer_id] = buffer
    return buffer_id


def get(buffer_id):
    buffer = _buffers.get(buffer_id)
    if buffer is None:
        raise InvalidArgument(f"epx buffer #{buffer_id} is gone (it was garbage-collected or never existed)")
    return buffer
