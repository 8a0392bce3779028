"""GPU tests (skipped without a GPU): EP1 over NCCL through torch.distributed, EP2..EP4 on the
shared-GPU transport, each bit for bit against the CPU backend (the executable specification);
torch streams and events; CUDA graph capture and replay of capacity-mode and low-latency calls;
torch.compile of a MoE layer. Run by scripts/python-test.sh on the GPU machine."""

import inspect
import threading

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, random_bf16, run_all
from test_ops import TinyMoE, needs_compile

pytestmark = pytest.mark.skipif(not (epx.has_cuda and epx.cuda_available()), reason="needs the CUDA backend and a GPU")

H, E, K, T = 256, 24, 4, 32  # E: a multiple of every rank count tested


def full_run(group, p, r, config, layout="expert_major", stream=None):
    """Every call of one rank; host copies of every output. Closes its buffer (collective on a shared GPU)."""
    device = group.device
    b = epx.Buffer(group, timeout_ms=TIMEOUT_MS, **config)
    out = {}
    try:
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            x, idx, w = (t.to(device) for t in (p.x[r], p.idx[r], p.w[r]))
            gate = torch.linspace(-1.0, 1.0, p.tokens[r]).to(device) if config.get("shared_expert") else None
            d = b.dispatch(x, idx, w, layout=layout, expert_replicas=replica_table(config, device), shared_gate=gate)
            rows = d.recv_x.shape[0]
            y = random_bf16((rows, p.hidden), 100 + r).to(device)
            shared = random_bf16((p.tokens[r], p.hidden), 200 + r).to(device)
            c = b.combine(y, d.handle, shared_out=shared)
            gw_shape = (rows,) if layout == "expert_major" else (rows, p.topk)
            gw = torch.rand(gw_shape, generator=torch.Generator().manual_seed(r)).to(device)
            db = b.dispatch_backward(random_bf16((rows, p.hidden), 300 + r).to(device), d.handle, gw)
            cb = b.combine_backward(random_bf16((p.tokens[r], p.hidden), 400 + r).to(device), d.handle, y)
            for name, t in [*d._asdict().items(), ("out", c.out), ("grad_x", db.grad_x),
                            ("grad_topk_weights", db.grad_topk_weights), ("grad_y", cb.grad_y),
                            ("combine_grad_w", cb.grad_topk_weights), ("grad_shared_gate", db.grad_shared_gate),
                            ("combine_grad_shared_gate", cb.grad_shared_gate)]:
                if isinstance(t, torch.Tensor):
                    out[name] = t.cpu()
            out["num_rows"] = d.num_rows
    finally:
        b.close()
    return out


def replica_table(config, device):
    """EPLB configs: replica j of logical expert e is physical expert j * E + e (None without EPLB)."""
    physical, experts = config.get("num_physical_experts", 0), config["num_experts"]
    if not physical:
        return None
    columns = [torch.arange(experts, dtype=torch.int32) + j * experts for j in range(physical // experts)]
    return torch.stack(columns, dim=1).contiguous().to(device)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def host_runs(p, config, layout="expert_major"):
    groups = epx.Group.host(p.ranks)
    return run_all(groups, lambda g: full_run(g, p, g.rank, config, layout))


def assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        if name == "num_rows":
            continue  # CUDA capacity mode keeps it on the device only (recv_info)
        assert torch.equal(got[name], want[name]), name


def shared_gpu_runs(p, config, layout="expert_major"):
    groups = epx.Group.shared_gpu(p.ranks, 0)

    def rank(g):
        torch.cuda.set_device(0)
        return full_run(g, p, g.rank, config, layout, stream=torch.cuda.Stream())  # a stream per rank

    return run_all(groups, rank)


CONFIGS = [
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, expert_alignment=4)),
    ("rank_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K)),
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, wire="fp8", capacity_rows=256)),
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, capacity_factor=0.7)),
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, num_physical_experts=2 * E,
                          max_replicas=2)),
    ("rank_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, num_physical_experts=2 * E,
                        max_replicas=2, wire="fp8")),
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, combine_wire="fp8")),
    ("rank_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, wire="fp8",
                        combine_wire="fp8_ue8m0")),
    # the fused shared expert with a gate: segment 0, both terms of combine, both gate gradients
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, expert_alignment=8,
                          shared_expert=True)),
    ("expert_major", dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, wire="fp8", shared_expert=True,
                          combine_wire="fp8")),
]


