"""torch tensors in and out of the compiled module, without copies.

Inputs are checked here first (type, dtype, device, number of dimensions, a layout epx can read)
so that a bad one is refused with a message naming it before anything runs; shapes are checked by
epx itself, which names the tensor too. They then cross as DLPack capsules read in place. Outputs
come back as capsules owning epx's memory and become torch tensors with ``from_dlpack``.
"""

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .config import DType

# torch < 2.1 has no float8; fp8 codes are then uint8 tensors (inputs and outputs alike).
FP8 = getattr(torch, "float8_e4m3fn", None)

_NAMES = {DType.bf16: "bfloat16", DType.f32: "float32", DType.i32: "int32", DType.i64: "int64",
          DType.boolean: "bool", DType.fp8_e4m3: "float8_e4m3fn (or uint8 codes)"}

# The epx dtype each accepted torch dtype carries.
_EPX = {torch.bfloat16: DType.bf16, torch.float32: DType.f32, torch.int32: DType.i32, torch.int64: DType.i64,
        torch.bool: DType.boolean, torch.uint8: DType.fp8_e4m3}
if FP8 is not None:
    _EPX[FP8] = DType.fp8_e4m3

# dtypes DLPack cannot export from every torch version: they travel as uint8 bytes.
_AS_BYTES = {torch.bool} | ({FP8} if FP8 is not None else set())


def problem(t, what, allowed, device):
    """Why tensor `t` cannot be the input `what` (one of the epx dtypes `allowed`, on `device`); None if it can."""
    if not isinstance(t, torch.Tensor):
        return f"{what}: expected a torch.Tensor, got {type(t).__name__}"
    if t.layout != torch.strided:
        return f"{what}: must be a dense (strided) tensor, got layout {t.layout}"
    if _EPX.get(t.dtype) not in allowed:
        want = " or ".join(_NAMES[d] for d in allowed)
        return f"{what}: expected dtype {want}, got {t.dtype}"
    if t.device != device:
        return f"{what}: is on {t.device}, but this buffer's rank works on {device}"
    if not 1 <= t.dim() <= 4:
        return f"{what}: must have 1 to 4 dimensions, got {t.dim()} (shape {tuple(t.shape)})"
    if not readable(t):
        return (f"{what}: must be contiguous (a 2-D tensor may have strided rows), got shape {tuple(t.shape)} "
                f"with strides {t.stride()}; pass {what.split(': ')[-1]}.contiguous()")
    return None


def readable(t):
    """Contiguous, or 2-D with contiguous, non-overlapping rows (what epx reads in place)."""
    if t.is_contiguous():
        return True
    if t.dim() != 2:
        return False
    rows, cols = t.shape
    return (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols)


def arg(t):
    """The compiled module's form of an input: None, or (capsule, epx dtype code)."""
    if t is None:
        return None
    code = int(_EPX[t.dtype])
    if t.dtype in _AS_BYTES:
        t = t.detach().view(torch.uint8)
    return to_dlpack(t), code


def out(capsule, fp8=False):
    """A torch tensor from an output capsule (None stays None); fp8 codes as float8_e4m3fn where torch has it."""
    if capsule is None:
        return None
    t = from_dlpack(capsule)
    return t.view(FP8) if fp8 and FP8 is not None else t


def fp8_dtype():
    """The dtype of fp8 outputs in this torch: float8_e4m3fn, else uint8."""
    return FP8 if FP8 is not None else torch.uint8
