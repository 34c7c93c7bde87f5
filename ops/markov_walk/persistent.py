"""The greedy Markov walk (op.py) in one persistent launch: ``G`` steps, one grid barrier each.

Why: the step kernels re-read the whole ``w2`` (``[65536, 256]`` bf16, 33.5 MB) at every one of the
block's slots and pay a launch hand-off per slot. Every slot multiplies the same matrix, so here each
program owns a fixed slice of ``w2``'s rows for the whole walk, keeps its first ``RESIDENT`` column
blocks on chip (loaded before the PDL wait, beside the LM head's tail), streams the rest, and the
slots are separated by a grid barrier instead of launches. It beats the step kernels for 2-16 rows
and loses at one (docs/decisions.md; ops/routing.py ``WALK_GRID_ROWS``); a slot still costs ~9.5 us of serial
chain (barrier, partials' and ``w1[prev]``'s L2 round trips, argmax), which jacobi.py removes.

Design: grid ``(P,)``, at most one program per SM, so every program is resident at once (the barrier
needs that; :func:`programs_for` sizes it). Program ``j`` owns columns ``[j * N_BLOCKS * BLOCK_V, (j +
1) * N_BLOCKS * BLOCK_V)``. Step ``k``: ``e = w1[prev]``, bias and argmax over its columns (the step
kernel's numerics), one partial ``(max, index)`` per row to ``[G, BLOCK_B, P]`` scratch, the barrier,
then every program reduces the ``P`` partials of its rows to ``prev`` (program 0 stores the token).

The barrier is one uint32 in ``sync``, 0 or ``2**31`` at rest: each program adds 1 (program 0 adds
``2**31 - (P - 1)``) after its partial stores (a CTA barrier, then a release add) and spins with
acquire reads until bit 31 differs from what its add returned; the last arrival flips it and leaves
the low bits as they were, so the counter needs no reset (the scheme of Inductor's cooperative
reductions). So one ``sync`` must not serve two walks running at once (one per weight and device,
:func:`counters_for`), and a grid that cannot be resident at once would spin forever: ``P`` never
exceeds the SM count, and an MPS thread limit routes to the step kernels (ops/routing.py). PDL: the
trigger at entry is safe, as a successor's programs launch only once all ``P`` programs are resident.

The Triton interpreter runs programs one after another, so there the grid is a single program
(``P = 1``: its barrier is its own add), which still runs every line of the kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs
from ..argmax_rows import block_argmax, combine_argmax
from ..routing import WALK_GRID_ROWS, WALK_MAX_RANK
from ..tuning import tuned
from ..weight_rounding import ROUND_MODE, round_to_weight_dtype

MAX_ROWS = WALK_GRID_ROWS[1]   # one 16-row MMA tile


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _block_values(e, w, base_ptr, row_off, row_ok, cols, V,
                  ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``base[row_off + cols] + round(e @ w.T)`` (``row_off``: each tile row's int64 offset of its base
    logits) and the column indices, ``(-inf, 2**31 - 1)`` where invalid."""
    ok = row_ok[:, None] & (cols < V)[None, :]
    base = tl.load(base_ptr + row_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if UPCAST:  # the interpreter multiplies bf16 dot operands as raw integers
        e, w = e.to(tl.float32), w.to(tl.float32)
    bias = round_to_weight_dtype(tl.dot(e, tl.trans(w), input_precision=DOT_PRECISION), ROUND)
    return tl.where(ok, base + bias, float("-inf")), tl.where(ok, cols[None, :], 2147483647)


@triton.jit
def _load_w2_block(w2_ptr, cols, rk, V, RANK: tl.constexpr, stride_w2):
    """``w2[cols, :]`` as a ``[BLOCK_V, BLOCK_R]`` tile; columns past ``V`` read row ``c % V`` (never kept)."""
    ptrs = w2_ptr + (cols % V).to(tl.int64)[:, None] * stride_w2 + rk[None, :]
    if RANK == rk.shape[0]:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(rk < RANK)[None, :], other=0.0)


