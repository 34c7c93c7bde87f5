"""Fused per-head RMSNorm -> RoPE -> KV-cache write: the DSpark draft context (K and V of several
layers), and the target attention's q, k and v (one layer).

Draft context: input ``kv [B, T, n * 2 * KV]`` holds, per token and for each of ``n`` consecutive layers starting at
``first_layer``, ``[K_l (KV) | V_l (KV)]`` with ``KV = n_kv * head_dim`` (one GEMM of the projected
target context against all layers' stacked ``k_proj``/``v_proj`` weights produces it). For each
token and layer: per-head RMSNorm of K over ``head_dim`` with fp32 statistics, multiplied by the
layer's ``k_norm`` weight and **rounded to the activation dtype before rotation** (the unfused
path materialises it, reference/sglang.md §6.2), then RoPE at position ``start[b] + t`` with fp32
cos/sin and one final rounding, then K and V (unchanged) are stored at position ``start[b] + t`` of slot
``slots[b]`` in the paged caches ``k_cache``/``v_cache [L, n_pages, page_size, n_kv, hd]``: at
``cache[layer, page_table[slots[b], pos // page_size], pos % page_size]`` (the layout:
ops/attention/cache_attention.py). Only the first ``lens[b]`` columns of each row are written (the
commit mask), rows with slot ``-1`` are skipped, and positions at or past the slot length
``S = page_table.shape[1] * page_size`` are never written; a skipped token reads no table entry.

``lfmspark::qkv_norm_rope_write`` is the target attention's variant: one layer, K and V taken from
the fused ``qkv`` projection, and the queries normalised and rotated by the same program (with
their own norm weight) and returned, so the step between the qkv projection and the attention is
one launch instead of three (Inductor's q and k norm + RoPE kernels and the K/V write).

``is_neox`` picks the pairing (``(i, i + D/2)`` vs ``(2i, 2i + 1)``); one cos/sin table
(:func:`lfmspark.ops.attention.rope.rope_cos_sin_table`) serves both.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from .cache_attention import slot_length
from .rope import apply_rope, gather_cos_sin, window_positions


# ---------------------------------------------------------------------------------------------
# kernels
#
# Rounding contract (bit-exact with the reference on CUDA, bf16 / fp16 / fp32): every fp32 operation
# below is the same operation, in the same order, as one eager torch kernel of the reference, and the
# launcher disables FMA contraction (``enable_fp_fusion=False``) so that ``a * b - c * d`` rounds each
# product like the separate torch kernels do. ``tl.math.rsqrt`` is the hardware approximate rsqrt,
# the instruction behind ``torch.rsqrt`` on CUDA (identical on 10^6 rows tested on the GPU, where
# ``1 / sqrt`` and ``1 / sqrt_rn`` differed in ~40% of them). The only sum, ``mean(x^2)``, is added in the order
# of torch's CUDA reduction (see ``_halving_sum``).

# Triton's interpreter truncates fp32 -> bf16 casts (and its "rtne" mode mishandles the carry), which
# compounds over this kernel's three roundings; under the interpreter ``_round`` rounds bf16 by hand.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DTYPE`` (as torch's ``.to(dtype)``)."""
    if _INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)               # round the low 16 bits, ties to even
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x == x, y, x.to(tl.bfloat16))             # NaN stays NaN
    else:
        y = x.to(DTYPE)                                         # cvt.rn on the GPU
    return y


@triton.jit
def _halving_sum(y, BLOCK_H: tl.constexpr, W: tl.constexpr):
    """Row sums ``[BLOCK_H]`` of ``y [BLOCK_H, W]`` in the order of torch's CUDA reduction of ``x^2``.

    torch reduces a contiguous row of up to 64 elements (``Reduce.cuh``: one value per lane, or two
    added as ``x[j] + x[j + 32]``, then the shared-memory step and ``shfl_down`` with decreasing
    offsets) by adding the upper half of the partial sums onto the lower half until one is left. ``y``
    is the squared row after its first such step (``x[j]^2 + x[j + W]^2``). For ``head_dim <= 64``
    torch uses this order whatever the number of rows (bit-identical on the GPU at 16, 32 and 64);
    from 128 on it first sums contiguous runs per lane, so the statistic may differ in its last bit.
    """
    for f in tl.static_range(1, 8):
        if (W >> f) >= 1:                                      # y[j] + y[j + w/2], w = W >> (f - 1)
            y = tl.sum(tl.reshape(y, [BLOCK_H, 2, W >> f]), axis=1)
    return tl.sum(y, axis=1)