@pytest.mark.parametrize("layout,config", CONFIGS)
def test_ep1_over_nccl_matches_host(ep1_group, layout, config):
    p = Problem(1, H, E, K, T, seed=1, unused=0.1)
    got = full_run(ep1_group, p, 0, config, layout)
    assert_same(got, host_runs(p, config, layout)[0])


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("layout,config", CONFIGS)
def test_shared_gpu_matches_host(ranks, layout, config):
    p = Problem(ranks, H, E, K, T, seed=ranks, unused=0.1, skew=True)
    config = dict(config, num_sms=4)  # every rank's blocks on the GPU at once (docs/cuda.md)
    want = host_runs(p, config, layout)
    for r, got in enumerate(shared_gpu_runs(p, config, layout)):
        assert_same(got, want[r])


def test_ep1_autograd_matches_host(ep1_group):
    from test_autograd import experts_expert_major

    p = Problem(1, 64, 4, 2, 16, seed=3)
    weights = torch.randn(4, 64, 64) / 8

    def grads(group):
        b = epx.Buffer(group, hidden=64, max_tokens_per_rank=16, num_experts=4, topk=2, timeout_ms=TIMEOUT_MS)
        dev = group.device
        x = p.x[0].to(dev).requires_grad_()
        w = p.w[0].to(dev).requires_grad_()
        wl = weights.to(dev).requires_grad_()
        d = epx.torch.dispatch(b, x, p.idx[0].to(dev), w)
        out = epx.torch.combine(b, experts_expert_major(d, wl).bfloat16(), d.handle)
        out.float().square().sum().backward()
        result = [t.grad.cpu() for t in (x, w, wl)]
        b.close()
        return result

    (host,) = epx.Group.host(1)
    for got, want in zip(grads(ep1_group), grads(host)):
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)


def test_streams_async_finish_and_previous_event(ep1_group):
    p = Problem(1, H, E, K, T, seed=5)
    config = dict(hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K)
    b = epx.Buffer(ep1_group, timeout_ms=TIMEOUT_MS, **config)
    x, idx, w = (t.cuda() for t in (p.x[0], p.idx[0], p.w[0]))
    plain = b.dispatch(x, idx, w)
    plain_out = b.combine(plain.recv_x, plain.handle).out.cpu()
    comm_buffer = epx.Buffer(ep1_group, timeout_ms=TIMEOUT_MS, **config)
    for _ in range(3):  # outputs released on the compute stream, their blocks reused by the comm stream
        before = epx.EventOverlap(torch.cuda.Event())
        before.event.record()
        d = comm_buffer.dispatch(x, idx, w, previous_event=before, async_finish=True)
        assert d.event.event is not None
        d.event.current_stream_wait()
        y = d.recv_x * 1  # used on the compute stream
        c = comm_buffer.combine(y, d.handle, async_finish=True)
        with c.event:
            pass
        assert torch.equal(d.recv_x.cpu(), plain.recv_x.cpu())
        assert torch.equal(c.out.cpu(), plain_out)
        del d, y, c
    comm_buffer.close()
    b.close()


# One capture at a time: torch.cuda.graph starts with a device synchronize, which CUDA refuses while
# another thread's stream is capturing. A capture launches nothing, so ranks need not capture together.
_capture_lock = threading.Lock()


def _capture(fn, stream):
    graph = torch.cuda.CUDAGraph()
    kwargs = {"stream": stream}
    if "capture_error_mode" in inspect.signature(torch.cuda.graph).parameters:
        kwargs["capture_error_mode"] = "thread_local"  # other ranks' threads go on while this one captures
    with _capture_lock, torch.cuda.graph(graph, **kwargs):
        outputs = fn()
    return graph, outputs