@triton.jit
def _grid_barrier(sync_ptr, P, POLL_ASM: tl.constexpr):
    """Return once all ``P`` programs have called this (see the module doc)."""
    tl.debug_barrier()                    # every thread's partial stores precede the release below
    # program 0 adds 2**31 - (P - 1), the others 1: the last arrival flips bit 31, the rest ends as it was
    one = tl.full((), 1, tl.uint32)
    top = one << 31
    arrive = tl.where(tl.program_id(0) == 0, top - (tl.cast(P, tl.uint32) - one), one)
    before = tl.atomic_add(sync_ptr, arrive, sem="release")
    flipped = False
    while not flipped:
        if POLL_ASM:  # a plain acquire load: polls need no read-modify-write at the counter's L2 slice
            now = tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [sync_ptr],
                                            dtype=tl.uint32, is_pure=False, pack=1)
        else:
            now = tl.atomic_add(sync_ptr, 0, sem="acquire")
        flipped = ((before ^ now) & top) != 0
    tl.debug_barrier()                    # no thread reads the partials before the acquire


@triton.jit
def _load_resident(w2_ptr, first_col, offs_v, rk, V, RANK: tl.constexpr, stride_w2, RESIDENT: tl.constexpr):
    """The program's first ``RESIDENT`` (0-2) column blocks of ``w2``, kept on chip for every slot /
    pass (:func:`_slice_argmax`); placeholders past ``RESIDENT``."""
    w_res0 = 0
    w_res1 = 0
    if RESIDENT >= 1:
        w_res0 = _load_w2_block(w2_ptr, first_col + offs_v, rk, V, RANK, stride_w2)
    if RESIDENT >= 2:
        w_res1 = _load_w2_block(w2_ptr, first_col + offs_v.shape[0] + offs_v, rk, V, RANK, stride_w2)
    return w_res0, w_res1


