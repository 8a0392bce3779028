"""One thread, every local rank: the Python form of epx/all_ranks.hpp (docs/semantics.md, "One
thread, every local rank"), for a single-process server driving every GPU from one thread.

    outs = epx.dispatch_all(buffers, [dict(x=x0, topk_idx=i0, topk_weights=w0), ...], layout="expert_major")
    ys_back = epx.combine_all(buffers, ys, [o.handle for o in outs])

Each input is the keyword arguments of that buffer's call; the keywords after them apply to every
rank. On a CUDA buffer each rank's call is made from this thread in buffer order (it returns once
its work is enqueued), so a Buffer must be in capacity mode (a blocking one is refused); on the CPU
backend each rank's call runs on a thread of its own. Failures are those of one thread per rank; the
error raised is the first rank's own cause (not a PeerFailed echo of it), in buffer order. The
buffers must be those one collective creation made (the n-th of each rank): a mix of others is not
detected here and fails by timeout.
"""

import threading

from .errors import InvalidArgument, PeerFailed


def _dispatch_form(op, needs_capacity, kind):
    def dispatch(buffers, inputs, **common):
        return _on_every_rank(buffers, inputs, op, needs_capacity, lambda b, kw: b.dispatch(**kw, **common))

    dispatch.__name__ = op
    dispatch.__doc__ = f"{kind}.dispatch of every buffer, inputs[i] its keyword arguments (x, topk_idx, ...)."
    return dispatch


def _combine_form(op, needs_capacity, kind):
    def combine(buffers, ys, handles, **common):
        if len(ys) != len(handles):
            raise InvalidArgument(f"{op}: {len(handles)} handles for {len(ys)} inputs; give one per buffer")
        return _on_every_rank(buffers, list(zip(ys, handles)), op, needs_capacity,
                              lambda b, yh: b.combine(yh[0], yh[1], **common))

    combine.__name__ = op
    combine.__doc__ = f"{kind}.combine of every buffer: ys[i] with handles[i]."
    return combine


# A Buffer's calls need capacity mode on CUDA (needs_capacity); the low-latency calls never wait on the host.
dispatch_all = _dispatch_form("dispatch_all", True, "Buffer")
combine_all = _combine_form("combine_all", True, "Buffer")
ll_dispatch_all = _dispatch_form("ll_dispatch_all", False, "LowLatencyBuffer")
ll_combine_all = _combine_form("ll_combine_all", False, "LowLatencyBuffer")


def _check(buffers, inputs, op, needs_capacity):
    if not buffers:
        raise InvalidArgument(f"{op}: no buffers given")
    if len(inputs) != len(buffers):
        raise InvalidArgument(f"{op}: {len(inputs)} inputs for {len(buffers)} buffers; give one per buffer, in the "
                              "buffers' order")
    ranks = set()
    for i, b in enumerate(buffers):
        if b.group.size != buffers[0].group.size or b.device.type != buffers[0].device.type:
            raise InvalidArgument(f"{op}: buffers[{i}] belongs to another group than buffers[0]; give the buffers "
                                  "of one group")
        if b.group.rank in ranks:
            raise InvalidArgument(f"{op}: buffers[{i}] is rank {b.group.rank} again; give each rank once")
        ranks.add(b.group.rank)
        if needs_capacity and b.device.type == "cuda" and not b.capacity_mode:
            raise InvalidArgument(f"{op}: buffers[{i}] is in blocking mode, whose calls wait on the host for the "
                                  "other ranks' calls, which one thread makes one after another; create the buffers "
                                  "in capacity mode (capacity_rows) to drive them from one thread")


def _on_every_rank(buffers, inputs, op, needs_capacity, call):
    _check(buffers, inputs, op, needs_capacity)
    results, errors = [None] * len(buffers), [None] * len(buffers)

    def run(i):
        try:
            results[i] = call(buffers[i], inputs[i])
        except BaseException as e:  # noqa: BLE001 - every rank takes part; the errors are raised below
            errors[i] = e

    if buffers[0].device.type == "cuda":
        for i in range(len(buffers)):
            run(i)
    else:  # the CPU backend's ranks compute and wait for each other on the host
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(buffers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for e in errors:
        if e is not None and not isinstance(e, PeerFailed):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results
