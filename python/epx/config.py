"""The enums of epx's configuration and calls (``include/epx/config.hpp``, ``dtype.hpp``, ``ops.hpp``).

Wherever the API takes one, it also takes its name as a string (``wire="fp8"``) or its int code.
"""

import enum


class WireFormat(enum.IntEnum):
    bf16 = 0  # the bf16 row as given
    fp8 = 1  # e4m3 + one fp32 scale per 128 channels
    fp8_ue8m0 = 2  # as fp8, scales rounded up to powers of two
    nvfp4 = 3  # e2m1 + one e4m3 scale per 16 channels + fp32 global scale


class Layout(enum.IntEnum):
    expert_major = 0  # rows grouped by local expert, padded to expert_alignment
    rank_major = 1  # each token once per destination rank (DeepEP-compatible)


class CapacityMode(enum.IntEnum):
    blocking = 0  # outputs sized exactly; the host learns the row count
    capacity = 1  # outputs sized to capacity_rows; no host sync; CUDA-graph capturable


class Op(enum.IntEnum):
    """The collective calls of a Buffer (for Buffer.reject)."""

    dispatch = 0
    combine = 1
    dispatch_backward = 2
    combine_backward = 3
    cached_dispatch = 4


class DType(enum.IntEnum):
    """Element types as epx names them; the Python layer maps torch dtypes onto these."""

    bf16 = 0
    f32 = 1
    fp8_e4m3 = 2
    e2m1x2 = 3
    i32 = 4
    i64 = 5
    boolean = 6


def code_of(enum_type, value):
    """The int code of an enum member given as a member, its name or its code; None if unknown."""
    if isinstance(value, enum_type):
        return int(value)
    if isinstance(value, str):
        member = enum_type.__members__.get(value)
        return None if member is None else int(member)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value in enum_type._value2member_map_ else None
    return None


def names_of(enum_type):
    return ", ".join(enum_type.__members__)
