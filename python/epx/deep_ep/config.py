"""DeepEP's Config and size hints, with the numbers epx needs.

DeepEP's kernels move tokens in chunks through fixed rings, so its buffer sizes do not depend on the
token count. epx sizes its buffers by the most tokens a rank may pass (``max_tokens_per_rank``), so
here the byte counts are token budgets: ``num_nvl_bytes`` buys
``num_nvl_bytes // (num_ranks * nvl_bytes_per_token(hidden))`` tokens per rank, and the hints give
the bytes of a budget.
"""

from ..errors import InvalidArgument

# Tokens per rank that Config.get_nvl_buffer_size_hint sizes for (a prefill chunk; override the
# budget with Buffer(..., epx_max_tokens_per_rank=N) or set_default_max_tokens_per_rank(N)).
HINT_TOKENS_PER_RANK = 4096


def nvl_bytes_per_token(hidden):
    """What epx's high-throughput buffer holds per (rank, token) of its budget: the row on the way out,
    its copy for the peers and the partial on the way back (bf16 each), and the routing slots."""
    return 3 * 2 * hidden + 512


def ll_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks):
    """epx's low-latency window for one wire format: per (source rank, token) a bf16 row out, a bf16
    partial back and the routing, weights and counts (up to 20 slots)."""
    return num_ranks * num_max_dispatch_tokens_per_rank * (4 * 2 * hidden + 256) + 4096


class Config:
    """DeepEP's performance config. epx honours ``num_sms`` (the SM budget of the buffer the dispatch
    creates); the chunk sizes tune DeepEP's rings, which epx does not have, and are kept as given."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        if not isinstance(num_sms, int) or num_sms <= 0 or num_sms % 2:
            raise InvalidArgument(f"deep_ep.Config: num_sms must be a positive even int, got {num_sms!r}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """num_nvl_bytes that buy HINT_TOKENS_PER_RANK tokens per rank at this hidden size (bf16 rows)."""
        return num_ranks * HINT_TOKENS_PER_RANK * nvl_bytes_per_token(hidden_bytes // 2)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: epx's high-throughput mode needs no RDMA buffer (it is NVLink / one node only)."""
        return 0

    def __repr__(self):
        return (f"deep_ep.Config(num_sms={self.num_sms}, nvl_chunks=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma_chunks=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")
