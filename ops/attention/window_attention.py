"""The attention of a short token window straight from its fused qkv projection, in one launch.

``lfmspark::qkv_window_attention`` is ``lfmspark::qkv_norm_rope_write`` followed by
``lfmspark::cache_attention`` for windows whose (token, head-in-group) rows fit one row tile of the
attention kernel (``T * n_heads / n_kv <= 64``: the decode step, the verify, the DSpark draft
block). The attention programs normalise and rotate their queries themselves, and the program that
owns the window's keys (the last key-range split of each kv head) normalises and rotates the
window's K, writes K and V of the first ``lens[b]`` tokens to the cache, and attends to them from
registers. Why: in the batch-1 round a separate write kernel between the qkv projection and the
attention costs 11 launches of ~2.5 us of hand-off each (docs/decisions.md).

Semantics (:func:`qkv_window_attention_reference`): the cache writes and the queries are
``qkv_norm_rope_write``'s, bit for bit on CUDA; query ``t`` of row ``b`` attends to the cached
prefix ``[0, start[b])`` and to the window's tokens ``t' < lens[b]`` (``t' <= t`` when causal), all
below the slot length ``S`` (the paged layout: ops/attention/cache_attention.py). The two-launch path
instead reads window tokens at or past ``lens[b]`` from whatever the cache holds there; only output
rows ``t >= lens[b]`` can tell the two apart, and callers ignore those rows. The pages a row writes
must belong to that row alone in the call (the engine gives each request its own slot, padding rows
``-1``): a row's window write would otherwise land in another row's prefix while that row's programs
read it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from ..routing import WINDOW_TILE_ROWS, window_attention
from .cache_attention import (_LOG2E, _dot, _load_pages, _page_offsets, _sm_count, _split_range, _store_rows,
                              cache_attention_reference, combine_splits, plan_launch, slot_length, split_partials)
from .kv_norm_rope_write import (_join_pairs, _load_halves, _norm_rope_halves, _pair_weights, _round, _split_qkv,
                                 qkv_norm_rope_write_reference)

def window_block(T: int) -> int:
    """The kernel's block of window tokens (a ``tl.dot`` operand: at least 16)."""
    return max(16, triton.next_power_of_2(T))


def launch_variant(B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int, elem_size: int, sms: int) -> Hashable:
    """The compile-time choices of the attention a ``[B, T]`` window over slots of length ``S`` runs in
    the models (which kernel, its window block, the launch plan's ``variant``): equal values share
    compiled kernels, so the prefill warm-up (runtime/prefill_warmup.py ``prefill_variants``) runs one
    shape per value."""
    plan = plan_launch(B, T, n_heads, n_kv, hd, S, elem_size, sms)
    if window_attention(T, n_heads, n_kv):
        return "window", window_block(T), plan.variant
    return "cache", plan.variant


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _online_softmax(q, k, v, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One key block of the online softmax in the log2 domain (``qk_scale`` includes log2(e)), keys
    masked where not ``seen [BLOCK_M, BLOCK_N]``; as ops/attention/cache_attention.py's loop body."""
    qk = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
    qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 gives 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "n_rows", "n_out_rows", "num_splits"])
