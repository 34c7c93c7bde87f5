"""Add + RMSNorm + GEMV: ``s = h + delta``, ``y = rmsnorm(s) @ weight^T`` for one row, in one kernel.

Why: a batch-1 decode step is a chain of ~150 short kernels, and 33 of them (LFM2.5-1.2B: each
layer's ``operator_norm`` before ``in_proj``/``qkv_proj`` and ``ffn_norm`` before the gate/up GEMV,
plus the final norm before the LM head) are the residual add + RMSNorm that produce a one-row
GEMV's input. Here the GEMV does that work itself, as a prologue: every program recomputes the
normalised row (``K`` is the hidden size, 1024-2048 for the LFM2 models; ``h`` and ``delta`` come
from L2) and multiplies its own ``BLOCK_N`` weight rows with it. ``swiglu=True`` computes the dense
feed-forward's ``silu(gate) * up`` over a stacked ``[2F, K]`` gate/up weight instead, with the
activation in the epilogue (the roundings of ``skinny_swiglu``'s).

Design: each program owns ``BLOCK_N`` output columns (for ``swiglu``: ``BLOCK_N`` gate rows and the
matching up rows) and loads its whole ``[BLOCK_N, K]`` weight tile as one K block of
``next_power_of_2(K)`` (masked past ``K``), before the PDL wait, since no earlier kernel writes
weights; the norm weight likewise. After the wait it loads ``h`` and ``delta``, forms ``s``, its fp32
sum of squares and the normalised row, and multiply-accumulates. Program 0 stores ``s`` (all
programs compute the same values). ``K`` is capped at ``MAX_K = 8192`` (a whole row per program).

Numerics: those of the unfused modules (models/layers.py ``RMSNorm`` then ``F.linear``, HF eager):
``s = h + delta`` rounded to the dtype; fp32 statistics of the rounded ``s`` (``s * rsqrt(mean(s^2)
+ eps)``), cast to the dtype, times the norm weight in the dtype; fp32 dot products rounded once to
the dtype; for ``swiglu`` gate and up each rounded, ``silu(gate)`` rounded, the product rounded.
With ``scale_last`` (the feed-forward after ``ffn_norm``, and the products after a layer's norm:
models/layers.py) those of the several-row verify, which runs those norms in its products' epilogues:
``s * norm weight`` rounded once and the fp32 dot products scaled by ``rsqrt(mean(s^2) + eps)``. A
batch-1 decode step and a verify window then round each such product's input at the same point, so
speculation stays as close to target-only decoding in bf16 as the summation orders allow; the
modules round it once more (``s * rstd``), a difference within bf16 noise. The summation orders
differ from the reference's, so bf16 outputs may differ by an ulp. Static grid, no host sync:
CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from .skinny_linear import _load_w_block, row_rstd_reference, skinny_swiglu_reference
from ..routing import NORM_GEMV_MAX_K
from ..tuning import tuned

MAX_K = NORM_GEMV_MAX_K  # the whole row is one K block; LFM2 hidden sizes are 1024-2048
# from a sweep (benchmarks/kernels/add_rmsnorm_gemv.py --sweep), 1.2B shapes with 8
# warps: plain 8 columns (qkv 4.13 us vs 4.89 with 4; LM head 64.4 vs 64.7; in_proj 8.42 vs 8.25),
# SwiGLU 4 gate + 4 up columns (18.78 us vs 19.55 with 2 + 2); 16 warps lost everywhere
BLOCK_N_PLAIN = 8      # output columns per program
BLOCK_N_SWIGLU = 4     # gate columns per program, and as many up columns
NUM_WARPS = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _add_rmsnorm_gemv_kernel(
    h_ptr, d_ptr, nw_ptr, w_ptr, s_ptr, out_ptr,
    N, K, stride_wn, eps,
    HAS_DELTA: tl.constexpr, SWIGLU: tl.constexpr, SCALE_LAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    # N: output columns (for SWIGLU the gate/up width F: rows j and F + j of the weight)
    if PDL == 1:  # the next kernel's programs may launch now (ops/_dispatch.py)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (cols % N).to(tl.int64)                 # past N: a valid row, never stored
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w_ptrs = w_ptr + rows[:, None] * stride_wn + ks[None, :]
    # weights (the GEMV's and the norm's) depend on no earlier kernel: requested before the PDL wait
    w = _load_w_block(w_ptrs, 0, K, BLOCK_K, EVEN_K)
    if SWIGLU:
        wu = _load_w_block(w_ptrs + N * stride_wn, 0, K, BLOCK_K, EVEN_K)
    if EVEN_K:
        nw = tl.load(nw_ptr + ks)
    else:
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dtype = s_ptr.dtype.element_ty
    if EVEN_K:
        s = tl.load(h_ptr + ks)
    else:
        s = tl.load(h_ptr + ks, mask=k_ok, other=0.0)
    if HAS_DELTA:
        if EVEN_K:
            d = tl.load(d_ptr + ks)
        else:
            d = tl.load(d_ptr + ks, mask=k_ok, other=0.0)
        s = (s.to(tl.float32) + d.to(tl.float32)).to(dtype)   # the residual add, rounded as torch's
    if pid == 0:
        tl.store(s_ptr + ks, s, mask=k_ok)
    # RMSNorm: fp32 statistics of the rounded sum (masked columns are 0); then cast, times the
    # weight (the module's roundings), or with SCALE_LAST s * weight rounded once and the row scale
    # applied to the fp32 sums, the roundings of the several-row verify's epilogue pair
    # (ops/linear/skinny_linear.py ROW_NORM), so that a batch-1 decode step and a verify window compute
    # the feed-forward alike
    x32 = s.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / K + eps)
    if SCALE_LAST:
        xv = (nw.to(tl.float32) * x32).to(dtype).to(tl.float32)[None, :]
    else:
        xn = (x32 * inv).to(dtype).to(tl.float32)
        xv = (nw.to(tl.float32) * xn).to(dtype).to(tl.float32)[None, :]
    y = tl.sum(w.to(tl.float32) * xv, axis=1)
    if PDL == 2:  # the late trigger (ops/_dispatch.py): this program's weights are read
        tl.extra.cuda.gdc_launch_dependents()
    if SCALE_LAST:
        y = y * inv
    if SWIGLU:
        up = tl.sum(wu.to(tl.float32) * xv, axis=1)
        if SCALE_LAST:
            up = up * inv
        up = up.to(dtype).to(tl.float32)
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * up
    tl.store(out_ptr + cols, y.to(dtype), mask=cols < N)


# ---------------------------------------------------------------------------------------------
# launcher

def _check(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
           swiglu: bool) -> None:
    if h.dim() != 2 or h.shape[0] != 1:
        raise ValueError(f"add_rmsnorm_gemv takes one row h [1, K], got h of shape {tuple(h.shape)}")
    K = h.shape[1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"expected h [1, K] and weight [N, K], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"delta must have h's shape {tuple(h.shape)}, got {tuple(delta.shape)}")
    if norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be [K] = [{K}], got {tuple(norm_weight.shape)}")
    if not 1 <= K <= MAX_K:
        raise ValueError(f"add_rmsnorm_gemv supports 1 <= K <= {MAX_K} (one K block per row), got K = {K}")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"with swiglu, weight must stack gate and up rows ([2F, K]), got {weight.shape[0]} rows")
    if h.dtype not in _DTYPES:
        raise ValueError(f"h must be bf16, fp16 or fp32, got {h.dtype}")
    others = {"delta": None if delta is None else delta.dtype, "norm_weight": norm_weight.dtype,
              "weight": weight.dtype}
    for name, dt in others.items():
        if dt is not None and dt != h.dtype:
            raise ValueError(f"h and {name} must share a dtype, got {h.dtype} and {dt}")
    tensors = {"h": h, "delta": delta, "norm_weight": norm_weight, "weight": weight}
    for name, t in tensors.items():
        if t is not None and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous along K (stride(-1) == 1), got strides {t.stride()}")
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def launch_params(K: int, swiglu: bool, block_n: int | None = None, num_warps: int | None = None
                  ) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of a launch: ``block_n`` output columns per program (gate
    columns, each with its up column, for ``swiglu``; default ``BLOCK_N_PLAIN`` / ``BLOCK_N_SWIGLU``),
    the whole row as one K block, and ``NUM_WARPS`` by default (the swept best;
    ``benchmarks/kernels/add_rmsnorm_gemv.py --sweep`` times the alternatives; ``LFMSPARK_TUNE`` kinds
    ``norm_gemv`` / ``norm_swiglu`` replace the defaults, ops/tuning.py)."""
    kind = "norm_swiglu" if swiglu else "norm_gemv"
    block_n = block_n or tuned(kind, "block_n", BLOCK_N_SWIGLU if swiglu else BLOCK_N_PLAIN)
    if block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    block_k = max(16, triton.next_power_of_2(K))
    return block_n, block_k, num_warps or tuned(kind, "num_warps", NUM_WARPS)