@triton.jit
def _norm_weight(x, r, w, ACT: tl.constexpr):
    """``round(round(x * r) * w)`` in the activation dtype ``ACT``, returned as fp32 (``w``: fp32 holding
    an ``ACT`` value, so the product is exact before its one rounding)."""
    k_hat = _round(x * r, ACT).to(tl.float32)
    return _round(k_hat * w, ACT).to(tl.float32)


@triton.jit
def _load_halves(src, rows_ok, HD: tl.constexpr):
    """The raw heads at ``src [R, 1]`` (pointers to each head's first of ``HD`` contiguous values) as
    their element halves ``(x[:, :HD/2], x[:, HD/2:])``, zeros where not ``rows_ok [R, 1]``. Loading is
    separate from :func:`_norm_rope_halves` so a kernel can request all its loads before it computes."""
    HALF: tl.constexpr = HD // 2
    j = tl.arange(0, HALF)[None, :]
    m = rows_ok & (j < HALF)
    return tl.load(src + j, mask=m, other=0.0), tl.load(src + HALF + j, mask=m, other=0.0)


@triton.jit
def _pair_weights(w_row, w_live, HD: tl.constexpr, IS_NEOX: tl.constexpr, ACT: tl.constexpr):
    """The norm weight's elements of each rotation pair ``j`` (``(j, j + HD/2)`` for neox, ``(2j, 2j + 1)``
    interleaved) as fp32 ``[1, HD/2]`` holding ``ACT`` values; ``w_live == 0`` loads nothing."""
    HALF: tl.constexpr = HD // 2
    j = tl.arange(0, HALF)[None, :]
    mj = j < tl.where(w_live > 0, HALF, 0)
    if IS_NEOX:
        e1 = j
        e2 = j + HALF
    else:
        e1 = 2 * j
        e2 = 2 * j + 1
    w1 = _round(tl.load(w_row + e1, mask=mj, other=0.0).to(tl.float32), ACT).to(tl.float32)
    w2 = _round(tl.load(w_row + e2, mask=mj, other=0.0).to(tl.float32), ACT).to(tl.float32)
    return w1, w2


@triton.jit
def _norm_rope_halves(xa, xb, w1, w2, cos, sin, eps,
                      R: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr, ACT: tl.constexpr):
    """Per-head RMSNorm and RoPE of ``R`` heads given as element halves ``xa, xb [R, HD/2]``
    (:func:`_load_halves`), with the pair weights ``w1, w2`` (:func:`_pair_weights`) and ``cos``/``sin``
    broadcastable to ``[R, HD/2]``. Returns the rotated pair halves ``(o1, o2)`` in fp32, before their
    final rounding (pair ``j``: elements ``(j, j + HD/2)`` for neox, ``(2j, 2j + 1)`` interleaved)."""
    HALF: tl.constexpr = HD // 2
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    y = xa * xa + xb * xb                                      # x[j]^2 + x[j + HD/2]^2: torch's first step
    if IS_NEOX:
        x1 = xa
        x2 = xb
    else:                                                      # even, odd elements of the whole head
        x1, x2 = tl.split(tl.reshape(tl.reshape(tl.permute(tl.join(xa, xb), (0, 2, 1)), [R, HD]), [R, HALF, 2]))
    r = tl.math.rsqrt(_halving_sum(y, R, HALF) * (1.0 / HD) + eps)[:, None]
    k1 = _norm_weight(x1, r, w1, ACT)
    k2 = _norm_weight(x2, r, w2, ACT)
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


@triton.jit
def _join_pairs(o1, o2, R: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr):
    """The ``[R, HD]`` heads, in element order, of pair halves ``o1, o2 [R, HD/2]`` (:func:`_norm_rope_halves`)."""
    if IS_NEOX:
        x = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), [R, HD])
    else:
        x = tl.reshape(tl.join(o1, o2), [R, HD])
    return x


