"""Attention of a token window over the paged KV cache (GQA, per-row lengths).

Cache layout (shared by every op of this package): ``k_cache``/``v_cache [L, n_pages, page_size,
n_kv, hd]`` hold fixed-size pages of positions, and ``page_table [R, max_pages]`` (int32, contiguous
rows) maps logical page ``j`` of slot ``s`` to a physical page: position ``pos`` of slot ``s`` is
``cache[layer, page_table[s, pos // page_size], pos % page_size]``. A slot's length is
``S = max_pages * page_size``; the ops read only the table entries of positions they read or write,
so entries past a slot's used length may hold anything. Pages need not be contiguous, ordered or
distinct between slots (a shared prefix may map to the same pages); pages a call writes must not be
read by another of its rows. Row ``b`` of a call addresses slot ``slots[b]`` (``-1``: a padding row,
which reads no table entry).

``q [B, T, n_heads, hd]`` for row ``b`` sits at positions ``start[b] .. start[b] + T - 1``; the window's
own K/V are already in the cache (written by the KV-write ops before the call). Query ``t`` attends to
positions ``[0, start[b] + t + 1)`` when ``causal`` (target prefill / decode / verify) and to
``[0, start[b] + T)`` otherwise (the DSpark draft block, non-causal inside the block), both clipped to
``S``. Query head ``h`` reads KV head ``h // (n_heads // n_kv)`` (``repeat_interleave`` order).
Softmax in fp32, output in ``q``'s dtype; rows with slot ``-1`` produce zeros. Columns past a row's
real tokens produce values that callers ignore.

``exact`` (exact mode): the launch plan follows the slot length ``S`` only, never the
window, the batch or the SMs: 16-row query tiles, 64-key blocks, and key slices of a fixed span
of absolute positions (``plan_launch``). A query then visits the same key blocks in the same order
and its slices merge in the same order whether it is a decode step's token, a verify window's or a
prefill chunk's, alone or among other rows: its output bits depend only on its own query and the
cache. (Key blocks past a row's end are masked to exact no-ops of the online softmax.) That also
takes a dot that computes a row alike wherever it sits in the tile: the GPU's ``tl.dot`` does; the
interpreter's (the CPU's BLAS) need not, so on CPU exact mode sums the products itself (``_exact_dot``,
ops/exact_dot.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from ..exact_dot import rowwise_dot
from ..tuning import tuned


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.9 interpreter multiplies bf16 operands as raw integers, so on CPU bf16
    # operands (already rounded as on the GPU) are multiplied in fp32 instead
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _exact_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROWWISE: tl.constexpr):
    # ROWWISE (exact mode on CPU): each element its own sum, not the interpreter's BLAS, which may sum
    # a row by its position in the tile (ops/exact_dot.py); the GPU's dot computes every row alike
    if ROWWISE:
        c = rowwise_dot(a, b)
    else:
        c = _dot(a, b, PRECISION, UPCAST)
    return c


# The ints that change with the prompt length and the batch are not specialized (Triton would
# otherwise compile a variant per "== 1" / "% 16 == 0" class of each): every prefill shape of one
# launch class (``AttentionLaunch.variant``) then shares one binary, which the engine's prefill
# warm-up compiles before traffic (runtime/engine.py). The slot length S is fixed per engine.
@triton.jit(do_not_specialize=["T", "n_rows", "n_out_rows", "num_splits"])
def _cache_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, pt_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, slots_ptr, start_ptr,
    T, S, H, n_kv, n_rows, n_out_rows, num_splits, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_cpage, stride_cp, stride_ch, stride_pt,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    DOT_ROWWISE: tl.constexpr, FIXED_SLICES: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # One program: BLOCK_M rows = flattened (token, head-in-group) pairs of one (batch row, kv head),
    # against one slice of the key range (the whole range unless SPLIT). Every K/V tile is loaded
    # once for the whole GQA group. ``kc_ptr``/``vc_ptr`` already point at the layer's pages.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest tiles start first
    b = tl.program_id(1) // n_kv
    kvh = tl.program_id(1) % n_kv
    split = tl.program_id(2)

    slot = tl.load(slots_ptr + b).to(tl.int64)
    s0 = tl.load(start_ptr + b).to(tl.int64)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    dims = tl.arange(0, HD)

    # keys [0, kv_len) cover every row of the tile; row r only sees keys < row_end[r]
    if CAUSAL:
        t_last = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, n_rows - 1) // GROUP
        kv_len = s0 + t_last + 1
        row_end = s0 + t + 1
    else:
        kv_len = s0 + T
        row_end = s0 + T
    kv_len = tl.where(slot >= 0, tl.minimum(kv_len, S), 0).to(tl.int32)  # padding row: no keys
    row_end = tl.where(row_ok, tl.minimum(row_end, kv_len), 0).to(tl.int32)

    if FIXED_SLICES:   # exact mode: slices of absolute positions, whatever this tile's keys
        lo, hi = _fixed_split_range(kv_len, S, split, num_splits, BLOCK_N)
    else:
        lo, hi = _split_range(kv_len, split, num_splits, BLOCK_N, SPLIT)

    q_offs = b * stride_qb + t * stride_qt + h * stride_qh
    q = tl.load(q_ptr + q_offs[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    table = pt_ptr + tl.maximum(slot, 0) * stride_pt  # the slot's page table row (padding: no key reads it)
    k_base = kc_ptr + kvh * stride_ch
    v_base = vc_ptr + kvh * stride_ch

    # online softmax in the log2 domain (qk_scale includes log2(e))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)
    # each key block's pages are loaded one block ahead (loop-carried): a block's K/V loads then depend
    # on no load of their own iteration, and Triton pipelines them as deep as a dense cache's
    pages = _load_pages(table, lo + tl.arange(0, BLOCK_N), hi, PAGE)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kv_offs = _page_offsets(pages, keys, stride_cpage, stride_cp, PAGE)[:, None] + dims[None, :]
        pages = _load_pages(table, keys + BLOCK_N, hi, PAGE)
        k = tl.load(k_base + kv_offs, mask=(keys < hi)[:, None], other=0.0)
        qk = _exact_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST, DOT_ROWWISE) * qk_scale
        qk = tl.where(keys[None, :] < row_end[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row with no visible key yet keeps m = -inf: shift by 0 instead so exp2 gives 0, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_offs, mask=(keys < hi)[:, None], other=0.0)
        acc = acc * alpha[:, None] + _exact_dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST, DOT_ROWWISE)
        m_i = m_new

    _store_rows(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, (b * T + t) * H + h, row_ok, split,
                n_out_rows, HD, SPLIT)


@triton.jit
def _load_pages(table, pos, n_pos, PAGE: tl.constexpr):
    """The physical pages of positions ``pos`` of a slot, from its page table row ``table``; positions
    at or past ``n_pos`` read no entry (page 0: their K/V loads are masked)."""
    return tl.load(table + pos // PAGE, mask=pos < n_pos, other=0)


@triton.jit
def _page_offsets(pages, pos, stride_page, stride_cp, PAGE: tl.constexpr):
    """Offsets (int64) of positions ``pos`` on their ``pages`` (:func:`_load_pages`) in a layer's cache."""
    return pages.to(tl.int64) * stride_page + (pos % PAGE) * stride_cp


