"""Batch-invariant RMSNorm (exact mode): HF LFM2's RMSNorm of each row of ``x [M, H]``,
computed with the same arithmetic whatever ``M`` is.

Why: the default path leaves the norms to Inductor (or fuses them into the products' prologues and
epilogues, ops/routing.py), whose reduction strategy for a row may follow the graph it sits in, so a
token's statistics can differ between a decode step and a verify window. Here one program reduces
one row, always with the same block and warp count for a given ``H``: a row's bits depend on that
row alone. ``lfmspark::exact_add_rms_norm`` adds the residual first, in the same launch: the sum
rounded once, as the separate add would round it, so its norm has the same bits as that add followed by
``exact_rms_norm`` (one launch fewer before each of exact mode's normed products).

Semantics (models/layers.py ``RMSNorm``): fp32 mean of squares, ``x * rsqrt(mean + eps)`` in fp32,
rounded to ``x``'s dtype, then multiplied by the weight (the product rounded to ``x``'s dtype, as a
bf16 multiply in PyTorch is). The sum of squares runs in Triton's reduction order, not PyTorch's,
so the statistics may differ from the reference in the last fp32 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton


@triton.jit(do_not_specialize=["M"])
def _exact_rms_norm_kernel(x_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, H, eps, stride_x, stride_d, stride_s, stride_o,
                           BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: the weight first, then wait for x
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual add first, rounded once as PyTorch's (and Inductor's) add of two tensors is
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, x, mask=ok)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"expected x [M, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")


def _check_add(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> None:
    _check(h, weight)
    if delta.shape != h.shape:
        raise ValueError(f"expected h and delta of one shape, got {tuple(h.shape)} and {tuple(delta.shape)}")
    if len({h.dtype, delta.dtype, weight.dtype}) != 1:
        raise ValueError(f"exact mode needs one dtype: h {h.dtype}, delta {delta.dtype}, RMSNorm weight {weight.dtype}")


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    M, H = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()   # before the outputs: they take x's layout (row-major)
    out = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else out
    if out.numel() == 0:
        return s, out
    d = x if delta is None else (delta if delta.stride(1) == 1 else delta.contiguous())
    _exact_rms_norm_kernel[(M,)](x, d, s, weight, out, M, H, eps, x.stride(0), d.stride(0), s.stride(0), out.stride(0),
                                 BLOCK=triton.next_power_of_2(H), HAS_DELTA=delta is not None, num_warps=4,
                                 **pdl_kwargs(x))
    return s, out


def exact_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return _launch(x, None, weight, eps)[1]


def exact_add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_add(h, delta, weight)
    return _launch(h, delta, weight, eps)


def exact_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models/layers.py ``RMSNorm`` (the oracle of the tests)."""
    _check(x, weight)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * x32.to(x.dtype)


@torch.library.custom_op("lfmspark::exact_rms_norm", mutates_args=())
def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x [M, H]`` with ``weight [H]``, each row's bits independent of the other
    rows (module doc); the CPU reference otherwise (``LFMSPARK_TRITON_ON_CPU=1``: the kernel)."""
    if use_triton(x):
        return exact_rms_norm_triton(x, weight, eps)
    return exact_rms_norm_reference(x, weight, eps)


@exact_rms_norm.register_kernel("cuda")
def _exact_rms_norm_cuda(x, weight, eps):
    return exact_rms_norm_triton(x, weight, eps)


@exact_rms_norm.register_fake
def _exact_rms_norm_fake(x, weight, eps):
    _check(x, weight)
    return torch.empty_like(x)


def exact_add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then :func:`exact_rms_norm_reference` of the sum (the modules' order)."""
    _check_add(h, delta, weight)
    s = h + delta
    return s, exact_rms_norm_reference(s, weight, eps)


@torch.library.custom_op("lfmspark::exact_add_rms_norm", mutates_args=())
def exact_add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s) * weight)`` with ``s = h + delta`` for rows ``[M, H]``: the residual add and
    exact mode's RMSNorm in one launch, the same bits as the add followed by ``exact_rms_norm``
    (each row's independent of the other rows)."""
    if use_triton(h):
        return exact_add_rms_norm_triton(h, delta, weight, eps)
    return exact_add_rms_norm_reference(h, delta, weight, eps)


@exact_add_rms_norm.register_kernel("cuda")
def _exact_add_rms_norm_cuda(h, delta, weight, eps):
    return exact_add_rms_norm_triton(h, delta, weight, eps)


@exact_add_rms_norm.register_fake
def _exact_add_rms_norm_fake(h, delta, weight, eps):
    _check_add(h, delta, weight)
    return torch.empty_like(h), torch.empty_like(h)