@triton.jit
def _norm_rope_store(src, w_row, cos, sin, dst, stride_dh, eps, n_heads,
                     BLOCK_H: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr, ACT: tl.constexpr):
    """:func:`_norm_rope_halves` of the first ``n_heads`` heads at ``src`` (contiguous, ``HD`` apart), stored
    at ``dst`` (heads ``stride_dh`` apart) in ``dst``'s dtype; ``n_heads == 0`` loads and stores nothing."""
    HALF: tl.constexpr = HD // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    d = tl.arange(0, HD)[None, :]
    mh = h < n_heads
    xa, xb = _load_halves(src + h * HD, mh, HD)
    w1, w2 = _pair_weights(w_row, n_heads, HD, IS_NEOX, ACT)
    o1, o2 = _norm_rope_halves(xa, xb, w1, w2, cos, sin, eps, BLOCK_H, HD, IS_NEOX, ACT)
    dst = dst + h * stride_dh
    if IS_NEOX:
        m = mh & (j < HALF)
        tl.store(dst + j, _round(o1, dst.dtype.element_ty), mask=m)
        tl.store(dst + HALF + j, _round(o2, dst.dtype.element_ty), mask=m)
    else:
        o = tl.reshape(tl.join(o1, o2), [BLOCK_H, HD])          # re-interleave
        tl.store(dst + d, _round(o, dst.dtype.element_ty), mask=mh & (d < HD))