@triton.jit
def _slice_argmax(e, w_res0, w_res1, w2_ptr, base_ptr, row_off, row_ok, first_col, offs_v, rk, V, stride_w2,
                  RANK: tl.constexpr, N_BLOCKS: tl.constexpr, RESIDENT: tl.constexpr, STREAM_FROM: tl.constexpr,
                  ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Per tile row, ``(max, first index)`` of ``base + round(e @ w2[cols].T)`` over the program's slice
    of ``N_BLOCKS`` column blocks: the ``RESIDENT`` blocks held on chip (``w_res0``, ``w_res1``; the
    callers pass placeholders past ``RESIDENT``), then the others streamed. Per lane the best of its
    columns over the blocks (ascending, so a tie keeps the first), one reduction across lanes at the end."""
    if RESIDENT >= 1:
        w0 = w_res0
    else:
        w0 = _load_w2_block(w2_ptr, first_col + offs_v, rk, V, RANK, stride_w2)
    lane_v, lane_i = _block_values(e, w0, base_ptr, row_off, row_ok, first_col + offs_v, V, ROUND, DOT_PRECISION,
                                   UPCAST)
    if RESIDENT >= 2:
        v, i = _block_values(e, w_res1, base_ptr, row_off, row_ok, first_col + offs_v.shape[0] + offs_v, V,
                             ROUND, DOT_PRECISION, UPCAST)
        lane_v, lane_i = combine_argmax(lane_v, lane_i, v, i)
    for blk in range(STREAM_FROM, N_BLOCKS):   # streamed: from L2 after the first slot / pass
        cols = first_col + blk * offs_v.shape[0] + offs_v
        w = _load_w2_block(w2_ptr, cols, rk, V, RANK, stride_w2)
        v, i = _block_values(e, w, base_ptr, row_off, row_ok, cols, V, ROUND, DOT_PRECISION, UPCAST)
        lane_v, lane_i = combine_argmax(lane_v, lane_i, v, i)
    return block_argmax(lane_v, lane_i, row_ok[:, None] & (lane_i < 2147483647), 1)


@triton.jit
def _reduce_pass(pv_ptr, pi_ptr, k, src, row_ok, P, BLOCK_ROWS: tl.constexpr, BLOCK_P: tl.constexpr):
    """The argmax index of tile rows ``src`` after slot / pass ``k``: their ``P`` partials (one per
    program, in column order) from ``[*, BLOCK_ROWS, P]`` scratch; ``.cg``: from L2, never a stale L1 line."""
    offs_p = tl.arange(0, BLOCK_P)
    ok = row_ok[:, None] & (offs_p < P)[None, :]
    pp = (k * BLOCK_ROWS + src)[:, None] * P + offs_p[None, :]
    v = tl.load(pv_ptr + pp, mask=ok, other=0.0, cache_modifier=".cg")
    i = tl.load(pi_ptr + pp, mask=ok, other=0, cache_modifier=".cg")
    return block_argmax(v, i, ok, 1)[1]


@triton.jit
def _markov_walk_persistent_kernel(
    base_ptr, anchor_ptr, w1_ptr, w2_ptr, pv_ptr, pi_ptr, tok_ptr, sync_ptr,
    B, G, V, P,
    stride_bb, stride_bk, stride_w1, stride_w2, stride_tb,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    N_BLOCKS: tl.constexpr, RESIDENT: tl.constexpr, STREAM_FROM: tl.constexpr, BLOCK_P: tl.constexpr,
    ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    POLL_ASM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py; safe at entry (module doc)
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    sync_ptr = sync_ptr.to(tl.pointer_type(tl.uint32))
    first_col = j * (N_BLOCKS * BLOCK_V)
    rows = tl.arange(0, BLOCK_B)
    row_ok = rows < B
    rk = tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    # the resident blocks depend on no earlier kernel: requested before the wait
    w_res0, w_res1 = _load_resident(w2_ptr, first_col, offs_v, rk, V, RANK, stride_w2, RESIDENT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    prev = tl.load(anchor_ptr + rows, mask=row_ok, other=0).to(tl.int32)   # the int32 of the argmax indices
    for k in range(G):
        row_off = rows.to(tl.int64) * stride_bb + k * stride_bk
        e = tl.load(w1_ptr + prev.to(tl.int64)[:, None] * stride_w1 + rk[None, :],
                    mask=row_ok[:, None] & (rk < RANK)[None, :], other=0.0)
        best_v, best_i = _slice_argmax(e, w_res0, w_res1, w2_ptr, base_ptr, row_off, row_ok, first_col, offs_v, rk, V,
                                       stride_w2, RANK, N_BLOCKS, RESIDENT, STREAM_FROM, ROUND, DOT_PRECISION, UPCAST)
        part = (k * BLOCK_B + rows) * P + j
        tl.store(pv_ptr + part, best_v, mask=row_ok)
        tl.store(pi_ptr + part, best_i, mask=row_ok)
        _grid_barrier(sync_ptr, P, POLL_ASM)
        prev = tl.where(row_ok, _reduce_pass(pv_ptr, pi_ptr, k, rows, row_ok, P, BLOCK_B, BLOCK_P), 0)
        if j == 0:
            tl.store(tok_ptr + rows * stride_tb + k, prev.to(tl.int64), mask=row_ok)


# ---------------------------------------------------------------------------------------------
# launcher

@dataclass(frozen=True)
class PersistentWalkConfig:
    """Launch parameters: ``block_v`` columns per block, the first ``resident`` (0-2) of a program's
    blocks kept on chip (shared memory) across the slots, ``programs`` (None: as many as the SMs
    allow; the interpreter: 1)."""
    block_v: int = 256
    resident: int = 1
    num_warps: int = 8
    num_stages: int = 2
    programs: int | None = None


def persistent_walk_config() -> PersistentWalkConfig:
    """Defaults, overridable by ``LFMSPARK_TUNE`` kind ``walk_grid`` (ops/tuning.py)."""
    d = PersistentWalkConfig()
    return PersistentWalkConfig(block_v=tuned("walk_grid", "block_v", d.block_v),
                                resident=tuned("walk_grid", "resident", d.resident),
                                num_warps=tuned("walk_grid", "num_warps", d.num_warps),
                                num_stages=tuned("walk_grid", "num_stages", d.num_stages))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs_for(V: int, block_v: int, device: torch.device, programs: int | None) -> tuple[int, int]:
    """``(P, N_BLOCKS)``: the fewest column blocks per program that keep ``P`` within the SM count
    (or ``programs``), then the programs that covers the vocabulary with."""
    limit = programs or _sm_count(device)
    n_col_blocks = triton.cdiv(V, block_v)
    n_blocks = triton.cdiv(n_col_blocks, min(limit, n_col_blocks))
    return triton.cdiv(n_col_blocks, n_blocks), n_blocks


def resident_blocks(n_blocks: int, wanted: int) -> int:
    """The column blocks a program of ``n_blocks`` keeps on chip: ``wanted`` while at most one block
    streams, else none. Why: once two or more blocks stream, the loop is software-pipelined and its
    stage buffers and a resident ``[256, 256]`` bf16 block no longer fit an sm_90's 227 KB of shared
    memory together (268 KB at four blocks a program, a 128,000-token vocabulary; 143 KB without the
    resident block: scripts/compile_sm90.py)."""
    resident = min(wanted, n_blocks)
    return resident if n_blocks - resident <= 1 else 0


_COUNTERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def counters_for(w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sync, stats)`` of walks over ``w2``: the barrier counter (module doc: one per weight and
    device, shared by this walk and the Jacobi walk, which never run at the same time over one
    weight) and the Jacobi walk's ``(passes, walks)`` int64 tallies (ops/markov_walk/jacobi.py).
    Created outside CUDA-graph capture only: a ``torch.zeros`` inside a capture is merely recorded,
    and a walk run before that graph's first replay would find a counter that is not at rest (the
    barrier would then let programs through early, silently)."""
    key = (w2.device, w2.data_ptr())
    if key not in _COUNTERS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the persistent Markov walk over these weights is first called inside a CUDA-graph "
                               "capture: run it once before capturing (Engine.warmup does), or build the "
                               "engine with markov_walk='steps'")
        _COUNTERS[key] = (torch.zeros(1, dtype=torch.int32, device=w2.device),
                          torch.zeros(2, dtype=torch.int64, device=w2.device))
    return _COUNTERS[key]


