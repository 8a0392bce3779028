"""CUDA streams and events as DeepEP users know them.

By default a call runs on torch's current stream: everything is ordered as if it were a torch op,
and nothing else is needed (this is also what CUDA graph capture uses). With ``previous_event``,
``async_finish`` or ``allocate_on_comm_stream`` it runs on the buffer's communication stream
instead: that stream first waits for ``previous_event`` (else for the current stream); with
``async_finish`` the call returns at once with an :class:`EventOverlap` to wait on, else the
current stream waits for it before the call returns. Inputs of an asynchronous call are recorded on
the communication stream (``record_stream``) so torch's caching allocator cannot reuse them before
it is done; outputs are released after their use on the stream that was current at the call (the
binding's release guard: see docs/python.md, "Lifetimes").
"""

import torch

# CUDA's handle of the legacy default stream: torch's default stream is the null handle, which
# epx's set_stream reads as "the buffer's own stream".
_LEGACY_STREAM = 1


def handle_of(stream):
    """The cudaStream_t of a torch stream, as an int epx reads correctly."""
    return stream.cuda_stream or _LEGACY_STREAM


_RAW_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device):
    """handle_of(torch.cuda.current_stream(device)) without making the Stream object, which costs a call
    ~3 us of host time before its first kernel (docs/lab/2026-12-02-host-read.md)."""
    if _RAW_CURRENT_STREAM is None:
        return handle_of(torch.cuda.current_stream(device))
    return _RAW_CURRENT_STREAM(device.index if device.index is not None else torch.cuda.current_device()) \
        or _LEGACY_STREAM


class EventHandle:
    """DeepEP's EventHandle: an event recorded on torch's current stream when it is made (with no CUDA
    device, none: the CPU backend has no streams to order). ``current_stream_wait()`` makes the
    current stream wait for it. ``EventOverlap(EventHandle())`` is how Megatron passes "after what is
    queued now" as a call's previous_event."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """A CUDA event recorded after an asynchronous epx call (or nothing to wait for).

    ``event`` is a torch.cuda.Event, an :class:`EventHandle` or None. ``current_stream_wait()``
    makes torch's current stream wait for it (nothing when there is none; DeepEP asserts instead);
    as a context manager, the block runs (overlapping the communication) and the current stream
    waits at its end. ``extra_tensors`` are kept alive until then.
    """

    def __init__(self, event=None, extra_tensors=()):
        self.event = event
        self.extra_tensors = tuple(extra_tensors)

    def current_stream_wait(self):
        event = event_of(self)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


NO_EVENT = EventOverlap()


def event_of(previous_event):
    """The torch.cuda.Event (or None) of an EventOverlap, an EventHandle or an event."""
    if isinstance(previous_event, EventOverlap):
        previous_event = previous_event.event
    if isinstance(previous_event, EventHandle):
        previous_event = previous_event.event
    return previous_event


def wait_for(stream, previous_event, current):
    """`stream` waits for previous_event's event, or for the stream `current` when it has none."""
    event = event_of(previous_event)
    if event is not None:
        stream.wait_event(event)
    else:
        stream.wait_stream(current)


class CallStreams:
    """Where one call runs and which stream consumes its outputs (CUDA buffers only). A call on the current
    stream needs only its handle: run and consumer are then None."""

    def __init__(self, run, consumer, asynchronous, on_comm, consumer_handle=None):
        self.run = run
        self.consumer = consumer
        self.asynchronous = asynchronous
        self.on_comm = on_comm
        self.consumer_handle = handle_of(consumer) if consumer_handle is None else consumer_handle

    def finish(self, inputs):
        """After the call: the handle to wait on (async), or the current stream ordered after it."""
        if not self.on_comm:
            return NO_EVENT
        if self.asynchronous:
            for t in inputs:
                if t is not None:
                    t.record_stream(self.run)
            event = torch.cuda.Event()
            event.record(self.run)
            return EventOverlap(event)
        self.consumer.wait_stream(self.run)
        return NO_EVENT


def tensors_in(value):
    """Every tensor in a (nested) result, for record_stream."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def on_side_stream(side, make, inputs, previous_event, async_finish):
    """Runs make() (torch work, or epx calls on torch's current stream) on stream `side`, the DeepEP way:
    `side` first waits for previous_event, else for the current stream. The tensors make() returns are
    record_stream'ed on the current stream, which uses them next. async_finish: `inputs` are
    record_stream'ed on `side` (torch's allocator must not reuse them before it is done) and the
    EventOverlap to wait on comes back; else the current stream waits for `side`. (result, EventOverlap)."""
    current = torch.cuda.current_stream()
    wait_for(side, previous_event, current)
    with torch.cuda.stream(side):
        result = make()
    for t in tensors_in(result):
        if t.is_cuda:
            t.record_stream(current)
    if not async_finish:
        current.wait_stream(side)
        return result, NO_EVENT
    kept = tuple(t for t in inputs if t is not None)
    for t in kept:
        if t.is_cuda:
            t.record_stream(side)
    event = torch.cuda.Event()
    event.record(side)
    return result, EventOverlap(event, kept)

