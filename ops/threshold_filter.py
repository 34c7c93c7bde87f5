"""Row thresholds of the sampling filters: top-k, top-p and min-p (HF order) in threshold form,
without sorting the vocabulary.

For each row of fp32 ``x [R, V]`` (transformed logits at the row's temperature) with ``top_k [R]``
(0: off), ``top_p [R]`` (1: off) and ``min_p [R]`` (0: off): ``(threshold, top, z)``, fp32 ``[R]``
each, where the kept tokens are ``x >= threshold``, ``top`` is the row's largest value and ``z``
the kept mass ``sum exp(x - top)`` (runtime/distributions.py's ``Filtered``).

Semantics (ties kept whole, as a sort keeps them): top-k's cut ``kth`` is the k-th largest value
counted with multiplicity (the row's smallest when top-k is off or ``top_k >= V``), every tie of it
kept; its mass is ``z_k``. Top-p keeps the values ``v >= kth`` whose mass strictly above ``v`` is
below ``top_p * z_k`` (a tie group is kept or dropped whole; the largest value always stays;
``top_p >= 1`` keeps everything from ``kth`` up); ``t`` is the smallest value kept. Min-p: the
threshold is ``max(t, top + log(min_p))`` in fp32. The threshold is therefore a value of the row,
or ``top + log(min_p)`` where min-p cuts deeper; ``z`` is the mass from it up.

Why: a sampled round filters every block position's distribution; the sort that top-p needs (cub's
radix sort of 65536 keys per row) costs several launches per position, and top-k alone over more
than a few dozen values needs one too. Here every setting costs the same fixed launches.

Algorithm (exact: brackets narrowed by counting, then resolved among few values):

1. Stats pass, grid ``(n_blocks, R)``: each program's max and min, and the max of every
   ``SB``-column block (``SB`` makes at most ``_NBM`` blocks per row, whatever the launch split).
2. Pivot pass, grid ``(n_blocks, R)``: ``_PP`` pivots per row, namely the block maxima (they fall
   among the row's largest values, where top-k cuts), ``top - _DELTA * j`` (where top-p and min-p
   cut), the row's minimum and min-p's cut; per pivot ``p`` each program counts ``x >= p`` and sums
   their ``exp(x - top)`` over its columns.
3. Pivot step, grid ``(R,)``: sums the partials (in program order, so the same bits every run). The
   highest pivot ``a`` with ``count(x >= a) >= k`` and the next pivot above it bracket ``kth``:
   ``kth`` is in ``[a, b)``. Top-k off gives ``kth`` = the minimum; ``a == top`` gives ``kth = top``.
   With ``kth`` known, top-p's target ``T = top_p * z_k`` is bracketed the same way by the pivots'
   masses (the lowest pivot above ``kth`` whose mass is below ``T`` bounds the kept values from
   below). Min-p-only and unfiltered rows finish here; a cut above a whole bracket finishes it too.
4. ``_ROUNDS`` rounds of a pass (grid ``(n_blocks, R)``) and a step (grid ``(R,)``) for the rows
   still open. A bracket of at most ``_CAP`` values is gathered (each program appends its values
   through an integer counter; the step sorts them, so their order does not matter) and resolved
   from the sorted values: ``kth`` by rank, top-p by the exclusive prefix masses at the first token
   of each tie group. For top-k the gather takes everything from ``a`` up when that fits
   (``top_k <= 128`` usually does), which resolves top-p too. A larger bracket is refined: the pass
   counts ``_NPIV`` pivots spread evenly over the bracket's orderable keys (the fp32 bit patterns
   made monotone) and the bracket's own min and max; the step keeps the sub-bracket holding the cut,
   tightened to that min and max. A bracket of one value is resolved.
5. The last step resolves what is still open alone, one program per row scanning the whole row
   (slow, rare: dense brackets such as ``top_p = 0.999``), in at most ``_fallback_rounds()``
   iterations. Why that bound is never hit: each iteration either resolves the bracket's phase
   (top-k, then top-p) or refines it, and a refinement shrinks the bracket's key span (< 2**32 at
   the start) by a factor ``_NPIV``, so after ``ceil(32 / log2(_NPIV))`` passes a phase is down to
   one key, one value, resolved; two phases, twice that. A row still open after the loop (which
   the argument rules out) gets a NaN threshold and mass rather than a wrong finite one.

Every launch has a static grid and the count of launches is fixed (CUDA-graph safe, no host
sync); rows that are done return at once. Deterministic: integer atomics only, float sums in a
fixed order. Masses are fp32 sums in another order than a sort's cumulative sum, so a cut that
falls within fp32 rounding of ``top_p * z_k`` may differ from a sort's (the float64 reference
agrees with this op on dense tails where the sort's fp32 cumulative sum does not). Rows must not
hold NaN; ``-inf`` entries are values like any other (mass 0).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton
from .argmax_rows import _sm_count

_NBM = 128            # block-maxima pivots per row (at most)
_NVAL = 126           # value pivots top - _DELTA * j, j < _NVAL
_DELTA = 0.25
_PP = _NBM + _NVAL + 2  # first-pass pivots: block maxima, value pivots, the row's min, min-p's cut
_NPIV = 64            # key-spaced pivots of a refinement (a power of two, as _CAP)
_CAP = 256            # a bracket of at most this many values is gathered and resolved
_ROUNDS = 2           # multi-program rounds after the pivot pass; the last step ends with the fallback
_PROGRAMS_PER_SM = 2  # the passes aim for this many programs per SM over the rows
_MAX_PROGRAMS_PER_ROW = 64
_MIN_BLOCK_V, _MAX_BLOCK_V = 256, 16384
_NBC = 16             # partial rows a step sums at a time
_RANK_CHUNK = 32      # gathered values ranked at a time (against all of them)

# per-row state between launches: _NSF fp32 and _NSI int32 columns
_NSF, _NSI = 8, 8
F_LO = tl.constexpr(0)      # the bracket [lo, hi) holding the phase's cut
F_HI = tl.constexpr(1)
F_MHI = tl.constexpr(2)     # the mass of the values >= hi
F_KTH = tl.constexpr(3)     # top-k's cut, once known
F_ZK = tl.constexpr(4)      # the mass of the values >= kth
I_PHASE = tl.constexpr(0)
I_N = tl.constexpr(1)       # the values in the bracket
I_CHI = tl.constexpr(2)     # the values >= hi
I_CKTH = tl.constexpr(3)    # the values >= kth
I_CNT = tl.constexpr(4)     # the next gather's slot counter
PH_K = tl.constexpr(0)      # resolving top-k's kth
PH_P = tl.constexpr(1)      # resolving top-p's t (kth and z_k known)
PH_DONE = tl.constexpr(2)


# ---------------------------------------------------------------------------------------------
# jitted helpers

@triton.jit
def _key(v):
    """The orderable int64 key of fp32 ``v``: monotone in ``v``, -0.0 and +0.0 one key, and every
    key between two values' keys a value (so a bracket of one key holds one value)."""
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, (b ^ 0x7FFFFFFF) + 1)
    return k.to(tl.int64)