def add_rmsnorm_gemv_triton(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, swiglu: bool, scale_last: bool = False, block_n: int | None = None,
                            num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the Triton kernel. ``block_n``: output columns per program (gate columns for
    ``swiglu``, each with its up column) and ``num_warps``: launch overrides for tuning (defaults:
    :func:`launch_params`)."""
    _check(h, delta, norm_weight, weight, swiglu)
    K = h.shape[1]
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    s = torch.empty_like(h, memory_format=torch.contiguous_format)
    out = torch.empty((1, N), dtype=h.dtype, device=h.device)
    block_n, block_k, num_warps = launch_params(K, swiglu, block_n, num_warps)
    if N == 0:                                     # no weight rows: only the sum
        s.copy_(h if delta is None else h + delta)
        return s, out
    _add_rmsnorm_gemv_kernel[(triton.cdiv(N, block_n),)](
        h, h if delta is None else delta, norm_weight, weight, s, out,
        N, K, weight.stride(0), float(eps),
        HAS_DELTA=delta is not None, SWIGLU=swiglu, SCALE_LAST=scale_last, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K == block_k,
        num_warps=num_warps, **pdl_kwargs(h, one_row_product=True),
    )
    return s, out


# ---------------------------------------------------------------------------------------------
# reference

def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models/layers.py ``RMSNorm.forward``, operation for operation."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rmsnorm_gemv_reference(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                               weight: torch.Tensor, swiglu: bool, scale_last: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused modules: residual add, ``RMSNorm``, ``F.linear`` (and ``silu(gate) * up``). With
    ``scale_last``, the several-row verify's epilogue pair instead (for SwiGLU:
    ``lfmspark::skinny_linear_add_norm``'s ``s * weight`` and row sum of squares, then
    ``lfmspark::skinny_swiglu`` with the row scale); the modules match it to one rounding of the
    normalised input."""
    s = h.clone() if delta is None else h + delta
    if scale_last:
        s32 = s.float()
        scaled, ssq = (s32 * norm_weight.float()).to(s.dtype), s32.pow(2).sum(-1)[None, :]
        if swiglu:
            return s, skinny_swiglu_reference(scaled, weight, ssq, eps)
        return s, (F.linear(scaled.float(), weight.float()) * row_rstd_reference(ssq, s.shape[-1], eps)).to(s.dtype)
    y = F.linear(rmsnorm_reference(s, norm_weight, eps), weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return s, y


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::add_rmsnorm_gemv", mutates_args=())
def add_rmsnorm_gemv(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, swiglu: bool, scale_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)`` for one row ``h [1, K]``: ``s = h + delta`` (a copy of ``h`` when ``delta`` is None)
    and ``y = rmsnorm(s) @ weight[N, K]^T`` ``[1, N]``, or with ``swiglu`` ``silu(gate) * up`` ``[1, F]``
    of the stacked ``weight [2F, K]``; all in ``h``'s dtype, ``K <= 8192``. ``scale_last``: the
    norm's weight in the input, its row scale on the fp32 sums (see the module doc)."""
    if use_triton(h):
        return add_rmsnorm_gemv_triton(h, delta, norm_weight, eps, weight, swiglu, scale_last)
    _check(h, delta, norm_weight, weight, swiglu)  # the same limits on every device
    return add_rmsnorm_gemv_reference(h, delta, norm_weight, eps, weight, swiglu, scale_last)


@add_rmsnorm_gemv.register_kernel("cuda")
def _add_rmsnorm_gemv_cuda(h, delta, norm_weight, eps, weight, swiglu, scale_last=False):
    return add_rmsnorm_gemv_triton(h, delta, norm_weight, eps, weight, swiglu, scale_last)


@add_rmsnorm_gemv.register_fake
def _add_rmsnorm_gemv_fake(h, delta, norm_weight, eps, weight, swiglu, scale_last=False):
    _check(h, delta, norm_weight, weight, swiglu)
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return torch.empty_like(h, memory_format=torch.contiguous_format), h.new_empty((1, N))
