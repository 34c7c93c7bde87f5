"""FP8 weights: float8 e4m3fn values with fp32 scales, and the arithmetic on them.

Layout (:class:`Fp8Weight`): a weight ``[..., N, K]`` (``N`` output channels, ``K`` inputs; leading
dimensions stack MoE experts) is stored as ``weight`` in ``torch.float8_e4m3fn`` and a ``scale`` in
fp32, so that ``W ~= weight * scale``:

- **per output channel** (what :func:`quantize_fp8` makes, and what the fp8 product kernels read):
  ``scale [..., N]``, each row's ``amax / 448`` (448 is e4m3fn's largest finite value), so every
  row uses the whole fp8 range; an all-zero row gets scale 1 (its fp8 values are zeros, and no
  division by zero happens);
- **per output channel and K group** (pre-quantized checkpoints whose scales are per ``128 x 128``
  block or per group of inputs): ``scale [..., N, G]``, one scale per row and each run of
  ``group_size`` inputs (the last run may be shorter), ``G = ceil(K / group_size)``. A block scale
  ``[ceil(N / bn), ceil(K / bk)]`` becomes this form by repeating each block row ``bn`` times,
  which is exact. Turning it into per-channel scales is not: requantizing each row to one scale
  re-rounds every value whose block scale was not its row's largest. So block-scaled checkpoints
  keep their scales, and their products run the dequantizing reference
  (models/layers.py ``fp8_linear``) until a kernel reads K-grouped scales.

Quantization rounds to nearest (``Tensor.to(torch.float8_e4m3fn)``) after clamping to +-448
(values past the range would otherwise become NaN on some devices). A value's relative error is
at most 2**-4 (three mantissa bits) while it is a normal fp8 number (magnitudes of at least
``amax * 2**-6 / 448`` in its row); smaller ones fall in fp8's subnormals, with an absolute error of
at most ``scale * 2**-10``. :func:`relative_error` measures a whole weight's error.

The dequantized weight ``weight.float() * scale`` is the oracle of every fp8 product: the
reference path rounds it to the activation dtype and multiplies as a bf16 weight would be
(``x @ dequantize(w).T``); the kernels upcast the fp8 values in registers and scale each output
column's fp32 sum once (ops/linear/skinny_linear_fp8.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)   # 448

QUANTIZATIONS = ("fp8",)   # what Engine(quantization=...) and --quantization take (None: the checkpoint's weights)


class Fp8Weight(NamedTuple):
    """An fp8 weight ``[..., N, K]`` and its fp32 scales (module doc): ``scale [..., N]`` per output
    channel (``group_size == 0``), or ``scale [..., N, G]`` per output channel and run of
    ``group_size`` inputs."""

    weight: torch.Tensor
    scale: torch.Tensor
    group_size: int = 0

    @property
    def per_channel(self) -> bool:
        return self.group_size == 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale, dtype, self.group_size)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """``weight [..., N, K]`` (any float dtype) as fp8 with one fp32 scale per output channel
    (module doc); the last dimension is the reduction one."""
    w32 = weight.float()
    amax = w32.abs().amax(dim=-1) if w32.shape[-1] else w32.new_zeros(w32.shape[:-1])
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"cannot quantize a weight {tuple(weight.shape)} holding inf or NaN values")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale)


def expand_scale(scale: torch.Tensor, K: int, group_size: int) -> torch.Tensor:
    """The scale of every element ``[..., N, K]`` (broadcastable) of a weight with ``K`` inputs."""
    if group_size == 0:
        return scale[..., None]
    return scale.repeat_interleave(group_size, dim=-1)[..., :K]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   group_size: int = 0) -> torch.Tensor:
    """``weight * scale`` in fp32, rounded once to ``dtype`` (module doc for the scale layouts)."""
    return (weight.float() * expand_scale(scale.float(), weight.shape[-1], group_size)).to(dtype)


def relative_error(reference: torch.Tensor, fp8: Fp8Weight) -> float:
    """``|W - dequantize(fp8)| / |W|`` (Frobenius norms), 0 for an all-zero ``W``."""
    ref = reference.float()
    norm = ref.norm().item()
    return 0.0 if norm == 0 else ((ref - fp8.dequantize()).norm().item() / norm)


def with_groups(w: Fp8Weight, group_size: int) -> Fp8Weight:
    """``w`` with its scales per ``group_size``-input run (exact: a per-channel scale is repeated)."""
    if w.group_size == group_size:
        return w
    if not w.per_channel:
        raise ValueError(f"scales per {w.group_size} inputs cannot be regrouped per {group_size}")
    groups = -(-w.weight.shape[-1] // group_size)
    return Fp8Weight(w.weight, w.scale[..., None].expand(*w.scale.shape, groups).contiguous(), group_size)


def as_fp8(part: torch.Tensor | Fp8Weight) -> Fp8Weight:
    """An fp8 part as it is; a float one quantized per output channel."""
    return part if isinstance(part, Fp8Weight) else quantize_fp8(part)


def _common_groups(parts: Sequence[Fp8Weight]) -> list[Fp8Weight]:
    sizes = {p.group_size for p in parts} - {0}
    if len(sizes) > 1:
        raise ValueError(f"weights fused into one product have scales per different input groups {sorted(sizes)}")
    if not sizes:
        return list(parts)
    size = sizes.pop()
    return [with_groups(p, size) for p in parts]


def cat_fp8(parts: Sequence[torch.Tensor | Fp8Weight], dim: int = -2) -> Fp8Weight:
    """Weights fused along their output channels (q/k/v, gate/up); float parts are quantized."""
    parts = _common_groups([as_fp8(p) for p in parts])
    axis = dim % parts[0].weight.dim()
    return Fp8Weight(torch.cat([p.weight for p in parts], dim=axis), torch.cat([p.scale for p in parts], dim=axis),
                     parts[0].group_size)


def stack_fp8(parts: Sequence[torch.Tensor | Fp8Weight]) -> Fp8Weight:
    """Weights stacked along a new leading dimension (MoE experts); float parts are quantized."""
    parts = _common_groups([as_fp8(p) for p in parts])
    return Fp8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]),
                     parts[0].group_size)


__all__ = ["FP8_DTYPE", "FP8_MAX", "QUANTIZATIONS", "Fp8Weight", "quantize_fp8", "dequantize_fp8", "expand_scale", "relative_error",
           "cat_fp8", "stack_fp8", "as_fp8", "with_groups"]
