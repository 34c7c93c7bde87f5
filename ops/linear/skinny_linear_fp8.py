"""Skinny linear with FP8 weights: ``x [M, K] @ (weight [N, K] * scale[:, None])^T`` for ``M <= 64``.

``weight`` is float8 e4m3fn and ``scale`` ``[N]`` fp32, one per output channel (models/quant.py);
``x`` and the output are bf16, fp16 or fp32. Why: a decode step and a verify window are bound by
reading the weights, and fp8 weights are half the bytes of bf16 ones. The kernels are
``lfmspark::skinny_linear``'s (ops/linear/skinny_linear.py) with their ``W_SCALE`` variant: the
fp8 tiles are upcast in registers and each column's fp32 sum is multiplied by its scale once, so
a product of fp8 weights costs no dequantized copy of them. The launch parameters, split-K, its
counters, ``side_stream`` and the row scale (``row_ssq``, ``eps``: the product of ``RMSNorm(s)``
from ``skinny_linear_add_norm``'s outputs) are those of ``skinny_linear``.

Reference (the CPU implementation and the oracle): dequantize the weight to ``x``'s dtype, then
``skinny_linear``'s reference, i.e. a bf16 product of the dequantized weight. The kernels do not
round the dequantized weight to ``x``'s dtype, so in bf16 the two differ by about one weight
rounding (relative ~2**-9 per weight, mostly averaged out in the sums).
"""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .skinny_linear import (MAX_M, SkinnyConfig, _check_row_ssq, _product, skinny_linear_reference)

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_problem(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> str | None:
    """Why ``skinny_linear_fp8`` cannot take these inputs, or None if it can."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
    if x.shape[0] > MAX_M:
        return f"skinny_linear_fp8 supports at most {MAX_M} rows, got M = {x.shape[0]}"
    if weight.dtype != FP8_WEIGHT_DTYPE:
        return f"weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}"
    if x.dtype not in _ACTIVATION_DTYPES:
        return f"x must be bfloat16, float16 or float32, got {x.dtype}"
    if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32 or not scale.is_contiguous():
        return (f"scale must be contiguous fp32 [N] = [{weight.shape[0]}] (one per output channel), got "
                f"{tuple(scale.shape)} in {scale.dtype}")
    if weight.stride(1) != 1:
        return "weight must be row-major (stride(1) == 1)"
    if not x.device == weight.device == scale.device:
        return f"x, weight and scale must be on one device, got {x.device}, {weight.device} and {scale.device}"
    return None


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if (problem := fp8_problem(x, weight, scale)) is not None:
        raise ValueError(problem)


def skinny_linear_fp8_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             config: SkinnyConfig | None = None, row_ssq: torch.Tensor | None = None,
                             eps: float = 0.0, side_stream: bool = False) -> torch.Tensor:
    """The op on the Triton kernels (``config``: launch override, for tests and tuning)."""
    _check(x, weight, scale)
    _check_row_ssq(x, row_ssq)
    return _product(x, weight, weight.shape[0], config, swiglu=False, row_ssq=row_ssq, eps=eps,
                    side_stream=side_stream, weight_scale=scale)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale[:, None]`` in fp32, rounded once to ``dtype``."""
    return (weight.float() * scale[:, None]).to(dtype)


def skinny_linear_fp8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                row_ssq: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return skinny_linear_reference(x, dequantize_weight(weight, scale, x.dtype), row_ssq, eps)


@torch.library.custom_op("lfmspark::skinny_linear_fp8", mutates_args=())
def skinny_linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_ssq: torch.Tensor | None = None,
                      eps: float = 0.0, side_stream: bool = False) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] * scale[:, None])^T`` -> ``[M, N]`` in ``x``'s dtype, for ``M <= 64``,
    ``weight`` float8 e4m3fn, ``scale`` fp32 per output channel. ``row_ssq``, ``eps``, ``side_stream``:
    as ``skinny_linear``'s."""
    if use_triton(x):
        return skinny_linear_fp8_triton(x, weight, scale, row_ssq=row_ssq, eps=eps, side_stream=side_stream)
    _check(x, weight, scale)   # the same limits on every device
    _check_row_ssq(x, row_ssq)
    return skinny_linear_fp8_reference(x, weight, scale, row_ssq, eps)


@skinny_linear_fp8.register_kernel("cuda")
def _skinny_linear_fp8_cuda(x, weight, scale, row_ssq=None, eps=0.0, side_stream=False):
    return skinny_linear_fp8_triton(x, weight, scale, row_ssq=row_ssq, eps=eps, side_stream=side_stream)


@skinny_linear_fp8.register_fake
def _skinny_linear_fp8_fake(x, weight, scale, row_ssq=None, eps=0.0, side_stream=False):
    _check(x, weight, scale)
    _check_row_ssq(x, row_ssq)
    return x.new_empty((x.shape[0], weight.shape[0]))