@triton.jit
def _unkey(k):
    k32 = k.to(tl.int32)
    b = tl.where(k32 >= 0, k32, (k32 - 1) ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _next_up(v):
    return _unkey(_key(v) + 1)


@triton.jit
def _key_pivots(lo, hi, NPIV: tl.constexpr):
    """``NPIV`` pivots splitting ``[lo, hi)`` evenly in key space, the first ``lo`` itself: each
    sub-bracket spans at most ``ceil(span / NPIV)`` keys."""
    klo = _key(lo)
    i = tl.arange(0, NPIV).to(tl.int64)
    return _unkey(klo + ((_key(hi) - klo) * i) // NPIV)


@triton.jit
def _first_pivots(pmax_ptr, pmin_ptr, bm_ptr, lmp_ptr, r, NB, NSB, NBP: tl.constexpr, NBM: tl.constexpr,
                  NVAL: tl.constexpr, PP: tl.constexpr, DELTA: tl.constexpr):
    """The pivot pass's pivots of row ``r`` (the same bits in every program that builds them), the
    row's max and min, and min-p's cut ``top + log(min_p)``."""
    o = tl.arange(0, NBP)
    top = tl.max(tl.load(pmax_ptr + r * NB + o, mask=o < NB, other=float("-inf")), axis=0)
    mn = tl.min(tl.load(pmin_ptr + r * NB + o, mask=o < NB, other=float("inf")), axis=0)
    mp = top + tl.load(lmp_ptr + r)
    i = tl.arange(0, PP)
    bmax = tl.load(bm_ptr + r * NSB + i, mask=(i < NBM) & (i < NSB), other=float("-inf"))
    val = top - DELTA * (i - NBM).to(tl.float32)
    piv = tl.where(i < NBM, bmax, tl.where(i < NBM + NVAL, val, tl.where(i == PP - 2, mn, mp)))
    return piv, top, mn, mp


@triton.jit
def _sum_partials(c_ptr, m_ptr, base, NB, W: tl.constexpr, NBC: tl.constexpr):
    """The sums over ``NB`` rows of width ``W`` at ``base`` (counts, masses), ``NBC`` rows at a time
    in row order."""
    o = tl.arange(0, NBC)
    w = tl.arange(0, W)
    c = tl.zeros([W], dtype=tl.int32)
    m = tl.zeros([W], dtype=tl.float32)
    for j0 in range(0, NB, NBC):
        ok = (j0 + o < NB)[:, None]
        offs = base + (j0 + o)[:, None] * W + w[None, :]
        c += tl.sum(tl.load(c_ptr + offs, mask=ok, other=0), axis=0)
        m += tl.sum(tl.load(m_ptr + offs, mask=ok, other=0.0), axis=0)
    return c, m


@triton.jit
def _bracket_sums(row_ptr, c0, c1, V, lo, hi, top, q, TILE: tl.constexpr, NPIV: tl.constexpr):
    """Over columns ``[c0, c1)``: per pivot ``q_i`` the count and mass of the values in ``[q_i, hi)``
    (those of the bracket ``[lo, hi)`` at or above it), and the bracket's min and max."""
    cb = tl.zeros([NPIV], dtype=tl.int32)
    mb = tl.zeros([NPIV], dtype=tl.float32)
    bmin = tl.full([], float("inf"), tl.float32)
    bmax = tl.full([], float("-inf"), tl.float32)
    for t0 in range(c0, c1, TILE):
        cols = t0 + tl.arange(0, TILE)
        ok = cols < V
        v = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        inb = ok & (v >= lo) & (v < hi)
        e = tl.where(inb, tl.exp(v - top), 0.0)
        ge = inb[:, None] & (v[:, None] >= q[None, :])
        cb += tl.sum(ge.to(tl.int32), axis=0)
        mb += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
        bmin = tl.minimum(bmin, tl.min(tl.where(inb, v, float("inf")), axis=0))
        bmax = tl.maximum(bmax, tl.max(tl.where(inb, v, float("-inf")), axis=0))
    return cb, mb, bmin, bmax


@triton.jit
def _p_start(piv, C, M, kth, c_kth, z_k, top_p, top, mp, m_mp):
    """Top-p's bracket from the pivot table once ``kth`` (count ``c_kth`` and mass ``z_k`` from it
    up) is known: ``(phase, lo, hi, c_hi, m_hi, n, threshold, z)``, done where top-p is off, the
    bracket holds the top value alone, or min-p cuts above it."""
    T = top_p * z_k
    above = piv > kth
    hi = tl.min(tl.where(above & (M < T), piv, float("inf")), axis=0)
    c_hi = tl.max(tl.where(piv == hi, C, 0), axis=0)
    m_hi = tl.max(tl.where(piv == hi, M, 0.0), axis=0)
    lo = tl.max(tl.where(above & (M >= T), piv, float("-inf")), axis=0)
    at_kth = lo <= kth                     # no pivot above kth reaches T: the bracket starts at kth
    c_lo = tl.where(at_kth, c_kth, tl.max(tl.where(piv == lo, C, 0), axis=0))
    m_lo = tl.where(at_kth, z_k, tl.max(tl.where(piv == lo, M, 0.0), axis=0))
    lo = tl.where(at_kth, kth, lo)
    # t known: kth where top-p is off, top where [top, +inf) holds the top value alone
    off = top_p >= 1.0
    known = off | (lo == top)
    t = tl.where(off, kth, top)
    z_t = tl.where(off, z_k, m_lo)
    # min-p: over a known t, or above every value the bracket may keep
    mp_wins = (known & (mp > t)) | ((~known) & (mp >= hi))
    thr = tl.where(mp_wins, mp, t)
    z = tl.where(mp_wins, m_mp, z_t)
    phase = tl.where(known | mp_wins, PH_DONE, PH_P)
    return phase, lo, hi, c_hi, m_hi, c_lo - c_hi, thr, z


@triton.jit
def _top_p_in(s, e, excl, first, valid, floor, m_hi, T, mp, m_mp):
    """Top-p's cut among sorted gathered values ``s`` (largest first; masses ``e``, exclusive prefix
    masses ``excl``, ``first`` at each tie group's first token) at or above ``floor``, with mass
    ``m_hi`` above them all: ``(threshold, z)`` after min-p."""
    cand = valid & (s >= floor)
    kept = cand & first & (m_hi + excl < T)
    t = tl.min(tl.where(kept, s, float("inf")), axis=0)
    # the largest value is always kept (a rounding of T onto m_hi could leave none)
    t = tl.where(t == float("inf"), tl.max(tl.where(cand, s, float("-inf")), axis=0), t)
    z_t = m_hi + tl.sum(tl.where(valid & (s >= t), e, 0.0), axis=0)
    over = mp > t                               # min-p
    return tl.where(over, mp, t), tl.where(over, m_mp, z_t)


@triton.jit
def _sort_gathered(buf_ptr, n, CAP: tl.constexpr, CH: tl.constexpr):
    """The ``n <= CAP`` values at ``buf_ptr`` (any order), largest first, written to
    ``buf_ptr + CAP``: each value goes to its rank (values above it, and equal ones before it)."""
    i = tl.arange(0, CAP)
    valid = i < n
    vals = tl.load(buf_ptr + i, mask=valid, other=float("-inf"))
    for i0 in range(0, n, CH):
        ii = i0 + tl.arange(0, CH)
        v = tl.load(buf_ptr + ii, mask=ii < n, other=float("-inf"))
        tie_before = (vals[None, :] == v[:, None]) & (i[None, :] < ii[:, None])
        before = valid[None, :] & ((vals[None, :] > v[:, None]) | tie_before)
        tl.store(buf_ptr + CAP + tl.sum(before.to(tl.int32), axis=1), v, mask=ii < n)
    tl.debug_barrier()


@triton.jit
def _after_gather(buf_ptr, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z,
                  k, top_p, top, mp, m_mp, piv, C, M, CAP: tl.constexpr, CH: tl.constexpr):
    """Resolve the phase from the bracket's ``n <= CAP`` gathered values at ``buf_ptr`` (any order):
    top-k, then top-p where its bracket lies among them; or top-p."""
    _sort_gathered(buf_ptr, n, CAP, CH)
    i = tl.arange(0, CAP)
    valid = i < n
    has_prev = (i >= 1) & valid
    s = tl.load(buf_ptr + CAP + i, mask=valid, other=float("-inf"))
    s_prev = tl.load(buf_ptr + CAP + i - 1, mask=has_prev, other=float("inf"))
    e = tl.where(valid, tl.exp(s - top), 0.0)
    excl = tl.cumsum(tl.where(has_prev, tl.exp(s_prev - top), 0.0), axis=0)
    first = valid & (s_prev != s)
    is_k = phase == PH_K
    # top-k: kth by rank below the c_hi values above the bracket
    kth_g = tl.max(tl.where(i == k - c_hi - 1, s, float("-inf")), axis=0)
    ge = valid & (s >= kth_g)
    c_kth_g = c_hi + tl.sum(ge.to(tl.int32), axis=0)
    z_k_g = m_hi + tl.sum(tl.where(ge, e, 0.0), axis=0)
    p_phase, p_lo, p_hi, p_chi, p_mhi, p_n, p_thr, p_z = _p_start(piv, C, M, kth_g, c_kth_g, z_k_g, top_p, top,
                                                                  mp, m_mp)
    # top-p from these values: in its own phase, or right after top-k if its bracket lies among them
    zk = tl.where(is_k, z_k_g, z_k)
    g_thr, g_z = _top_p_in(s, e, excl, first, valid, tl.where(is_k, kth_g, float("-inf")), m_hi, top_p * zk,
                           mp, m_mp)
    here = (~is_k) | ((p_phase == PH_P) & (p_hi <= hi))
    phase = tl.where(here, PH_DONE, p_phase)
    thr = tl.where(here, g_thr, p_thr)
    z = tl.where(here, g_z, p_z)
    lo, hi, c_hi, m_hi, n = p_lo, p_hi, p_chi, p_mhi, p_n
    kth = tl.where(is_k, kth_g, kth)
    c_kth = tl.where(is_k, c_kth_g, c_kth)
    z_k = zk
    return phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z


@triton.jit
def _after_sums(q, cb, mb, bmin, bmax, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z,
                k, top_p, top, mp, m_mp, piv, C, M, CAP: tl.constexpr, NPIV: tl.constexpr):
    """Narrow the bracket with a refinement's sums (``cb, mb`` per pivot ``q``; the bracket's
    ``bmin, bmax``), resolving it where one value is left."""
    idx = tl.arange(0, NPIV)
    cb0 = tl.sum(tl.where(idx == 0, cb, 0), axis=0)
    mb0 = tl.sum(tl.where(idx == 0, mb, 0.0), axis=0)
    is_k = phase == PH_K
    T = top_p * z_k
    # the sub-bracket [a, b): the highest pivot still reaching k values (top-k) or mass T (top-p)
    sel = tl.where(is_k, c_hi + cb >= k, m_hi + mb >= T) | (idx == 0)
    a = tl.max(tl.where(sel, q, float("-inf")), axis=0)
    b = tl.min(tl.where(q > a, q, hi), axis=0)
    ca = tl.max(tl.where(q == a, cb, 0), axis=0)
    ma = tl.max(tl.where(q == a, mb, 0.0), axis=0)
    cbb = tl.max(tl.where(q == b, cb, 0), axis=0)
    mbb = tl.max(tl.where(q == b, mb, 0.0), axis=0)
    new_lo = tl.maximum(a, bmin)
    new_hi = tl.minimum(b, _next_up(bmax))
    # resolved: the bracket holds one value, top-p keeps all of it (its mass cannot reach T: rounding
    # against the bracket's bounds), or the sub-bracket spans one key
    whole = (bmin == bmax) | ((~is_k) & (m_hi + mb0 < T))
    v = tl.where(whole, bmin, new_lo)
    c_v = c_hi + tl.where(whole, cb0, ca)
    m_v = m_hi + tl.where(whole, mb0, ma)
    resolved = whole | (_key(new_hi) - _key(new_lo) <= 1)
    p_phase, p_lo, p_hi, p_chi, p_mhi, p_n, p_thr, p_z = _p_start(piv, C, M, v, c_v, m_v, top_p, top, mp, m_mp)
    f_thr = tl.maximum(v, mp)                   # top-p resolved at v, then min-p
    f_z = tl.where(mp > v, m_mp, m_v)
    # top-k: gather everything from new_lo up when it fits (resolves top-p as well)
    up = is_k & (c_hi + ca <= CAP)
    r_hi = tl.where(up, float("inf"), new_hi)
    r_n = tl.where(up, c_hi + ca, ca - cbb)
    r_chi = tl.where(up, 0, c_hi + cbb)
    r_mhi = tl.where(up, 0.0, m_hi + mbb)
    # min-p above every value the narrowed bracket may keep (top-k's only when top-p is off)
    cut = (~resolved) & (mp >= new_hi) & ((~is_k) | (top_p >= 1.0))
    k_res = resolved & is_k
    p_res = resolved & (~is_k)
    phase = tl.where(k_res, p_phase, tl.where(p_res | cut, PH_DONE, phase))
    thr = tl.where(k_res, p_thr, tl.where(p_res, f_thr, tl.where(cut, mp, thr)))
    z = tl.where(k_res, p_z, tl.where(p_res, f_z, tl.where(cut, m_mp, z)))
    kth = tl.where(k_res, v, kth)
    c_kth = tl.where(k_res, c_v, c_kth)
    z_k = tl.where(k_res, m_v, z_k)
    lo = tl.where(k_res, p_lo, new_lo)
    hi = tl.where(k_res, p_hi, r_hi)
    c_hi = tl.where(k_res, p_chi, r_chi)
    m_hi = tl.where(k_res, p_mhi, r_mhi)
    n = tl.where(k_res, p_n, r_n)
    return phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z


@triton.jit
def _gather_row(row_ptr, V, lo, hi, buf_ptr, CAP: tl.constexpr, TILE: tl.constexpr):
    """One program appends the row's values in ``[lo, hi)`` (at most ``CAP``) to ``buf_ptr``."""
    base = tl.full([], 0, tl.int32)
    for t0 in range(0, V, TILE):
        cols = t0 + tl.arange(0, TILE)
        ok = cols < V
        v = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        inb = (ok & (v >= lo) & (v < hi)).to(tl.int32)
        pos = base + tl.cumsum(inb, axis=0) - 1
        tl.store(buf_ptr + pos, v, mask=(inb != 0) & (pos < CAP))
        base += tl.sum(inb, axis=0)
    tl.debug_barrier()


@triton.jit
def _load_state(sf_ptr, si_ptr, r, NSF: tl.constexpr, NSI: tl.constexpr):
    f = sf_ptr + r * NSF
    i = si_ptr + r * NSI
    return (tl.load(i + I_PHASE), tl.load(f + F_LO), tl.load(f + F_HI), tl.load(i + I_CHI), tl.load(f + F_MHI),
            tl.load(i + I_N), tl.load(f + F_KTH), tl.load(i + I_CKTH), tl.load(f + F_ZK))


@triton.jit
def _store_state(sf_ptr, si_ptr, thr_ptr, z_ptr, r, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z,
                 NSF: tl.constexpr, NSI: tl.constexpr):
    f = sf_ptr + r * NSF
    i = si_ptr + r * NSI
    tl.store(i + I_PHASE, phase)
    tl.store(f + F_LO, lo)
    tl.store(f + F_HI, hi)
    tl.store(i + I_CHI, c_hi)
    tl.store(f + F_MHI, m_hi)
    tl.store(i + I_N, n)
    tl.store(f + F_KTH, kth)
    tl.store(i + I_CKTH, c_kth)
    tl.store(f + F_ZK, z_k)
    tl.store(thr_ptr + r, thr, mask=phase == PH_DONE)
    tl.store(z_ptr + r, z, mask=phase == PH_DONE)


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _stats_kernel(x_ptr, pmax_ptr, pmin_ptr, bm_ptr, V, NB, NSB, stride_xr, BLOCK_V: tl.constexpr,
                  SB: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block j, row r): max, min and the SB-column block maxima of BLOCK_V columns
    j = tl.program_id(0)
    r = tl.program_id(1)
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    v = tl.load(x_ptr + r.to(tl.int64) * stride_xr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    tl.store(pmax_ptr + r * NB + j, tl.max(v, axis=0))
    tl.store(pmin_ptr + r * NB + j, tl.min(tl.where(ok, v, float("inf")), axis=0))
    sub = tl.max(tl.reshape(v, (BLOCK_V // SB, SB)), axis=1)
    tl.store(bm_ptr + r * NSB + j * (BLOCK_V // SB) + tl.arange(0, BLOCK_V // SB), sub)


@triton.jit
def _pivot_pass_kernel(x_ptr, pmax_ptr, pmin_ptr, bm_ptr, lmp_ptr, pc_ptr, pm_ptr, V, NB, NSB, stride_xr,
                       BLOCK_V: tl.constexpr, TILE: tl.constexpr, NBP: tl.constexpr, NBM: tl.constexpr,
                       NVAL: tl.constexpr, PP: tl.constexpr, DELTA: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block j, row r): per first-pass pivot p, count(x >= p) and its mass over BLOCK_V columns
    j = tl.program_id(0)
    r = tl.program_id(1)
    piv, top, mn, mp = _first_pivots(pmax_ptr, pmin_ptr, bm_ptr, lmp_ptr, r, NB, NSB, NBP, NBM, NVAL, PP, DELTA)
    row_ptr = x_ptr + r.to(tl.int64) * stride_xr
    acc_c = tl.zeros([PP], dtype=tl.int32)
    acc_m = tl.zeros([PP], dtype=tl.float32)
    for t0 in range(0, BLOCK_V, TILE):
        cols = j * BLOCK_V + t0 + tl.arange(0, TILE)
        ok = cols < V
        v = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        e = tl.where(ok, tl.exp(v - top), 0.0)
        ge = ok[:, None] & (v[:, None] >= piv[None, :])
        acc_c += tl.sum(ge.to(tl.int32), axis=0)
        acc_m += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
    i = tl.arange(0, PP)
    tl.store(pc_ptr + (r * NB + j) * PP + i, acc_c)
    tl.store(pm_ptr + (r * NB + j) * PP + i, acc_m)


@triton.jit
def _pivot_step_kernel(pmax_ptr, pmin_ptr, bm_ptr, lmp_ptr, pc_ptr, pm_ptr, topk_ptr, topp_ptr, tv_ptr, tc_ptr,
                       tm_ptr, sf_ptr, si_ptr, thr_ptr, top_ptr, z_ptr, V, NB, NSB, NBP: tl.constexpr,
                       NBM: tl.constexpr, NVAL: tl.constexpr, PP: tl.constexpr, DELTA: tl.constexpr,
                       NBC: tl.constexpr, CAP: tl.constexpr, NSF: tl.constexpr, NSI: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row r): the pivots' counts and masses; top-k's bracket, or top-k resolved and top-p's
    r = tl.program_id(0)
    piv, top, mn, mp = _first_pivots(pmax_ptr, pmin_ptr, bm_ptr, lmp_ptr, r, NB, NSB, NBP, NBM, NVAL, PP, DELTA)
    C, M = _sum_partials(pc_ptr, pm_ptr, r * NB * PP, NB, PP, NBC)
    i = tl.arange(0, PP)
    tl.store(tv_ptr + r * PP + i, piv)
    tl.store(tc_ptr + r * PP + i, C)
    tl.store(tm_ptr + r * PP + i, M)
    tl.store(top_ptr + r, top)
    m_mp = tl.max(tl.where(i == PP - 1, M, 0.0), axis=0)
    tk = tl.load(topk_ptr + r)
    k = tl.where((tk > 0) & (tk < V), tk, V).to(tl.int32)
    top_p = tl.load(topp_ptr + r)
    # top-k's bracket [a, b); a is the minimum when k == V, and a == top leaves the top value alone
    a = tl.max(tl.where(C >= k, piv, float("-inf")), axis=0)
    c_a = tl.max(tl.where(piv == a, C, 0), axis=0)
    m_a = tl.max(tl.where(piv == a, M, 0.0), axis=0)
    b = tl.min(tl.where(piv > a, piv, float("inf")), axis=0)
    c_b = tl.max(tl.where(piv == b, C, 0), axis=0)
    m_b = tl.max(tl.where(piv == b, M, 0.0), axis=0)
    p_phase, p_lo, p_hi, p_chi, p_mhi, p_n, p_thr, p_z = _p_start(piv, C, M, a, c_a, m_a, top_p, top, mp, m_mp)
    k_res = (k >= V) | (a == top)
    up = c_a <= CAP                          # gather everything from a up (resolves top-p as well)
    cut = (top_p >= 1.0) & (mp >= b)         # min-p above top-k's whole bracket
    phase = tl.where(k_res, p_phase, tl.where(cut, PH_DONE, PH_K))
    thr = tl.where(k_res, p_thr, mp)
    z = tl.where(k_res, p_z, m_mp)
    lo = tl.where(k_res, p_lo, a)
    hi = tl.where(k_res, p_hi, tl.where(up, float("inf"), b))
    c_hi = tl.where(k_res, p_chi, tl.where(up, 0, c_b))
    m_hi = tl.where(k_res, p_mhi, tl.where(up, 0.0, m_b))
    n = tl.where(k_res, p_n, tl.where(up, c_a, c_a - c_b))
    _store_state(sf_ptr, si_ptr, thr_ptr, z_ptr, r, phase, lo, hi, c_hi, m_hi, n, a, c_a, m_a, thr, z, NSF, NSI)
    tl.store(si_ptr + r * NSI + I_CNT, 0)    # the next pass's gather counter


@triton.jit
def _round_pass_kernel(x_ptr, sf_ptr, si_ptr, top_ptr, buf_ptr, rc_ptr, rm_ptr, rmin_ptr, rmax_ptr, V, NB,
                       stride_xr, BLOCK_V: tl.constexpr, TILE: tl.constexpr, NPIV: tl.constexpr,
                       CAP: tl.constexpr, NSF: tl.constexpr, NSI: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block j, row r) of an open row: gather its bracket's values, or count its pivots
    j = tl.program_id(0)
    r = tl.program_id(1)
    if tl.load(si_ptr + r * NSI + I_PHASE) != PH_DONE:
        lo = tl.load(sf_ptr + r * NSF + F_LO)
        hi = tl.load(sf_ptr + r * NSF + F_HI)
        n = tl.load(si_ptr + r * NSI + I_N)
        top = tl.load(top_ptr + r)
        row_ptr = x_ptr + r.to(tl.int64) * stride_xr
        if n <= CAP:
            for t0 in range(0, BLOCK_V, TILE):
                cols = j * BLOCK_V + t0 + tl.arange(0, TILE)
                ok = cols < V
                v = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
                inb = (ok & (v >= lo) & (v < hi)).to(tl.int32)
                m = tl.sum(inb, axis=0)
                if m > 0:
                    # an integer slot counter: the order of the values differs run to run, the step sorts them
                    base = tl.atomic_add(si_ptr + r * NSI + I_CNT, m)
                    pos = base + tl.cumsum(inb, axis=0) - 1
                    tl.store(buf_ptr + r * 2 * CAP + pos, v, mask=(inb != 0) & (pos < CAP))
        else:
            q = _key_pivots(lo, hi, NPIV)
            cb, mb, bmin, bmax = _bracket_sums(row_ptr, j * BLOCK_V, j * BLOCK_V + BLOCK_V, V, lo, hi, top, q,
                                               TILE, NPIV)
            o = tl.arange(0, NPIV)
            tl.store(rc_ptr + (r * NB + j) * NPIV + o, cb)
            tl.store(rm_ptr + (r * NB + j) * NPIV + o, mb)
            tl.store(rmin_ptr + r * NB + j, bmin)
            tl.store(rmax_ptr + r * NB + j, bmax)


@triton.jit
def _round_step_kernel(x_ptr, sf_ptr, si_ptr, top_ptr, topk_ptr, topp_ptr, lmp_ptr, tv_ptr, tc_ptr, tm_ptr, buf_ptr,
                       rc_ptr, rm_ptr, rmin_ptr, rmax_ptr, thr_ptr, z_ptr, V, NB, stride_xr, PP: tl.constexpr,
                       NPIV: tl.constexpr, CAP: tl.constexpr, NBC: tl.constexpr, NBP: tl.constexpr,
                       CH: tl.constexpr, FINAL: tl.constexpr, FALLBACK: tl.constexpr, FTILE: tl.constexpr,
                       NSF: tl.constexpr, NSI: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row r) of an open row: resolve or narrow its bracket from the pass; the last step goes on alone
    r = tl.program_id(0)
    phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k = _load_state(sf_ptr, si_ptr, r, NSF, NSI)
    if phase != PH_DONE:
        thr = tl.full([], 0.0, tl.float32)
        z = tl.full([], 0.0, tl.float32)
        top = tl.load(top_ptr + r)
        tk = tl.load(topk_ptr + r)
        k = tl.where((tk > 0) & (tk < V), tk, V).to(tl.int32)
        top_p = tl.load(topp_ptr + r)
        mp = top + tl.load(lmp_ptr + r)
        i = tl.arange(0, PP)
        piv = tl.load(tv_ptr + r * PP + i)
        C = tl.load(tc_ptr + r * PP + i)
        M = tl.load(tm_ptr + r * PP + i)
        m_mp = tl.max(tl.where(i == PP - 1, M, 0.0), axis=0)
        buf = buf_ptr + r * 2 * CAP          # the gathered values, then the same sorted
        if n <= CAP:
            phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z = _after_gather(
                buf, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z, k, top_p, top, mp, m_mp, piv, C, M, CAP,
                CH)
        else:
            q = _key_pivots(lo, hi, NPIV)
            cb, mb = _sum_partials(rc_ptr, rm_ptr, r * NB * NPIV, NB, NPIV, NBC)
            o = tl.arange(0, NBP)
            bmin = tl.min(tl.load(rmin_ptr + r * NB + o, mask=o < NB, other=float("inf")), axis=0)
            bmax = tl.max(tl.load(rmax_ptr + r * NB + o, mask=o < NB, other=float("-inf")), axis=0)
            phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z = _after_sums(
                q, cb, mb, bmin, bmax, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z, k, top_p, top, mp,
                m_mp, piv, C, M, CAP, NPIV)
        if FINAL:
            # what is still open, one program scanning the row per iteration (module doc: the bound)
            row_ptr = x_ptr + r.to(tl.int64) * stride_xr
            for _ in range(FALLBACK):
                if phase != PH_DONE:
                    if n <= CAP:
                        _gather_row(row_ptr, V, lo, hi, buf, CAP, FTILE)
                        phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z = _after_gather(
                            buf, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z, k, top_p, top, mp, m_mp,
                            piv, C, M, CAP, CH)
                    else:
                        q = _key_pivots(lo, hi, NPIV)
                        cb, mb, bmin, bmax = _bracket_sums(row_ptr, 0, V, V, lo, hi, top, q, FTILE, NPIV)
                        phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z = _after_sums(
                            q, cb, mb, bmin, bmax, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z, k, top_p,
                            top, mp, m_mp, piv, C, M, CAP, NPIV)
            # unreachable by the bound's argument; a NaN rather than a wrong finite threshold if it were not
            open_ = phase != PH_DONE
            thr = tl.where(open_, float("nan"), thr)
            z = tl.where(open_, float("nan"), z)
            phase = tl.where(open_, PH_DONE, phase)
        _store_state(sf_ptr, si_ptr, thr_ptr, z_ptr, r, phase, lo, hi, c_hi, m_hi, n, kth, c_kth, z_k, thr, z,
                     NSF, NSI)
    tl.store(si_ptr + r * NSI + I_CNT, 0)    # the next pass's gather counter


# ---------------------------------------------------------------------------------------------
# launcher

def _fallback_rounds(npiv: int) -> int:
    """Iterations the last step's loop needs at most: per phase, ``ceil(32 / log2(npiv))`` passes
    bring a bracket's key span (< 2**32) to one key (module doc); two phases."""
    return 2 * math.ceil(32 / math.log2(npiv))


def threshold_block_v(R: int, V: int, sms: int) -> int:
    """Columns per program of the passes: about ``_PROGRAMS_PER_SM`` programs per SM over the ``R``
    rows, at most ``_MAX_PROGRAMS_PER_ROW`` per row (a step sums every program's partials alone):
    ``R = 1, V = 65536`` on 132 SMs: 1024 columns, 64 programs; ``R = 9``: 4096 columns, 16."""
    per_row = max(1, min(_MAX_PROGRAMS_PER_ROW, triton.cdiv(_PROGRAMS_PER_SM * sms, max(R, 1))))
    return max(_MIN_BLOCK_V, min(_MAX_BLOCK_V, triton.next_power_of_2(triton.cdiv(V, per_row))))


def _check(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x [R, V], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"threshold_filter takes a floating-point x, got {x.dtype}")
    if not 1 <= x.shape[1] < 2**31 - 1:
        raise ValueError(f"threshold_filter: V = {x.shape[1]} must be in [1, 2**31 - 1)")
    R = x.shape[0]
    if top_k.shape != (R,) or top_k.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"threshold_filter: top_k must be int32 / int64 [R] = [{R}], got {top_k.dtype} "
                         f"{tuple(top_k.shape)}")
    for name, t in (("top_p", top_p), ("min_p", min_p)):
        if t.shape != (R,) or t.dtype != torch.float32:
            raise ValueError(f"threshold_filter: {name} must be fp32 [R] = [{R}], got {t.dtype} {tuple(t.shape)}")


def threshold_filter_triton(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                            block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on the Triton kernels (``block_v``: launch override, for tests)."""
    _check(x, top_k, top_p, min_p)
    R, V = x.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    thr, top, z = (torch.empty(R, **f32) for _ in range(3))
    if R == 0:
        return thr, top, z
    if x.stride(1) != 1:
        x = x.contiguous()
    top_k, top_p = top_k.contiguous(), top_p.contiguous()
    log_min_p = torch.log(min_p)              # torch's log, so min-p's cut equals the reference's bits
    sb = triton.next_power_of_2(triton.cdiv(V, _NBM))
    bv = max(block_v or threshold_block_v(R, V, _sm_count(dev)), sb)
    nb = triton.cdiv(V, bv)
    nsb = nb * (bv // sb)
    nbp = max(2, triton.next_power_of_2(nb))
    # columns compared against every pivot at once: on the GPU what fits registers, in the interpreter
    # what keeps its numpy arrays large but within Triton's 2**20 elements
    tile, rtile, ftile = (16, 32, 128) if dev.type == "cuda" else (2048, 8192, 8192)
    pmax, pmin = torch.empty(R, nb, **f32), torch.empty(R, nb, **f32)
    bm = torch.empty(R, nsb, **f32)
    pc, pm = torch.empty(R, nb, _PP, **i32), torch.empty(R, nb, _PP, **f32)
    tv, tc, tm = torch.empty(R, _PP, **f32), torch.empty(R, _PP, **i32), torch.empty(R, _PP, **f32)
    sf, si = torch.empty(R, _NSF, **f32), torch.empty(R, _NSI, **i32)
    buf = torch.empty(R, 2 * _CAP, **f32)
    rc, rm = torch.empty(R, nb, _NPIV, **i32), torch.empty(R, nb, _NPIV, **f32)
    rmin, rmax = torch.empty(R, nb, **f32), torch.empty(R, nb, **f32)
    pdl = pdl_kwargs(x)
    warps = 4 if bv >= 1024 else 2
    _stats_kernel[(nb, R)](x, pmax, pmin, bm, V, nb, nsb, x.stride(0), BLOCK_V=bv, SB=sb, num_warps=warps, **pdl)
    _pivot_pass_kernel[(nb, R)](x, pmax, pmin, bm, log_min_p, pc, pm, V, nb, nsb, x.stride(0), BLOCK_V=bv,
                                TILE=min(tile, bv), NBP=nbp, NBM=_NBM, NVAL=_NVAL, PP=_PP, DELTA=_DELTA,
                                num_warps=4, **pdl)
    _pivot_step_kernel[(R,)](pmax, pmin, bm, log_min_p, pc, pm, top_k, top_p, tv, tc, tm, sf, si, thr, top, z, V,
                             nb, nsb, NBP=nbp, NBM=_NBM, NVAL=_NVAL, PP=_PP, DELTA=_DELTA, NBC=_NBC, CAP=_CAP,
                             NSF=_NSF, NSI=_NSI, num_warps=4, **pdl)
    for rnd in range(_ROUNDS):
        _round_pass_kernel[(nb, R)](x, sf, si, top, buf, rc, rm, rmin, rmax, V, nb, x.stride(0), BLOCK_V=bv,
                                    TILE=min(rtile, bv), NPIV=_NPIV, CAP=_CAP, NSF=_NSF, NSI=_NSI, num_warps=4, **pdl)
        _round_step_kernel[(R,)](x, sf, si, top, top_k, top_p, log_min_p, tv, tc, tm, buf, rc, rm, rmin, rmax, thr,
                                 z, V, nb, x.stride(0), PP=_PP, NPIV=_NPIV, CAP=_CAP, NBC=_NBC, NBP=nbp,
                                 CH=_RANK_CHUNK, FINAL=rnd == _ROUNDS - 1, FALLBACK=_fallback_rounds(_NPIV),
                                 FTILE=min(ftile, triton.next_power_of_2(V)), NSF=_NSF, NSI=_NSI, num_warps=4, **pdl)
    return thr, top, z


# ---------------------------------------------------------------------------------------------
# reference

def threshold_filter_reference(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same semantics from sorted rows, the masses in float64."""
    x = x.float()
    V = x.shape[1]
    xs = torch.sort(x, dim=-1, descending=True).values
    top = xs[:, 0].contiguous()
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).long()
    kth = xs.gather(1, (k - 1)[:, None])
    e = torch.exp((xs - top[:, None]).double()) * (xs >= kth)
    before = e.cumsum(dim=-1) - e                       # a tie group's first token: the mass strictly above it
    keep = (before < top_p.double()[:, None] * e.sum(dim=-1, keepdim=True)).sum(dim=-1).clamp(min=1)
    t = torch.maximum(xs.gather(1, (keep - 1)[:, None]), kth)[:, 0]
    t = torch.where(top_p >= 1.0, kth[:, 0], t)
    threshold = torch.maximum(t, top + torch.log(min_p))
    z = torch.where(x >= threshold[:, None], torch.exp(x.double() - top.double()[:, None]), 0.0).sum(dim=-1)
    return threshold, top, z.float()


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::threshold_filter", mutates_args=())
def threshold_filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x [R, V]`` with ``top_k [R]`` (0: off), fp32 ``top_p [R]`` (1: off) and
    ``min_p [R]`` (0: off): fp32 ``(threshold, top, z) [R]`` (module doc)."""
    if use_triton(x):
        return threshold_filter_triton(x, top_k, top_p, min_p)
    _check(x, top_k, top_p, min_p)  # the same limits on every device
    return threshold_filter_reference(x, top_k, top_p, min_p)


@threshold_filter.register_kernel("cuda")
def _threshold_filter_cuda(x, top_k, top_p, min_p):
    return threshold_filter_triton(x, top_k, top_p, min_p)


@threshold_filter.register_fake
def _threshold_filter_fake(x, top_k, top_p, min_p):
    _check(x, top_k, top_p, min_p)
    return tuple(x.new_empty((x.shape[0],), dtype=torch.float32) for _ in range(3))