@triton.jit
def _split_range(n_keys, split, num_splits, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Keys ``[lo, hi)`` of slice ``split`` of ``[0, n_keys)``: balanced slices in whole key blocks, so a
    block never straddles two slices; trailing slices may be empty and then store neutral partials."""
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_keys)
    else:
        lo = 0
        hi = n_keys
    return lo, hi


@triton.jit
def _fixed_split_range(n_keys, span, split, num_splits, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` of slice ``split`` of ``[0, span)`` cut into ``num_splits`` slices of whole key
    blocks (their bounds follow ``span``, the slot length, alone), clipped to ``[0, n_keys)``."""
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * chunk, n_keys)
    hi = tl.minimum(lo + chunk, n_keys)
    return lo, hi


@triton.jit
def _store_rows(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, out_rows, row_ok, split, n_out_rows,
                HD: tl.constexpr, SPLIT: tl.constexpr):
    """A program's result for output rows ``out_rows`` (``[B, T, H]`` order): the split's partial max,
    sum and accumulator, or without splits the normalised output."""
    dims = tl.arange(0, HD)
    if SPLIT:
        part_rows = split * n_out_rows + out_rows
        tl.store(part_m_ptr + part_rows, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_rows, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part_rows[:, None] * HD + dims[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key (padding row): zeros
        tl.store(out_ptr + out_rows[:, None] * HD + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_out_rows", "num_splits"])
def _combine_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    n_out_rows, num_splits,
    HD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # one program per output row (batch row, token, head): merges all its split partials at once
    # (a loop over the splits would serialize their load latencies)
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    dims = tl.arange(0, HD)
    p_rows = s * n_out_rows + row
    m_s = tl.load(part_m_ptr + p_rows, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + p_rows, mask=s_ok, other=0.0)
    acc_s = tl.load(part_acc_ptr + p_rows[:, None] * HD + dims[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m_s, 0)
    w = tl.exp2(m_s - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: weight 0
    l_sum = tl.sum(w * l_s, 0)
    acc = tl.sum(w[:, None] * acc_s, 0)
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)  # no key at all (padding row): zeros
    tl.store(out_ptr + row * HD + dims, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# launcher

_LOG2E = 1.4426950408889634
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64
_MAX_WIDE_SPLITS = 4  # windows of 33-64 rows (_pick_splits)
_SPLIT_BLOCK_N = 64  # key block of the split path (_key_config)
EXACT_BLOCK_M = 16        # exact mode's query tile rows (module doc)
EXACT_SLICE_KEYS = 1024   # exact mode: one key slice per this many cache positions


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: a small number that still sends the tests' tiny shapes down the split path


def _block_m(n_rows: int, hd: int) -> int:
    """Rows per program for ``n_rows = T * group`` (token, head-in-group) rows per kv head."""
    if n_rows <= 64:  # decode / verify / draft: a single row tile
        return max(16, triton.next_power_of_2(n_rows))
    return 128 if hd <= 64 else 64  # prefill


def _key_config(n_rows: int, hd: int, elem_size: int, split: bool) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)``, from a sweep at 1.2B shapes."""
    if n_rows > 64:  # prefill
        return 64, (8 if hd <= 64 else 4), 3
    if not split and hd * elem_size <= 128:
        # memory-bound with a full wave and no splits: longer key blocks keep more bytes in flight
        return 128, 4, 4
    return _SPLIT_BLOCK_N, 4, 3


def _pick_splits(n_programs: int, n_rows: int, S: int, block_n: int, sms: int) -> int:
    """Key-range splits for ``n_programs`` (batch rows x kv heads x row tiles) of ``n_rows`` rows each
    on ``sms`` SMs. Static information only (the actual lengths live on the device, so the slot
    length ``S`` bounds the useful number of slices): none once the programs fill at least half a
    wave of SMs, else about ``_PROGRAMS_PER_SM`` programs per SM, and at most
    ``_MAX_WIDE_SPLITS`` for windows of 33-64 rows (one row tile). Measured at 1.2B shapes:
    splitting a half-full wave further only adds partial traffic and the combine launch; the
    batch-1 round's 40-row windows ran 12 us per round faster at 4 splits than at 15 (one split:
    10 us slower), while the decode step's 4-row windows ran 10 us slower at 4
    (docs/decisions.md)."""
    if 2 * n_programs > sms:
        return 1
    cap = _MAX_WIDE_SPLITS if 32 < n_rows <= 64 else _MAX_SPLITS   # prefill tiles (> 64 rows): not measured
    return max(1, min(_PROGRAMS_PER_SM * sms // n_programs, triton.cdiv(S, block_n), cap))


@dataclass(frozen=True)
class AttentionLaunch:
    """How :func:`cache_attention_triton` launches one call."""
    block_m: int
    n_tiles: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @property
    def variant(self) -> tuple[int, bool, int, int, int]:
        """The launch's compile-time choices: with the model's (causal, group, head_dim, dtype), the
        compiled kernels a call needs. The integer arguments are not specialized, and the combine
        kernel pads to ``_MAX_SPLITS`` whatever the split count, so calls with equal variants share
        binaries (what the prefill warm-up relies on)."""
        return self.block_m, self.split, self.block_n, self.num_warps, self.num_stages


def plan_launch(B: int, T: int, H: int, n_kv: int, hd: int, S: int, elem_size: int, sms: int,
                num_splits: int | None = None, exact: bool = False) -> AttentionLaunch:
    """The launch of a ``[B, T, H, hd]`` query window over slots of length ``S`` on ``sms`` SMs;
    ``num_splits`` overrides the occupancy heuristic, and so does ``LFMSPARK_TUNE``'s
    ``attention.num_splits`` (ops/tuning.py) for the launches the heuristic splits. ``exact``: the
    plan of exact mode, a function of ``S`` alone (module doc)."""
    n_rows = T * (H // n_kv)
    if exact:
        splits = min(max(1, triton.cdiv(S, EXACT_SLICE_KEYS)), _MAX_SPLITS)
        return AttentionLaunch(EXACT_BLOCK_M, triton.cdiv(n_rows, EXACT_BLOCK_M), splits, _SPLIT_BLOCK_N, 4, 3)
    block_m = _block_m(n_rows, hd)
    n_tiles = triton.cdiv(n_rows, block_m)
    if num_splits is None:
        num_splits = _pick_splits(B * n_kv * n_tiles, n_rows, S, _SPLIT_BLOCK_N, sms)
        if num_splits > 1:
            num_splits = tuned("attention", "num_splits", num_splits)
    num_splits = min(max(1, int(num_splits)), _MAX_SPLITS)   # the combine kernel's padding
    block_n, num_warps, num_stages = _key_config(n_rows, hd, elem_size, num_splits > 1)
    return AttentionLaunch(block_m, n_tiles, num_splits, block_n, num_warps, num_stages)


def slot_length(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor) -> int:
    """``S = max_pages * page_size`` of a paged cache (module doc), after checking ``page_table`` (the
    kernels read it as int32 rows with unit stride) and that both caches have the same pages."""
    if page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32, got {page_table.dtype}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be 2-D [rows, max_pages], got shape {tuple(page_table.shape)}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must be contiguous along its pages (stride(1) == 1), got {page_table.stride()}")
    if page_table.device != k_cache.device:
        raise ValueError(f"page_table is on {page_table.device}, the caches on {k_cache.device}")
    if k_cache.dim() != 5 or k_cache.shape[:4] != v_cache.shape[:4]:
        raise ValueError("k_cache and v_cache must be [L, n_pages, page_size, n_kv, hd] with the same pages, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    return page_table.shape[1] * k_cache.shape[2]


def cache_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           layer: int, slots: torch.Tensor, start: torch.Tensor, causal: bool, scale: float,
                           num_splits: int | None = None, exact: bool = False) -> torch.Tensor:
    """Triton implementation of :func:`cache_attention`; ``num_splits`` forces the number of
    key-range slices (1: single pass) instead of the occupancy heuristic; ``exact``: exact mode's
    launch plan (module doc)."""
    B, T, H, hd = q.shape
    S, n_kv = slot_length(k_cache, v_cache, page_table), k_cache.shape[3]
    if H % n_kv != 0:
        raise ValueError(f"n_heads {H} is not a multiple of n_kv {n_kv}")
    if hd < 16 or hd & (hd - 1) or k_cache.shape[4] != hd:
        raise ValueError(f"head_dim must be a power of two >= 16 matching the cache, got {hd}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("q, k_cache and v_cache must share a dtype")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have equal strides, contiguous in head_dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((B, T, H, hd), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    group = H // n_kv
    launch = plan_launch(B, T, H, n_kv, hd, S, q.element_size(), _sm_count(q.device), num_splits, exact)
    num_splits, split = launch.num_splits, launch.split

    part_m, part_l, part_acc = split_partials(out, num_splits)
    kc, vc = k_cache[layer], v_cache[layer]  # views: the layer offset is folded into the pointer
    _cache_attention_kernel[(launch.n_tiles, B * n_kv, num_splits)](
        q, kc, vc, page_table, out, part_m, part_l, part_acc, slots, start,
        T, S, H, n_kv, T * group, B * T * H, num_splits, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), page_table.stride(0),
        CAUSAL=bool(causal), SPLIT=split, GROUP=group, HD=hd, PAGE=k_cache.shape[2],
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
        DOT_UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        DOT_ROWWISE=exact and q.device.type != "cuda", FIXED_SLICES=exact,  # _exact_dot
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_kwargs(q),
    )
    combine_splits(part_m, part_l, part_acc, out)
    return out


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max, sum, accumulator)`` buffers, fp32, per split and row of ``out [..., hd]``; with one split the
    single-pass kernel writes ``out`` directly and the three are ``out`` (unused)."""
    if num_splits == 1:
        return out, out, out
    rows, hd = out.numel() // out.shape[-1], out.shape[-1]
    part_m = torch.empty((num_splits, rows), dtype=torch.float32, device=out.device)
    part_acc = torch.empty((num_splits, rows, hd), dtype=torch.float32, device=out.device)
    return part_m, torch.empty_like(part_m), part_acc


def combine_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor) -> None:
    """Merge :func:`split_partials` into ``out`` (nothing to do for one split)."""
    if part_m is out:
        return
    num_splits, rows = part_m.shape
    _combine_splits_kernel[(rows,)](
        part_m, part_l, part_acc, out,
        rows, num_splits,
        HD=out.shape[-1], SPLITS_PAD=_MAX_SPLITS, **pdl_kwargs(part_m),  # one binary for every split count
    )


# ---------------------------------------------------------------------------------------------
# reference

def read_slot(cache: torch.Tensor, page_table: torch.Tensor, layer: int, slot: int, end: int) -> torch.Tensor:
    """Positions ``[0, end)`` of ``slot`` in layer ``layer`` of a paged cache: ``[end, n_kv, hd]``."""
    page = cache.shape[2]
    pages = page_table[slot, :triton.cdiv(max(end, 0), page)].long()
    return cache[layer, pages].flatten(0, 1)[:max(end, 0)]


def cache_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                              layer: int, slots: torch.Tensor, start: torch.Tensor, causal: bool, scale: float,
                              window_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The op's oracle, in fp32; with ``window_lens``, the window's keys at or past ``window_lens[b]``
    are hidden too (ops/attention/window_attention.py's semantics). Each kv head's ``group`` query heads are
    one ``[T * group, hd]`` matrix of its products (grouped-query attention without repeating K/V)."""
    B, T, n_heads, hd = q.shape
    S, n_kv = page_table.shape[1] * k_cache.shape[2], k_cache.shape[3]
    group = n_heads // n_kv
    out = torch.zeros_like(q)
    lens = [T] * B if window_lens is None else [min(n, T) for n in window_lens.tolist()]
    for b, (slot, s0, n) in enumerate(zip(slots.tolist(), start.tolist(), lens)):
        if slot < 0:
            continue
        end = min(s0 + n, S)
        k = read_slot(k_cache, page_table, layer, slot, end).float()           # [end, n_kv, hd]
        v = read_slot(v_cache, page_table, layer, slot, end).float()
        qg = q[b].float().view(T, n_kv, group, hd).transpose(0, 1).reshape(n_kv, T * group, hd)
        scores = (torch.bmm(qg, k.permute(1, 2, 0)) * scale).view(n_kv, T, group, end)
        if causal and T > 1:     # a single query (decode) sees every key: they all precede it
            key_pos = torch.arange(end, device=q.device)[None, :]
            query_pos = s0 + torch.arange(T, device=q.device)[:, None]
            scores = scores.masked_fill((key_pos > query_pos)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(n_kv, T * group, end)
        o = torch.bmm(probs, v.transpose(0, 1))                                # [n_kv, T * group, hd]
        out[b] = o.view(n_kv, T, group, hd).transpose(0, 1).reshape(T, n_heads, hd).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::cache_attention", mutates_args=())
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    layer: int, slots: torch.Tensor, start: torch.Tensor, causal: bool, scale: float,
                    exact: bool = False) -> torch.Tensor:
    """Attention output ``[B, T, n_heads, hd]`` of the window over layer ``layer`` of the paged cache
    (``exact``: exact mode's launch plan, each query's bits independent of the launch; module doc)."""
    if use_triton(q):
        return cache_attention_triton(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale,
                                      exact=exact)
    return cache_attention_reference(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale)


@cache_attention.register_kernel("cuda")
def _cache_attention_cuda(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale, exact=False):
    return cache_attention_triton(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale, exact=exact)


@cache_attention.register_fake
def _cache_attention_fake(q, k_cache, v_cache, page_table, layer, slots, start, causal, scale, exact=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