def capacity_graph_rank(group, problems, barrier, stream):
    """Dispatch -> stand-in expert (y = 2 recv_x) -> combine captured once, replayed per problem."""
    r, dev = group.rank, group.device
    b = epx.Buffer(group, hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K, capacity_rows=T * K * group.size,
                   num_sms=4, timeout_ms=TIMEOUT_MS)
    results = []
    try:
        with torch.cuda.stream(stream):
            x, idx, w = (t.to(dev) for t in (problems[0].x[r], problems[0].idx[r], problems[0].w[r]))

            def step():
                d = b.dispatch(x, idx, w)
                return d, b.combine((d.recv_x.float() * 2).bfloat16(), d.handle).out

            step()  # warm-up, eager
            torch.cuda.current_stream().synchronize()
            graph, (d, out) = _capture(step, stream)
            barrier.wait()  # no rank's graph waits for a peer still capturing
            for p in problems:
                x.copy_(p.x[r])
                idx.copy_(p.idx[r])
                w.copy_(p.w[r])
                graph.replay()
                torch.cuda.current_stream().synchronize()
                results.append({"recv_x": d.recv_x.cpu(), "recv_src": d.recv_src.cpu(), "out": out.cpu(),
                                "recv_info": d.recv_info.cpu()})
            del graph, d, out
    finally:
        b.close()
    return results


@pytest.mark.parametrize("ranks", [1, 2])
def test_capacity_mode_graph_replays_with_fresh_inputs(ranks, ep1_group):
    problems = [Problem(ranks, H, E, K, T, seed=40 + i, unused=0.1 * i) for i in range(3)]
    groups = [ep1_group] if ranks == 1 else epx.Group.shared_gpu(ranks, 0)
    barrier = threading.Barrier(ranks)
    got = run_all(groups, lambda g: capacity_graph_rank(g, problems, barrier, torch.cuda.Stream(0)))
    for i, p in enumerate(problems):
        host = epx.Group.host(ranks)
        buffers = run_all(host, lambda g: epx.Buffer(g, hidden=H, max_tokens_per_rank=T, num_experts=E, topk=K,
                                                     capacity_rows=T * K * ranks, timeout_ms=TIMEOUT_MS))

        def want(g):
            d = buffers[g.rank].dispatch(p.x[g.rank], p.idx[g.rank], p.w[g.rank])
            out = buffers[g.rank].combine((d.recv_x.float() * 2).bfloat16(), d.handle).out
            return {"recv_x": d.recv_x, "recv_src": d.recv_src, "out": out, "recv_info": d.recv_info}

        for r, expected in enumerate(run_all(host, want)):
            for name in expected:
                assert torch.equal(got[r][i][name], expected[name]), f"replay {i} rank {r} {name}"


def shared_gate(i, r, m, shared):
    """The shared expert's gate of replay i on rank r (None without the shared expert)."""
    return torch.linspace(-1.0, 1.0, m) * (i + r + 1) / 4 if shared else None


def ll_graph_rank(group, problems, counts, barrier, stream, m, shared=False):
    r, dev = group.rank, group.device
    b = epx.LowLatencyBuffer(group, H, m, E, K, timeout_ms=TIMEOUT_MS, shared_expert=shared)
    results = []
    try:
        with torch.cuda.stream(stream):
            x, idx, w = (t.to(dev) for t in (problems[0].x[r], problems[0].idx[r], problems[0].w[r]))
            num = torch.tensor([m], dtype=torch.int32, device=dev)
            gate = shared_gate(0, r, m, shared)
            gate = gate.to(dev) if shared else None

            def step():
                d = b.dispatch(x, idx, num_tokens=num, topk_weights=w, shared_gate=gate)
                return d, b.combine((d.recv_x.float() * 2).bfloat16(), d.handle)

            step()
            torch.cuda.current_stream().synchronize()
            graph, (d, out) = _capture(step, stream)
            barrier.wait()
            for i, p in enumerate(problems):
                x.copy_(p.x[r])
                idx.copy_(p.idx[r])
                w.copy_(p.w[r])
                num.fill_(counts[i][r])
                if shared:
                    gate.copy_(shared_gate(i, r, m, shared))
                graph.replay()
                torch.cuda.current_stream().synchronize()
                results.append({"recv_x": d.recv_x.cpu(), "recv_count": d.recv_count.cpu(),
                                "recv_src": d.recv_src.cpu(), "out": out.cpu()})
            del graph, d, out
    finally:
        b.close()
    return results