@triton.jit
def _kv_norm_rope_write_kernel(
    kv_ptr, w_ptr, cs_ptr, kc_ptr, vc_ptr, pt_ptr, slots_ptr, start_ptr, lens_ptr, q_ptr, qw_ptr, q_out_ptr,
    T, S, P, first_layer, eps,
    stride_xb, stride_xt, stride_wl, stride_cs, stride_qb, stride_qt, stride_pt,
    stride_kl, stride_kpage, stride_kp, stride_kh,
    stride_vl, stride_vpage, stride_vp, stride_vh,
    N_KV: tl.constexpr, BLOCK_H: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr,
    N_Q: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # One program per (token, layer): all kv heads of the token at once, as [BLOCK_H, HD/2] tiles, so
    # the whole token is loaded before anything is stored (a loop over heads serialises a load ->
    # store latency chain per head: 2.1x slower at prefill). With N_Q > 0 (one layer)
    # the program also normalises and rotates the token's N_Q query heads into q_out [B, T, N_Q, HD]:
    # every token, written or not (the attention reads every query row).
    tok = tl.program_id(0)
    i = tl.program_id(1)
    b = tok // T
    t = tok % T
    slot = tl.load(slots_ptr + b)
    pos = tl.load(start_ptr + b) + t
    ok = (slot >= 0) & (t < tl.load(lens_ptr + b)) & (pos < S)
    # the position's page, through the slot's page table row (a skipped token reads no entry)
    page = tl.load(pt_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pt + pos // PAGE, mask=ok, other=0)
    HALF: tl.constexpr = HD // 2
    ACT: tl.constexpr = kv_ptr.dtype.element_ty
    j = tl.arange(0, HALF)[None, :]
    d = tl.arange(0, HD)[None, :]

    cs_row = cs_ptr + tl.minimum(tl.maximum(pos, 0), P - 1).to(tl.int64) * stride_cs  # clamped as the reference
    if N_Q > 0:
        cos = tl.load(cs_row + j)
        sin = tl.load(cs_row + HALF + j)
        q_src = q_ptr + b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt
        q_dst = q_out_ptr + tok.to(tl.int64) * (N_Q * HD)
        _norm_rope_store(q_src, qw_ptr, cos, sin, q_dst, HD, eps, N_Q, BLOCK_Q, HD, IS_NEOX, ACT)
    else:
        # a skipped token loads and stores nothing: the scalar condition folds into the bounds
        # (`vector & scalar` masks break the interpreter; vector & vector is fine)
        mj = j < tl.where(ok, HALF, 0)
        cos = tl.load(cs_row + j, mask=mj, other=0.0)
        sin = tl.load(cs_row + HALF + j, mask=mj, other=0.0)

    layer = (first_layer + i).to(tl.int64)
    n_heads = tl.where(ok, N_KV, 0)
    k_src = kv_ptr + b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xt + i.to(tl.int64) * (2 * N_KV * HD)
    cell = pos % PAGE
    k_dst = kc_ptr + layer * stride_kl + page.to(tl.int64) * stride_kpage + cell * stride_kp
    _norm_rope_store(k_src, w_ptr + layer * stride_wl, cos, sin, k_dst, stride_kh, eps, n_heads,
                     BLOCK_H, HD, IS_NEOX, ACT)
    h = tl.arange(0, BLOCK_H)[:, None]
    md = (h < n_heads) & (d < HD)
    v = tl.load(k_src + N_KV * HD + h * HD + d, mask=md)
    v_dst = vc_ptr + layer * stride_vl + page.to(tl.int64) * stride_vpage + cell * stride_vp + h * stride_vh
    tl.store(v_dst + d, v.to(vc_ptr.dtype.element_ty), mask=md)


# ---------------------------------------------------------------------------------------------
# launcher

_NUM_WARPS = 1  # a token's 8 x 64 K/V values per program: 1 and 2 warps tie, 4 and 8 are slower
_QKV_NUM_WARPS = 4  # with the token's query heads too (32 x 64 on LFM2): 4x the values per program


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_heads(n_kv: int, hd: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if hd < 2 or hd & (hd - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {hd}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")  # written in place: no copy


def _launch(kv: torch.Tensor, k_norm_weight: torch.Tensor, stride_wl: int, cos_sin: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, S: int, first_layer: int,
            n: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, eps: float, is_neox: bool,
            q: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
            q_out: torch.Tensor | None = None) -> None:
    B, T = kv.shape[:2]
    n_kv, hd = k_cache.shape[-2:]
    cos_sin = _inner_contiguous(cos_sin)
    n_q = q_out.shape[2] if q_out is not None else 0
    if q is None:  # unused pointers (N_Q = 0)
        q, q_norm_weight, q_out = kv, k_norm_weight, kv
    # (B*T, n): index tensors are read on the device only, so the launch is graph-capturable
    _kv_norm_rope_write_kernel[(B * T, n)](
        kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, slots, start, lens, q, q_norm_weight, q_out,
        T, S, cos_sin.shape[0], first_layer, eps,
        kv.stride(0), kv.stride(1), stride_wl, cos_sin.stride(0), q.stride(0), q.stride(1), page_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        N_KV=n_kv, BLOCK_H=triton.next_power_of_2(n_kv), HD=hd, IS_NEOX=is_neox,
        N_Q=n_q, BLOCK_Q=triton.next_power_of_2(max(n_q, 1)), PAGE=k_cache.shape[2],
        num_warps=_NUM_WARPS if n_q == 0 else _QKV_NUM_WARPS, **pdl_kwargs(kv),
        enable_fp_fusion=False,  # no FMA contraction: products round as in the reference
    )


def kv_norm_rope_write_triton(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                              first_layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                              eps: float, is_neox: bool) -> None:
    B, T, width = kv.shape
    n_kv, hd = k_cache.shape[-2:]
    n = width // (2 * n_kv * hd)
    _check_heads(n_kv, hd, k_cache, v_cache)
    S = slot_length(k_cache, v_cache, page_table)
    if width != n * 2 * n_kv * hd:
        raise ValueError(f"kv width {width} is not a multiple of 2 * n_kv * head_dim = {2 * n_kv * hd}")
    if B * T * n == 0:
        return
    weight = _inner_contiguous(k_norm_weight)
    _launch(_inner_contiguous(kv), weight, weight.stride(0), cos_sin, k_cache, v_cache, page_table, S, first_layer, n,
            slots, start, lens, eps, is_neox)


def _split_qkv(qkv: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """``(n_q, n_kv, head_dim)`` of a ``[B, T, (n_q + 2 n_kv) * head_dim]`` projection."""
    if qkv.dim() != 3:
        raise ValueError(f"expected qkv [B, T, (n_q + 2 n_kv) * head_dim], got {tuple(qkv.shape)}")
    n_kv, hd = k_cache.shape[-2:]
    width = qkv.shape[-1] - 2 * n_kv * hd
    n_q = width // hd
    if width % hd or n_q < 1:
        raise ValueError(f"qkv width {qkv.shape[-1]} is not (n_q + 2 * {n_kv}) * {hd} for any n_q >= 1")
    return n_q, n_kv, hd


def qkv_norm_rope_write_triton(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                               cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, layer: int, slots: torch.Tensor, start: torch.Tensor,
                               lens: torch.Tensor, eps: float, is_neox: bool) -> torch.Tensor:
    B, T, _ = qkv.shape
    n_q, n_kv, hd = _split_qkv(qkv, k_cache)
    _check_heads(n_kv, hd, k_cache, v_cache)
    S = slot_length(k_cache, v_cache, page_table)
    q_out = torch.empty((B, T, n_q, hd), dtype=qkv.dtype, device=qkv.device)
    if B * T == 0:
        return q_out
    qkv = _inner_contiguous(qkv)
    # the layer's one weight row serves every program (row stride 0)
    _launch(qkv[..., n_q * hd:], _inner_contiguous(k_norm_weight), 0, cos_sin, k_cache, v_cache, page_table, S, layer,
            1, slots, start, lens, eps, is_neox, q=qkv, q_norm_weight=_inner_contiguous(q_norm_weight), q_out=q_out)
    return q_out


# ---------------------------------------------------------------------------------------------
# reference

def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               is_neox: bool) -> torch.Tensor:
    """Per-head RMSNorm of ``x [..., hd]`` (fp32 statistics, rounded to ``x``'s dtype, times ``weight`` in
    that dtype), then RoPE in fp32: the fp32 result, rounded once by the caller."""
    x32 = x.float()
    x_hat = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return apply_rope((x_hat * weight.to(x.dtype)).float(), cos, sin, is_neox)


def _write_window(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, first_layer: int, slots: torch.Tensor, start: torch.Tensor,
                  lens: torch.Tensor) -> None:
    """Store ``k, v [B, T, n, n_kv, hd]`` at position ``start[b] + t`` of slot ``slots[b]`` in layers
    ``first_layer + i`` of the paged caches, for ``t < lens[b]`` and positions below the slot length,
    skipping rows with slot ``-1``: one indexed store per row, every layer at once."""
    T, n = k.shape[1], k.shape[2]
    page = k_cache.shape[2]
    layers = slice(first_layer, first_layer + n)
    for b, (slot, s0, n_b) in enumerate(zip(slots.tolist(), start.tolist(), lens.tolist())):
        n_b = min(n_b, T, page_table.shape[1] * page - s0)
        if slot >= 0 and n_b > 0:
            pos = torch.arange(s0, s0 + n_b, device=page_table.device)
            pages, cells = page_table[slot, pos // page].long(), pos % page
            k_cache[layers, pages, cells] = k[b, :n_b].transpose(0, 1).to(k_cache.dtype)   # [n, n_b, n_kv, hd]
            v_cache[layers, pages, cells] = v[b, :n_b].transpose(0, 1).to(v_cache.dtype)


def kv_norm_rope_write_reference(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                                 first_layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                                 eps: float, is_neox: bool) -> None:
    B, T, width = kv.shape
    n_kv, hd = k_cache.shape[-2:]
    n = width // (2 * n_kv * hd)
    x = kv.view(B, T, n, 2, n_kv, hd)
    k, v = x[:, :, :, 0], x[:, :, :, 1]                       # [B, T, n, n_kv, hd]
    cos, sin = gather_cos_sin(cos_sin, window_positions(start, T))    # [B, T, hd/2]
    w = k_norm_weight[first_layer:first_layer + n, None, :]   # [n, 1, hd]: each layer's weight, every head
    k_r = _norm_rope(k, w, cos[:, :, None, None], sin[:, :, None, None], eps, is_neox)
    _write_window(k_r, v, k_cache, v_cache, page_table, first_layer, slots, start, lens)


def qkv_norm_rope_write_reference(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  page_table: torch.Tensor, layer: int, slots: torch.Tensor, start: torch.Tensor,
                                  lens: torch.Tensor, eps: float, is_neox: bool) -> torch.Tensor:
    """The target attention's unfused path: ``RMSNorm`` of q and k per head (models/layers.py),
    RoPE in fp32 with one rounding, K and V written as :func:`kv_norm_rope_write_reference` does
    (q and k go through the same norm and rotation together, each head with its own weight)."""
    B, T, _ = qkv.shape
    n_q, n_kv, hd = _split_qkv(qkv, k_cache)
    x = qkv.reshape(B, T, n_q + 2 * n_kv, hd)
    cos, sin = gather_cos_sin(cos_sin, window_positions(start, T))    # [B, T, hd/2]
    w = torch.cat([q_norm_weight.expand(n_q, hd), k_norm_weight.expand(n_kv, hd)])
    qk = _norm_rope(x[:, :, :n_q + n_kv], w, cos[:, :, None], sin[:, :, None], eps, is_neox)
    _write_window(qk[:, :, None, n_q:], x[:, :, None, n_q + n_kv:], k_cache, v_cache, page_table, layer, slots, start,
                  lens)
    return qk[:, :, :n_q].to(qkv.dtype).contiguous()   # fp32: .to is a view; the op's fake is contiguous


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::kv_norm_rope_write", mutates_args=("k_cache", "v_cache"))
def kv_norm_rope_write(kv: torch.Tensor, k_norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, first_layer: int,
                       slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                       eps: float, is_neox: bool) -> None:
    """``kv [B, T, n*2*KV]`` -> normed, rotated K and raw V in layers ``first_layer .. +n`` of the paged
    ``k_cache``/``v_cache [L, n_pages, page_size, n_kv, hd]`` through ``page_table [R, max_pages]`` (int32);
    ``k_norm_weight [L, hd]``, ``cos_sin [P, hd]`` fp32."""
    if use_triton(kv):
        kv_norm_rope_write_triton(kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, first_layer, slots,
                                  start, lens, eps, is_neox)
    else:
        kv_norm_rope_write_reference(kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, first_layer, slots,
                                     start, lens, eps, is_neox)


@kv_norm_rope_write.register_kernel("cuda")
def _kv_norm_rope_write_cuda(kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, first_layer, slots, start,
                             lens, eps, is_neox) -> None:
    kv_norm_rope_write_triton(kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, first_layer, slots, start,
                              lens, eps, is_neox)


@kv_norm_rope_write.register_fake
def _kv_norm_rope_write_fake(kv, k_norm_weight, cos_sin, k_cache, v_cache, page_table, first_layer, slots, start,
                             lens, eps, is_neox) -> None:
    return None


@torch.library.custom_op("lfmspark::qkv_norm_rope_write", mutates_args=("k_cache", "v_cache"))
def qkv_norm_rope_write(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                        eps: float, is_neox: bool) -> torch.Tensor:
    """The target attention's step after its qkv projection, in one launch: ``qkv [B, T, (n_q + 2 n_kv)
    * hd]`` -> per-head RMSNorm (``q_norm_weight``/``k_norm_weight [hd]``) and RoPE of q and k, K and V
    of the first ``lens[b]`` tokens written to layer ``layer`` of ``k_cache``/``v_cache`` (as
    :func:`kv_norm_rope_write`), and the rotated queries returned ``[B, T, n_q, hd]``."""
    if use_triton(qkv):
        return qkv_norm_rope_write_triton(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table,
                                          layer, slots, start, lens, eps, is_neox)
    return qkv_norm_rope_write_reference(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table,
                                         layer, slots, start, lens, eps, is_neox)


@qkv_norm_rope_write.register_kernel("cuda")
def _qkv_norm_rope_write_cuda(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer, slots,
                              start, lens, eps, is_neox) -> torch.Tensor:
    return qkv_norm_rope_write_triton(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer,
                                      slots, start, lens, eps, is_neox)


@qkv_norm_rope_write.register_fake
def _qkv_norm_rope_write_fake(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer, slots,
                              start, lens, eps, is_neox) -> torch.Tensor:
    n_q, _, hd = _split_qkv(qkv, k_cache)
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], n_q, hd))
