"""Fused draft-context KV materialisation: K RMSNorm -> RoPE -> write K and V for several layers.

Input ``kv [B, T, n * 2 * KV]`` holds, per token and for each of ``n`` consecutive layers starting at
``first_layer``, ``[K_l (KV) | V_l (KV)]`` with ``KV = n_kv * head_dim`` (one GEMM of the projected
target context against all layers' stacked ``k_proj``/``v_proj`` weights produces it). For each
token and layer: per-head RMSNorm of K over ``head_dim`` with fp32 statistics, multiplied by the
layer's ``k_norm`` weight and **rounded to the activation dtype before rotation** (the unfused
path materialises it, reference/sglang.md §6.2), then RoPE at position ``start[b] + t`` with fp32
cos/sin and one final rounding, then K and V (unchanged) are stored at
``cache[layer, slots[b], start[b] + t]``. Only the first ``lens[b]`` columns of each row are written
(the commit mask), rows with slot ``-1`` are skipped, and positions past the cache are never written.

``is_neox`` picks the pairing (``(i, i + D/2)`` vs ``(2i, 2i + 1)``); one cos/sin table
(:func:`lfmspark.ops.rope.rope_cos_sin_table`) serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import use_triton
from .kv_write import window_positions, window_valid
from .rope import apply_rope, gather_cos_sin


# ---------------------------------------------------------------------------------------------
# kernels
#
# Rounding contract (bit-exact with the reference on CUDA in bf16): every fp32 operation below is
# the same operation, in the same order, as one eager torch kernel of the reference, and the
# launcher disables FMA contraction (``enable_fp_fusion=False``) so that ``a * b - c * d`` rounds
# each product like the separate torch kernels do. ``tl.math.rsqrt`` is the hardware approximate
# rsqrt (MUFU.RSQ), the instruction behind ``torch.rsqrt`` on CUDA; ``1 / sqrt`` would round twice.
# The only sum is ``mean(x^2)``, added in the order of torch's CUDA reduction (see ``_sum_squares``).

_LANES = tl.constexpr(32)  # a warp: torch's CUDA reduction folds a row down to this many partial sums


@triton.jit
def _sum_squares(lo, hi, HALF: tl.constexpr):
    """``sum(x^2)`` in fp32 of one head given as its halves ``lo = x[:HALF]``, ``hi = x[HALF:]``.

    Added in the order of torch's CUDA reduction of a contiguous row (``Reduce.cuh``): fold the row
    in halves down to 32 lanes (lane ``j`` holds ``x[j]^2 + x[j + 32]^2`` for ``head_dim = 64``), then a
    pairwise tree over the lanes in natural order (the ``shfl_down`` offsets 1, 2, 4, ...). For
    ``head_dim <= 64`` torch uses this order for any number of rows, so the statistic is bit-identical;
    for larger heads torch's order depends on the number of rows and may differ in the last fp32 bit.
    """
    if HALF >= _LANES:
        y = lo * lo + hi * hi                                  # [HALF]: the first fold
        for f in tl.static_range(1, 8):
            if (HALF >> f) >= _LANES:                          # further folds: y[j] + y[j + W/2]
                y = tl.sum(tl.reshape(y, [2, HALF >> f]), axis=0)
        W: tl.constexpr = _LANES
    else:
        # fewer than 32 elements: one lane each, x^2 in natural order
        y = tl.reshape(tl.permute(tl.join(lo * lo, hi * hi), (1, 0)), [2 * HALF])
        W: tl.constexpr = 2 * HALF
    for f in tl.static_range(1, 8):
        if (W >> f) >= 1:                                      # tree level: y[2j] + y[2j + 1]
            y = tl.sum(tl.reshape(y, [W >> f, 2]), axis=1)
    return tl.sum(y, axis=0)


@triton.jit
def _norm_weight(x, r, w, ACT: tl.constexpr):
    """``round(round(x * r) * w)`` in the activation dtype, returned as fp32 (``w`` already in ``ACT``)."""
    k_hat = (x * r).to(ACT).to(tl.float32)
    return (k_hat * w.to(tl.float32)).to(ACT).to(tl.float32)


@triton.jit
def _kv_norm_rope_write_kernel(
    kv_ptr, w_ptr, cs_ptr, kc_ptr, vc_ptr, slots_ptr, start_ptr, lens_ptr,
    T, S, P, first_layer, eps,
    stride_xb, stride_xt, stride_wl, stride_cs,
    stride_kl, stride_ks, stride_kp, stride_kh,
    stride_vl, stride_vs, stride_vp, stride_vh,
    N_KV: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    # one program per (token, layer): all kv heads of one token of one layer
    tok = tl.program_id(0)
    i = tl.program_id(1)
    b = tok // T
    t = tok % T
    slot = tl.load(slots_ptr + b)
    pos = tl.load(start_ptr + b) + t
    ok = (slot >= 0) & (t < tl.load(lens_ptr + b)) & (pos < S)
    HALF: tl.constexpr = HD // 2
    ACT: tl.constexpr = kv_ptr.dtype.element_ty

    # a skipped token loads and stores nothing: the scalar condition folds into the bounds
    # (`vector & scalar` masks break the interpreter)
    j = tl.arange(0, HALF)
    mj = j < tl.where(ok, HALF, 0)
    d = tl.arange(0, HD)
    md = d < tl.where(ok, HD, 0)
    # the two elements of pair j: (j, j + HD/2) for neox, (2j, 2j + 1) interleaved
    if IS_NEOX:
        e1 = j
        e2 = j + HALF
    else:
        e1 = 2 * j
        e2 = 2 * j + 1

    layer = (first_layer + i).to(tl.int64)
    w_row = w_ptr + layer * stride_wl
    w1 = tl.load(w_row + e1, mask=mj, other=0.0).to(ACT)
    w2 = tl.load(w_row + e2, mask=mj, other=0.0).to(ACT)
    cs_row = cs_ptr + tl.minimum(tl.maximum(pos, 0), P - 1).to(tl.int64) * stride_cs  # clamped as the reference
    cos = tl.load(cs_row + j, mask=mj, other=0.0)
    sin = tl.load(cs_row + HALF + j, mask=mj, other=0.0)

    src = kv_ptr + b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xt + i.to(tl.int64) * (2 * N_KV * HD)
    k_dst = kc_ptr + layer * stride_kl + slot.to(tl.int64) * stride_ks + pos.to(tl.int64) * stride_kp
    v_dst = vc_ptr + layer * stride_vl + slot.to(tl.int64) * stride_vs + pos.to(tl.int64) * stride_vp
    for h in tl.static_range(N_KV):
        k_src = src + h * HD
        # RMS statistic from the contiguous halves (the order _sum_squares needs) ...
        lo = tl.load(k_src + j, mask=mj, other=0.0).to(tl.float32)
        hi = tl.load(k_src + HALF + j, mask=mj, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(_sum_squares(lo, hi, HALF) * (1.0 / HD) + eps)
        # ... and the rotation pairs (interleaved: the even/odd elements, re-read from L1)
        if IS_NEOX:
            x1 = lo
            x2 = hi
        else:
            x1 = tl.load(k_src + e1, mask=mj, other=0.0).to(tl.float32)
            x2 = tl.load(k_src + e2, mask=mj, other=0.0).to(tl.float32)
        k1 = _norm_weight(x1, r, w1, ACT)
        k2 = _norm_weight(x2, r, w2, ACT)
        o1 = k1 * cos - k2 * sin
        o2 = k2 * cos + k1 * sin
        tl.store(k_dst + h * stride_kh + e1, o1.to(kc_ptr.dtype.element_ty), mask=mj)
        tl.store(k_dst + h * stride_kh + e2, o2.to(kc_ptr.dtype.element_ty), mask=mj)
        v = tl.load(src + N_KV * HD + h * HD + d, mask=md)
        tl.store(v_dst + h * stride_vh + d, v.to(vc_ptr.dtype.element_ty), mask=md)


# ---------------------------------------------------------------------------------------------
# launcher

def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def kv_norm_rope_write_triton(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, first_layer: int,
                              slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                              eps: float, is_neox: bool) -> None:
    B, T, width = kv.shape
    n_kv, hd = k_cache.shape[-2:]
    n = width // (2 * n_kv * hd)
    if hd < 2 or hd & (hd - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {hd}")
    if width != n * 2 * n_kv * hd:
        raise ValueError(f"kv width {width} is not a multiple of 2 * n_kv * head_dim = {2 * n_kv * hd}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")  # written in place: no copy
    if B * T * n == 0:
        return
    kv = _inner_contiguous(kv)
    weight = _inner_contiguous(k_norm_weight)
    cos_sin = _inner_contiguous(cos_sin)
    # (B*T, n): index tensors are read on the device only, so the launch is graph-capturable
    _kv_norm_rope_write_kernel[(B * T, n)](
        kv, weight, cos_sin, k_cache, v_cache, slots, start, lens,
        T, k_cache.shape[2], cos_sin.shape[0], first_layer, eps,
        kv.stride(0), kv.stride(1), weight.stride(0), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        N_KV=n_kv, HD=hd, IS_NEOX=is_neox,
        num_warps=1,
        enable_fp_fusion=False,  # no FMA contraction: products round as in the reference
    )


# ---------------------------------------------------------------------------------------------
# reference

def kv_norm_rope_write_reference(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, first_layer: int,
                                 slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                                 eps: float, is_neox: bool) -> None:
    B, T, width = kv.shape
    n_kv, hd = k_cache.shape[-2:]
    n = width // (2 * n_kv * hd)
    x = kv.view(B, T, n, 2, n_kv, hd)
    k, v = x[:, :, :, 0], x[:, :, :, 1]                       # [B, T, n, n_kv, hd]
    k32 = k.float()
    k_hat = (k32 * torch.rsqrt(k32.pow(2).mean(-1, keepdim=True) + eps)).to(kv.dtype)
    w = k_norm_weight[first_layer:first_layer + n].to(kv.dtype)
    k_n = k_hat * w[None, None, :, None, :]                   # rounded to the activation dtype
    cos, sin = gather_cos_sin(cos_sin, window_positions(start, T))    # [B, T, hd/2]
    k_r = apply_rope(k_n.float(), cos[:, :, None, None], sin[:, :, None, None], is_neox)

    valid = window_valid(slots, start, lens, T, k_cache.shape[2])
    b, t = valid.nonzero(as_tuple=True)
    pos = window_positions(start, T)[b, t]
    for i in range(n):
        layer = first_layer + i
        k_cache[layer, slots[b], pos] = k_r[b, t, i].to(k_cache.dtype)
        v_cache[layer, slots[b], pos] = v[b, t, i].to(v_cache.dtype)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::kv_norm_rope_write", mutates_args=("k_cache", "v_cache"))
def kv_norm_rope_write(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, first_layer: int,
                       slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                       eps: float, is_neox: bool) -> None:
    """``kv [B, T, n*2*KV]`` -> normed, rotated K and raw V in layers ``first_layer .. +n`` of
    ``k_cache``/``v_cache [L, slots, S, n_kv, hd]``; ``k_norm_weight [L, hd]``, ``cos_sin [P, hd]`` fp32."""
    if use_triton(kv):
        kv_norm_rope_write_triton(kv, k_norm_weight, cos_sin, k_cache, v_cache, first_layer, slots, start, lens,
                                  eps, is_neox)
    else:
        kv_norm_rope_write_reference(kv, k_norm_weight, cos_sin, k_cache, v_cache, first_layer, slots, start,
                                     lens, eps, is_neox)


@kv_norm_rope_write.register_kernel("cuda")
def _kv_norm_rope_write_cuda(kv, k_norm_weight, cos_sin, k_cache, v_cache, first_layer, slots, start, lens,
                             eps, is_neox) -> None:
    kv_norm_rope_write_triton(kv, k_norm_weight, cos_sin, k_cache, v_cache, first_layer, slots, start, lens,
                              eps, is_neox)


@kv_norm_rope_write.register_fake
def _kv_norm_rope_write_fake(kv, k_norm_weight, cos_sin, k_cache, v_cache, first_layer, slots, start, lens,
                             eps, is_neox) -> None:
    return None