@pytest.mark.parametrize("ranks,shared", [(1, False), (2, False), (4, False), (1, True), (2, True)])
def test_low_latency_graph_replays_with_fresh_inputs_and_counts(ranks, shared, ep1_group):
    """shared: the fused shared expert, its gate rewritten before each replay."""
    m = 16
    problems = [Problem(ranks, H, E, K, m, seed=60 + i) for i in range(3)]
    counts = [[m - (3 * i + r) % m for r in range(ranks)] for i in range(3)]
    groups = [ep1_group] if ranks == 1 else epx.Group.shared_gpu(ranks, 0)
    barrier = threading.Barrier(ranks)
    got = run_all(groups, lambda g: ll_graph_rank(g, problems, counts, barrier, torch.cuda.Stream(0), m, shared))
    for i, p in enumerate(problems):
        host = epx.Group.host(ranks)
        buffers = run_all(host, lambda g: epx.LowLatencyBuffer(g, H, m, E, K, timeout_ms=TIMEOUT_MS,
                                                               shared_expert=shared))

        def want(g):
            num = torch.tensor([counts[i][g.rank]], dtype=torch.int32)
            d = buffers[g.rank].dispatch(p.x[g.rank], p.idx[g.rank], num_tokens=num, topk_weights=p.w[g.rank],
                                         shared_gate=shared_gate(i, g.rank, m, shared))
            out = buffers[g.rank].combine((d.recv_x.float() * 2).bfloat16(), d.handle)
            return {"recv_x": d.recv_x, "recv_count": d.recv_count, "recv_src": d.recv_src, "out": out}

        for r, expected in enumerate(run_all(host, want)):
            for name in expected:
                assert torch.equal(got[r][i][name], expected[name]), f"replay {i} rank {r} {name}"


@needs_compile
def test_compiled_moe_layer_on_gpu(ep1_group):
    b = epx.Buffer(ep1_group, hidden=128, max_tokens_per_rank=64, num_experts=8, topk=2, capacity_rows=128,
                   timeout_ms=TIMEOUT_MS)
    torch.manual_seed(0)
    layer = TinyMoE(b, 128, 8, 2).cuda()
    x = torch.randn(64, 128, device="cuda").bfloat16().requires_grad_()
    want = layer(x)
    want.float().sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    traced = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)  # epx's ops traced, torch's run as is
    assert torch.equal(traced, want)
    compiled = torch.compile(layer, fullgraph=True)  # inductor
    got = compiled(x)
    got.float().sum().backward()
    diff = (got.float() - want.float()).abs()
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), \
        f"out: {int((diff > 2e-2 + 2e-2 * want.float().abs()).sum())} of {diff.numel()} off, max {float(diff.max())}, " \
        f"rows off {torch.nonzero((diff > 0.1).any(dim=1)).flatten().tolist()[:16]}"
    assert torch.allclose(x.grad.float(), want_grad.float(), rtol=2e-2, atol=2e-2)
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    b.close()


@needs_compile
def test_compiled_blocking_dispatch_has_dynamic_rows(ep1_group):
    b = epx.Buffer(ep1_group, hidden=128, max_tokens_per_rank=64, num_experts=8, topk=2, timeout_ms=TIMEOUT_MS)
    p = Problem(1, 128, 8, 2, 64, seed=9)
    x, idx, w = (t.cuda() for t in (p.x[0], p.idx[0], p.w[0]))

    def step(x, idx, w):
        d = epx.torch.dispatch(b, x, idx, w)
        return epx.torch.combine(b, d.recv_x * 2, d.handle)

    want = step(x, idx, w)
    config = torch._dynamo.config
    with config.patch(capture_dynamic_output_shape_ops=True) if hasattr(config, "capture_dynamic_output_shape_ops") \
            else _nothing():
        got = torch.compile(step, fullgraph=True)(x, idx, w)
    assert torch.equal(got, want)
    b.close()