def markov_greedy_walk_persistent(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                                  config: PersistentWalkConfig | None = None) -> torch.Tensor:
    """The walk in one launch; inputs already checked and laid out by ``markov_greedy_walk_triton``
    (``base [B, G, V]`` with unit column stride, contiguous ``w1`` / ``w2`` rows, ``B <= MAX_ROWS``)."""
    B, G, V = base.shape
    rank = w2.shape[1]
    cfg = config or persistent_walk_config()
    if not 1 <= B <= MAX_ROWS or rank > WALK_MAX_RANK:
        raise ValueError(f"the persistent walk takes 1-{MAX_ROWS} rows and a rank up to {WALK_MAX_RANK}, got {B} rows and "
                         f"rank {rank}: use markov_greedy_walk_triton, which takes the step kernels there")
    if not 0 <= cfg.resident <= 2:
        raise ValueError(f"resident = {cfg.resident}: a program keeps 0, 1 or 2 blocks on chip")
    interpreted = base.device.type != "cuda"
    P, n_blocks = programs_for(V, cfg.block_v, base.device, 1 if interpreted else cfg.programs)
    resident = resident_blocks(n_blocks, cfg.resident)
    tokens = torch.empty((B, G), dtype=torch.int64, device=base.device)
    pv = torch.empty((G, MAX_ROWS, P), dtype=torch.float32, device=base.device)
    pi = torch.empty((G, MAX_ROWS, P), dtype=torch.int32, device=base.device)
    _markov_walk_persistent_kernel[(P,)](
        base, anchor, w1, w2, pv, pi, tokens, counters_for(w2)[0],
        B, G, V, P,
        base.stride(0), base.stride(1), w1.stride(0), w2.stride(0), tokens.stride(0),
        RANK=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_B=MAX_ROWS, BLOCK_V=cfg.block_v,
        N_BLOCKS=n_blocks, RESIDENT=resident, STREAM_FROM=max(resident, 1), BLOCK_P=max(16, triton.next_power_of_2(P)),
        ROUND=ROUND_MODE[w2.dtype], DOT_PRECISION="ieee" if w2.dtype == torch.float32 else "tf32",
        UPCAST=interpreted and w2.dtype != torch.float32, POLL_ASM=not interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(base),
    )
    return tokens
