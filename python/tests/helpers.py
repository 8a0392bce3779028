"""Shared by the Python tests: ranks as threads, random MoE problems, result checks."""

import threading

import torch

import epx

# Long enough never to fire in a passing test; the fail-fast tests measure far less.
TIMEOUT_MS = 20000


def run_ranks(groups, fn):
    """fn(group) on one thread per rank; returns (results, errors) by rank."""
    results, errors = [None] * len(groups), [None] * len(groups)

    def body(r):
        try:
            results[r] = fn(groups[r])
        except BaseException as e:  # noqa: BLE001 - every rank's outcome is reported
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def run_all(groups, fn):
    """run_ranks, raising the first rank's error."""
    results, errors = run_ranks(groups, fn)
    for e in errors:
        if e is not None:
            raise e
    return results


class Problem:
    """Every rank's inputs of one dispatch: x [T_r, H] bf16, idx [T_r, K] int64 (-1 unused), w [T_r, K] f32."""

    def __init__(self, ranks, hidden, experts, topk, tokens, seed=0, unused=0.0, skew=False):
        g = torch.Generator().manual_seed(seed)
        self.ranks, self.hidden, self.experts, self.topk = ranks, hidden, experts, topk
        self.tokens = tokens if isinstance(tokens, list) else [tokens] * ranks
        self.x, self.idx, self.w = [], [], []
        for t in self.tokens:
            self.x.append(torch.randn(t, hidden, generator=g).bfloat16())
            scores = torch.rand(t, experts, generator=g)
            if skew:  # the first experts popular: exercises dropping and uneven segments
                scores = scores * torch.linspace(4.0, 1.0, experts)
            idx = scores.argsort(dim=1, descending=True)[:, :topk].clone()
            idx[torch.rand(t, topk, generator=g) < unused] = -1
            self.idx.append(idx)
            self.w.append(torch.rand(t, topk, generator=g))

    def dense(self, r):
        """routing_map [T, E] bool and probs [T, E] of rank r's top-k routing."""
        t = self.tokens[r]
        routing_map = torch.zeros(t, self.experts, dtype=torch.bool)
        probs = torch.zeros(t, self.experts)
        for k in range(self.topk):
            used = self.idx[r][:, k] >= 0
            rows = torch.nonzero(used).flatten()
            routing_map[rows, self.idx[r][rows, k]] = True
            probs[rows, self.idx[r][rows, k]] = self.w[r][rows, k]
        return routing_map, probs

    def sorted_routing(self, r):
        """The top-k form epx gives a dense row: its experts ascending in slots 0.., -1 after."""
        e = self.experts
        ids = torch.where(self.idx[r] >= 0, self.idx[r], torch.full_like(self.idx[r], e))
        order = ids.argsort(dim=1)
        idx = torch.gather(ids, 1, order)
        w = torch.gather(self.w[r], 1, order)
        unused = idx == e
        return torch.where(unused, torch.full_like(idx, -1), idx), torch.where(unused, torch.zeros_like(w), w)


def random_bf16(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_close_sum(got, want, scale, what, rel=2.0 ** -7):
    """|got - want| <= rel * scale elementwise: a float64 reference of sums epx rounds to bf16 in its
    fixed order (docs/semantics.md) matches to a few bf16 roundings of the summed magnitudes."""
    err = (got.double() - want).abs()
    bound = rel * scale + 1e-30
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values off; worst {float(err.max()):.3g} "
                           f"at {tuple(torch.nonzero(bad)[0].tolist())}")


def make_buffers(groups, **kwargs):
    kwargs.setdefault("timeout_ms", TIMEOUT_MS)
    return run_all(groups, lambda g: epx.Buffer(g, **kwargs))