def _window_attention_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cs_ptr, kc_ptr, vc_ptr, pt_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    slots_ptr, start_ptr, lens_ptr,
    T, S, P, H, n_kv, n_rows, n_out_rows, num_splits, qk_scale, eps,
    stride_xb, stride_xt, stride_tab, stride_cpage, stride_cp, stride_ch, stride_pt,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr, IS_NEOX: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # One program: the window's BLOCK_M rows (token, head-in-group) of one (batch row, kv head),
    # against one slice of the cached prefix; the last slice's program also owns the window's keys.
    # Every load is requested before any of them is used: the prefix's K/V come from HBM and the
    # queries from L2, so computing the queries first would serialize the two latencies.
    b = tl.program_id(0) // n_kv
    kvh = tl.program_id(0) % n_kv
    split = tl.program_id(1)
    owner = split == num_splits - 1
    ACT: tl.constexpr = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = HD // 2
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    tw = tl.arange(0, BLOCK_T)
    j = tl.arange(0, HALF)[None, :]
    dims = tl.arange(0, HD)
    if PDL:  # ops/_dispatch.py
        tl.extra.cuda.gdc_launch_dependents()
    # the norm weights are parameters, not an earlier kernel's output: requested before the wait
    qw1, qw2 = _pair_weights(qw_ptr, 1, HD, IS_NEOX, ACT)
    kw1, kw2 = _pair_weights(kw_ptr, tl.where(owner, 1, 0), HD, IS_NEOX, ACT)
    if PDL:  # everything else may come from the predecessor
        tl.extra.cuda.gdc_wait()

    slot = tl.load(slots_ptr + b).to(tl.int64)
    s0 = tl.load(start_ptr + b).to(tl.int64)
    n_new = tl.load(lens_ptr + b).to(tl.int64)
    # the cached prefix [0, start) is visible to every row: this program's slice, in whole key blocks
    prefix = tl.where(slot >= 0, tl.minimum(s0, S), 0).to(tl.int32)
    lo, hi = _split_range(prefix, split, num_splits, BLOCK_N, SPLIT)
    # the window's tokens t' < lens[b] inside the cache, for the owner only (the scalar bounds fold
    # into one vector comparison for the interpreter)
    n_win = tl.minimum(tl.minimum(n_new, T), S - s0)
    n_win = tl.where((slot >= 0) & owner, n_win, 0)
    w_ok = tw < n_win
    table = pt_ptr + tl.maximum(slot, 0) * stride_pt  # the slot's page table row (padding: no position reads it)
    k_base = kc_ptr + kvh * stride_ch
    v_base = vc_ptr + kvh * stride_ch
    x_row = qkv_ptr + b.to(tl.int64) * stride_xb

    # requests: the first prefix block, the raw queries and window K/V, their cos/sin rows, the pages
    # of the window's positions (the owner's only) and of the second prefix block (the loop below loads
    # each block's pages one block ahead, as ops/attention/cache_attention.py's)
    keys0 = lo + tl.arange(0, BLOCK_N)
    kv_offs0 = _page_offsets(_load_pages(table, keys0, hi, PAGE), keys0, stride_cpage, stride_cp, PAGE)
    kv_offs0 = kv_offs0[:, None] + dims[None, :]
    w_pos = s0 + tw
    w_offs = _page_offsets(_load_pages(table, w_pos, s0 + n_win, PAGE), w_pos, stride_cpage, stride_cp, PAGE)
    w_offs = w_offs[:, None] + dims[None, :]
    pages = _load_pages(table, keys0 + BLOCK_N, hi, PAGE)
    k0 = tl.load(k_base + kv_offs0, mask=(keys0 < hi)[:, None], other=0.0)
    v0 = tl.load(v_base + kv_offs0, mask=(keys0 < hi)[:, None], other=0.0)
    qa, qb = _load_halves(x_row + t[:, None].to(tl.int64) * stride_xt + h[:, None] * HD, row_ok[:, None], HD)
    w_src = x_row + tw[:, None].to(tl.int64) * stride_xt + (H + kvh) * HD
    ka, kb = _load_halves(w_src, w_ok[:, None], HD)
    vw = tl.load(w_src + n_kv * HD + dims[None, :], mask=w_ok[:, None], other=0.0)
    q_tab = cs_ptr + tl.minimum(tl.maximum(s0 + t, 0), P - 1)[:, None] * stride_tab   # clamped as the reference
    q_cos = tl.load(q_tab + j, mask=row_ok[:, None], other=0.0)
    q_sin = tl.load(q_tab + HALF + j, mask=row_ok[:, None], other=0.0)
    w_tab = cs_ptr + tl.minimum(tl.maximum(s0 + tw, 0), P - 1)[:, None] * stride_tab
    w_cos = tl.load(w_tab + j, mask=w_ok[:, None], other=0.0)
    w_sin = tl.load(w_tab + HALF + j, mask=w_ok[:, None], other=0.0)

    # the queries, normalised and rotated as qkv_norm_rope_write stores them
    q1, q2 = _norm_rope_halves(qa, qb, qw1, qw2, q_cos, q_sin, eps, BLOCK_M, HD, IS_NEOX, ACT)
    q = _join_pairs(_round(q1, ACT), _round(q2, ACT), BLOCK_M, HD, IS_NEOX)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)
    if owner:
        # the window's keys: written to the cache here, attended from registers
        k1, k2 = _norm_rope_halves(ka, kb, kw1, kw2, w_cos, w_sin, eps, BLOCK_T, HD, IS_NEOX, ACT)
        kw = _join_pairs(_round(k1, ACT), _round(k2, ACT), BLOCK_T, HD, IS_NEOX)
        tl.store(k_base + w_offs, kw.to(kc_ptr.dtype.element_ty), mask=w_ok[:, None])
        tl.store(v_base + w_offs, vw.to(vc_ptr.dtype.element_ty), mask=w_ok[:, None])
        seen = tw[None, :] < n_win
        if CAUSAL:
            seen = seen & (tw[None, :] <= t[:, None])
        m_i, l_i, acc = _online_softmax(q, kw, vw, seen, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_UPCAST)
    m_i, l_i, acc = _online_softmax(q, k0, v0, keys0[None, :] < hi, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                    DOT_UPCAST)
    for n0 in range(lo + BLOCK_N, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kv_offs = _page_offsets(pages, keys, stride_cpage, stride_cp, PAGE)[:, None] + dims[None, :]
        pages = _load_pages(table, keys + BLOCK_N, hi, PAGE)
        k = tl.load(k_base + kv_offs, mask=(keys < hi)[:, None], other=0.0)
        v = tl.load(v_base + kv_offs, mask=(keys < hi)[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax(q, k, v, keys[None, :] < hi, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                        DOT_UPCAST)

    _store_rows(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, (b * T + t) * H + h, row_ok, split,
                n_out_rows, HD, SPLIT)


# ---------------------------------------------------------------------------------------------
# launcher

def qkv_window_attention_triton(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_table: torch.Tensor, layer: int, slots: torch.Tensor, start: torch.Tensor,
                                lens: torch.Tensor, eps: float, is_neox: bool, causal: bool, scale: float,
                                num_splits: int | None = None) -> torch.Tensor:
    """Triton implementation of :func:`qkv_window_attention`; ``num_splits`` forces the number of
    slices of the cached prefix (1: one program per kv head) instead of the occupancy heuristic."""
    B, T, _ = qkv.shape
    n_q, n_kv, hd = _split_qkv(qkv, k_cache)
    if n_q % n_kv != 0:
        raise ValueError(f"n_heads {n_q} is not a multiple of n_kv {n_kv}")
    if hd < 16 or hd & (hd - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {hd}")
    if not window_attention(T, n_q, n_kv):
        raise ValueError(f"a window of {T} tokens x {n_q // n_kv} heads per kv head is more than {WINDOW_TILE_ROWS} rows: "
                         "use qkv_norm_rope_write + cache_attention")
    if not (qkv.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("qkv, k_cache and v_cache must share a dtype")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have equal strides, contiguous in head_dim")
    S = slot_length(k_cache, v_cache, page_table)
    out = torch.empty((B, T, n_q, hd), dtype=qkv.dtype, device=qkv.device)
    if out.numel() == 0:
        return out
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    group = n_q // n_kv
    launch = plan_launch(B, T, n_q, n_kv, hd, S, qkv.element_size(), _sm_count(qkv.device), num_splits)
    num_splits = launch.num_splits
    part_m, part_l, part_acc = split_partials(out, num_splits)
    kc, vc = k_cache[layer], v_cache[layer]  # views: the layer offset is folded into the pointer
    _window_attention_kernel[(B * n_kv, num_splits)](
        qkv, q_norm_weight.contiguous(), k_norm_weight.contiguous(), cos_sin, kc, vc, page_table, out, part_m, part_l,
        part_acc, slots, start, lens,
        T, S, cos_sin.shape[0], n_q, n_kv, T * group, B * T * n_q, num_splits, scale * _LOG2E, eps,
        qkv.stride(0), qkv.stride(1), cos_sin.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), page_table.stride(0),
        CAUSAL=bool(causal), SPLIT=launch.split, GROUP=group, HD=hd, IS_NEOX=bool(is_neox), PAGE=k_cache.shape[2],
        BLOCK_M=launch.block_m, BLOCK_T=window_block(T), BLOCK_N=launch.block_n,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
        DOT_UPCAST=qkv.device.type != "cuda" and qkv.dtype == torch.bfloat16,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_kwargs(qkv),
        # the q/k rotation rounds as qkv_norm_rope_write's (its module doc); this also keeps the
        # softmax's multiply-adds unfused, which costs nothing measurable
        enable_fp_fusion=False,
    )
    combine_splits(part_m, part_l, part_acc, out)
    return out


# ---------------------------------------------------------------------------------------------
# reference

def qkv_window_attention_reference(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                   cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   page_table: torch.Tensor, layer: int, slots: torch.Tensor, start: torch.Tensor,
                                   lens: torch.Tensor, eps: float, is_neox: bool, causal: bool,
                                   scale: float) -> torch.Tensor:
    q = qkv_norm_rope_write_reference(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer,
                                      slots, start, lens, eps, is_neox)
    return cache_attention_reference(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale,
                                     window_lens=lens)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::qkv_window_attention", mutates_args=("k_cache", "v_cache"))
def qkv_window_attention(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, eps: float,
                         is_neox: bool, causal: bool, scale: float) -> torch.Tensor:
    """``qkv [B, T, (n_q + 2 n_kv) * hd]`` of a window that fits (ops/routing.py ``window_attention``) -> the attention
    output ``[B, T, n_q, hd]`` over the cached prefix and the window (the module doc's semantics),
    with the window's normed, rotated K and raw V of the first ``lens[b]`` tokens written to layer
    ``layer`` of the paged ``k_cache``/``v_cache [L, n_pages, page_size, n_kv, hd]`` through
    ``page_table [R, max_pages]`` (ops/attention/cache_attention.py)."""
    if use_triton(qkv):
        return qkv_window_attention_triton(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table,
                                           layer, slots, start, lens, eps, is_neox, causal, scale)
    return qkv_window_attention_reference(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table,
                                          layer, slots, start, lens, eps, is_neox, causal, scale)


@qkv_window_attention.register_kernel("cuda")
def _qkv_window_attention_cuda(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer, slots,
                               start, lens, eps, is_neox, causal, scale) -> torch.Tensor:
    return qkv_window_attention_triton(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer,
                                       slots, start, lens, eps, is_neox, causal, scale)


@qkv_window_attention.register_fake
def _qkv_window_attention_fake(qkv, q_norm_weight, k_norm_weight, cos_sin, k_cache, v_cache, page_table, layer, slots,
                               start, lens, eps, is_neox, causal, scale) -> torch.Tensor:
    n_q, _, hd = _split_qkv(qkv, k_cache)
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], n_q, hd))
