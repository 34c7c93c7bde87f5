"""The greedy Markov walk (op.py) as a fixed-point (Jacobi) iteration over the block's slots.

Why: at batch 1 the walk is a chain of nine dependent slots, ~9 us each however ``w2`` is held. But
the vanilla head's bias depends only on the previous token, ``bias_k = w2 @ w1[prev_k]``, and the base
logits of every slot are known before the walk starts. So all slots are computed at once from
*guessed* previous tokens, and the guesses corrected until nothing changes:

    pass 0:  x0[k] = argmax(base[k])                                      (guesses, no bias)
    pass i:  xi[k] = argmax(base[k] + bias(prev_i[k])),  prev_i[0] = anchor, prev_i[k] = x(i-1)[k-1]
    stop when prev_(i+1) == prev_i (every slot's previous token is what that pass produced), or after G passes

It is exact, not approximate: slot 0 of every biased pass uses the anchor, so it is the walk's
token; if pass ``i``'s slots ``0 .. m`` are exact then pass ``i + 1``'s slots ``0 .. m + 1`` are, so
after ``G`` biased passes all are; and at a fixed point each slot's previous token is the token the
same pass computed for the slot before it, which by induction from slot 0 makes every slot the
sequential walk's. Each slot's logits come from the same code and previous token as the persistent
walk's (persistent.py's grid, slice ownership, resident blocks and barrier), so the tokens are the
same bits.

Cost: one cheap pass over ``base`` plus one biased pass per iteration, each ended by a grid barrier,
in one launch. When the bias never moves a guessed slot's argmax, one biased pass suffices: one read
of ``w2`` instead of nine (27 us against the step kernels' 82: docs/decisions.md). A checkpoint whose bias
often moves the argmax needs up to ``G`` passes (then about a sequential walk plus the base pass;
``Engine(markov_walk="persistent")`` is the choice for such heads). With ``count_passes`` the kernel
tallies its passes (:func:`jacobi_pass_counts`), so a benchmark can say which case it measured.

Lanes: the tile's 16 rows are ``(batch row, slot)`` pairs, so a launch takes ``B * G <= 16`` lanes
(one row of a nine-token block); ops/routing.py ``walk_kernel`` sends other walks elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs
from ..argmax_rows import block_argmax, combine_argmax
from ..routing import WALK_LANES, WALK_MAX_RANK
from .persistent import (_COUNTERS, PersistentWalkConfig, _grid_barrier, _load_resident,
                                     _reduce_pass, _slice_argmax, counters_for, programs_for)
from ..tuning import tuned
from ..weight_rounding import ROUND_MODE


# ---------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _previous_tokens(pv_ptr, pi_ptr, it, lanes, slot, anchor, lane_ok, P,
                     BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr):
    """Each lane's previous token after pass ``it`` (``P`` partials per lane): the anchor for slot 0,
    else the argmax of the lane before it (the same row's previous slot)."""
    x = _reduce_pass(pv_ptr, pi_ptr, it, tl.where(slot == 0, lanes, lanes - 1), lane_ok, P, BLOCK_L, BLOCK_P)
    return tl.where(slot == 0, anchor, tl.where(lane_ok, x, 0))


@triton.jit
def _markov_walk_jacobi_kernel(
    base_ptr, anchor_ptr, w1_ptr, w2_ptr, pv_ptr, pi_ptr, tok_ptr, sync_ptr, stats_ptr,
    B, G, V, P,
    stride_bb, stride_bk, stride_w1, stride_w2, stride_tb,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr,
    N_BLOCKS: tl.constexpr, RESIDENT: tl.constexpr, STREAM_FROM: tl.constexpr, BLOCK_P: tl.constexpr,
    ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, COUNT_PASSES: tl.constexpr,
    POLL_ASM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py; safe at entry (ops/markov_walk/persistent.py)
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    sync_ptr = sync_ptr.to(tl.pointer_type(tl.uint32))
    first_col = j * (N_BLOCKS * BLOCK_V)
    lanes = tl.arange(0, BLOCK_L)
    lane_ok = lanes < B * G
    row = tl.where(lane_ok, lanes // G, 0)
    slot = tl.where(lane_ok, lanes % G, 0)
    lane_off = row.to(tl.int64) * stride_bb + slot.to(tl.int64) * stride_bk
    rk = tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    # the resident blocks depend on no earlier kernel: requested before the wait
    w_res0, w_res1 = _load_resident(w2_ptr, first_col, offs_v, rk, V, RANK, stride_w2, RESIDENT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    anchor = tl.load(anchor_ptr + row, mask=lane_ok, other=0).to(tl.int32)   # the int32 of the argmax indices

    prev = _guess_pass(base_ptr, pv_ptr, pi_ptr, sync_ptr, lanes, slot, anchor, lane_ok, lane_off, first_col, offs_v,
                       j, V, P, BLOCK_L, BLOCK_P, N_BLOCKS, POLL_ASM)

    # biased passes until a fixed point (every program reduces the same partials, so all agree on
    # when to stop and pass the same number of barriers) or G passes
    it = tl.full((), 0, tl.int32)
    changed = tl.full((), 1, tl.int32)
    while changed > 0:
        it += 1
        e = tl.load(w1_ptr + prev.to(tl.int64)[:, None] * stride_w1 + rk[None, :],
                    mask=lane_ok[:, None] & (rk < RANK)[None, :], other=0.0)
        best_v, best_i = _slice_argmax(e, w_res0, w_res1, w2_ptr, base_ptr, lane_off, lane_ok, first_col, offs_v, rk,
                                       V, stride_w2, RANK, N_BLOCKS, RESIDENT, STREAM_FROM, ROUND, DOT_PRECISION,
                                       UPCAST)
        part = (it * BLOCK_L + lanes) * P + j
        tl.store(pv_ptr + part, best_v, mask=lane_ok)
        tl.store(pi_ptr + part, best_i, mask=lane_ok)
        _grid_barrier(sync_ptr, P, POLL_ASM)
        new_prev = _previous_tokens(pv_ptr, pi_ptr, it, lanes, slot, anchor, lane_ok, P, BLOCK_L, BLOCK_P)
        changed = tl.sum(tl.where(lane_ok & (new_prev != prev), 1, 0))
        changed = tl.where(it >= G, 0, changed)
        prev = new_prev

    if j == 0:  # the tokens: each lane's own argmax in the last pass
        tok = _reduce_pass(pv_ptr, pi_ptr, it, lanes, lane_ok, P, BLOCK_L, BLOCK_P)
        tl.store(tok_ptr + row * stride_tb + slot, tok.to(tl.int64), mask=lane_ok)
        if COUNT_PASSES:  # biased passes, and walks (jacobi_pass_counts)
            tl.atomic_add(stats_ptr, it.to(tl.int64))
            tl.atomic_add(stats_ptr + 1, tl.full((), 1, tl.int64))


@triton.jit
def _guess_pass(base_ptr, pv_ptr, pi_ptr, sync_ptr, lanes, slot, anchor, lane_ok, lane_off, first_col, offs_v, j,
                V, P, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, N_BLOCKS: tl.constexpr, POLL_ASM: tl.constexpr):
    """Pass 0: each slot's base argmax over this program's columns, a grid barrier, the guesses'
    previous tokens."""
    g_ok = lane_ok[:, None] & (first_col + offs_v < V)[None, :]
    g = tl.load(base_ptr + lane_off[:, None] + (first_col + offs_v)[None, :], mask=g_ok, other=0.0).to(tl.float32)
    guess_v = tl.where(g_ok, g, float("-inf"))
    guess_i = tl.where(g_ok, (first_col + offs_v)[None, :], 2147483647)
    for blk in range(1, N_BLOCKS):
        g_cols = first_col + blk * offs_v.shape[0] + offs_v
        g_ok = lane_ok[:, None] & (g_cols < V)[None, :]
        g = tl.load(base_ptr + lane_off[:, None] + g_cols[None, :], mask=g_ok, other=0.0).to(tl.float32)
        guess_v, guess_i = combine_argmax(guess_v, guess_i, tl.where(g_ok, g, float("-inf")),
                                          tl.where(g_ok, g_cols[None, :], 2147483647))
    g_best_v, g_best_i = block_argmax(guess_v, guess_i, lane_ok[:, None] & (guess_i < 2147483647), 1)
    tl.store(pv_ptr + lanes * P + j, g_best_v, mask=lane_ok)
    tl.store(pi_ptr + lanes * P + j, g_best_i, mask=lane_ok)
    _grid_barrier(sync_ptr, P, POLL_ASM)
    return _previous_tokens(pv_ptr, pi_ptr, 0, lanes, slot, anchor, lane_ok, P, BLOCK_L, BLOCK_P)


# ---------------------------------------------------------------------------------------------
# launcher

# 128-column blocks, two of a program's four kept on chip: 27.0 us per one-pass walk against 32.7
# for the persistent walk's default (256 columns, one resident; docs/decisions.md)
JACOBI_DEFAULT = PersistentWalkConfig(block_v=128, resident=2, num_warps=8, num_stages=2)


def jacobi_walk_config() -> PersistentWalkConfig:
    """Defaults, overridable by ``LFMSPARK_TUNE`` kind ``walk_jacobi`` (ops/tuning.py)."""
    d = JACOBI_DEFAULT
    return PersistentWalkConfig(block_v=tuned("walk_jacobi", "block_v", d.block_v),
                                resident=tuned("walk_jacobi", "resident", d.resident),
                                num_warps=tuned("walk_jacobi", "num_warps", d.num_warps),
                                num_stages=tuned("walk_jacobi", "num_stages", d.num_stages))


def markov_greedy_walk_jacobi(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                              config: PersistentWalkConfig | None = None, count_passes: bool = False) -> torch.Tensor:
    """The walk as a fixed-point iteration in one launch; inputs already checked and laid out by
    ``markov_greedy_walk_triton`` (``base [B, G, V]`` with unit column stride, contiguous ``w1`` /
    ``w2`` rows). ``config``: launch parameters (default :func:`jacobi_walk_config`). ``count_passes``:
    tally the passes for :func:`jacobi_pass_counts` (the benchmark's; compiled out otherwise)."""
    B, G, V = base.shape
    rank = w2.shape[1]
    cfg = config or jacobi_walk_config()
    if not 1 <= B * G <= WALK_LANES or rank > WALK_MAX_RANK:
        raise ValueError(f"the Jacobi walk takes 1-{WALK_LANES} (row, slot) lanes and a rank up to {WALK_MAX_RANK}, "
                         f"got {B} x {G} lanes and rank {rank}: use markov_greedy_walk_triton, which picks another "
                         "kernel")
    if not 0 <= cfg.resident <= 2:
        raise ValueError(f"resident = {cfg.resident}: a program keeps 0, 1 or 2 blocks on chip")
    interpreted = base.device.type != "cuda"
    P, n_blocks = programs_for(V, cfg.block_v, base.device, 1 if interpreted else cfg.programs)
    resident = min(cfg.resident, n_blocks)
    tokens = torch.empty((B, G), dtype=torch.int64, device=base.device)
    pv = torch.empty((G + 1, WALK_LANES, P), dtype=torch.float32, device=base.device)   # per pass, so no pass
    pi = torch.empty((G + 1, WALK_LANES, P), dtype=torch.int32, device=base.device)     # overwrites one still read
    sync, stats = counters_for(w2)
    _markov_walk_jacobi_kernel[(P,)](
        base, anchor, w1, w2, pv, pi, tokens, sync, stats,
        B, G, V, P,
        base.stride(0), base.stride(1), w1.stride(0), w2.stride(0), tokens.stride(0),
        RANK=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_L=WALK_LANES, BLOCK_V=cfg.block_v,
        N_BLOCKS=n_blocks, RESIDENT=resident, STREAM_FROM=max(resident, 1), BLOCK_P=max(16, triton.next_power_of_2(P)),
        ROUND=ROUND_MODE[w2.dtype], DOT_PRECISION="ieee" if w2.dtype == torch.float32 else "tf32",
        UPCAST=interpreted and w2.dtype != torch.float32, COUNT_PASSES=count_passes, POLL_ASM=not interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(base),
    )
    return tokens


def jacobi_pass_counts() -> tuple[int, int]:
    """``(biased passes, walks)`` run by the Jacobi kernel with ``count_passes`` in this process so far
    (``DSparkDraft.count_walk_passes``), summed over devices and weights (reads the device counters: a synchronising copy, for benchmarks and tests, never
    inside a capture). ``passes / walks`` is the mean number of ``w2`` passes per walk: 1 when no
    Markov bias moved a guessed slot, up to ``G``."""
    passes = walks = 0
    for _, stats in _COUNTERS.values():
        p, w = stats.tolist()
        passes, walks = passes + p, walks + w
    return passes, walks
