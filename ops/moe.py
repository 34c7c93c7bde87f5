"""MoE experts: SwiGLU experts applied to each token's top-k selection, weighted and summed.

``x [N, H]``, ``topk_ids [N, k]`` (int64), ``topk_weights [N, k]`` (activation dtype, already
normalised and scaled by the router), stacked expert weights ``w13 [E, 2I, H]`` (rows ``[0:I]`` the
gate ``w1``, ``[I:2I]`` the up projection ``w3``) and ``w2 [E, H, I]``. For each selected pair:
``w * w2_e(silu(w1_e x) * w3_e x)``, accumulated per token in the activation dtype, expert by
expert in increasing id (HF ``Lfm2MoeExperts`` eager order). Only the selected experts' weights are
read.

Triton path (four launches, five past 512 pairs; static grids, no host sync, so it is CUDA-graph
safe):

1. ``plan``: the ``N*k`` (token, k) pairs are grouped by expert on the device. Each expert's pairs
   fill whole blocks of ``BLOCK_M`` slots (the last one partly); the blocks of all experts are laid
   out in increasing expert id. The grid of the GEMM kernels is sized for the worst case,
   ``(N*k + min(E, N*k) * (BLOCK_M - 1)) // BLOCK_M`` blocks; blocks past the used ones are marked
   ``-1`` and their programs return at once.
2. ``gate_up``: per (block, tile of ``I``): ``silu(x w1^T) * (x w3^T)`` for the block's pairs, fp32
   accumulation, stored in the activation dtype (``inter``, one row per slot).
3. ``down``: per (block, tile of ``H``): ``inter w2^T`` times the pair's routing weight, stored in
   fp32 at the pair's own row ``token*k + j``.
4. ``combine``: per token, the ``k`` fp32 rows summed in order ``j = 0..k-1``, cast once.

Every program of one block reads the same expert, and an expert with at most ``BLOCK_M`` pairs has
one block, so at decode sizes each selected expert's weights are read once per call (the union over
the tokens, whatever the routing); a busier expert has several blocks whose programs read the same
weight tiles at about the same time (grid axis 0 runs fastest), mostly served by L2.

Numerics: fp32 accumulation throughout and one rounding at the end, so the result is at least as
accurate as the reference, which rounds to the activation dtype after every step; in bf16 the two
differ by a few bf16 ulps (see tests/ops/test_moe.py for the tolerances). Deterministic: no atomics.
Expert ids must lie in ``[0, E)`` (an out-of-range id leaves that pair's row of the fp32 scratch
unwritten).

Exact mode (``exact=True``): the tiles of the decode sizes for every pair count
(:func:`exact_config`). A pair's products then run the same tile shapes whether its token is alone,
in a verify window or in a prefill chunk, and whichever other pairs share its expert's blocks; the
combine sums a token's ``k`` rows in the same order anyway. A token's output bits then depend only
on its own routing and activations, given a tile product that computes a row alike wherever it sits
in the block: the GPU's ``tl.dot`` does; the interpreter's is the CPU's BLAS, which need not, so
off CUDA exact mode sums each element's products itself (ops/exact_dot.py).

FP8 weights (``w13_scale``, ``w2_scale``: models/lfm2_moe.py ``Fp8MoeExperts``): ``w13`` and ``w2``
hold float8 e4m3fn values with fp32 scales per expert and output channel, ``w13_scale [E, 2I]`` and
``w2_scale [E, H]``. The GEMM kernels load the fp8 tiles (half the bytes of bf16 ones: what a
decode step's experts cost is reading them), upcast them to the activations' dtype in registers
(exact: every e4m3 value is a bf16 value) and multiply each column's fp32 sum by its scale once,
before the SiLU product (gate, up) and before the routing weight (down). The reference dequantizes
each weight to the activations' dtype first (one rounding per weight), so in bf16 the two differ
by about that rounding, mostly averaged out in the sums.

Compile-time variants: a launch's constexprs (tiles, plan chunking) follow the number of pairs
(:func:`launch_variant`), and the integers that vary with it (``P``, ``n_blocks``) are not
specialized by Triton (``do_not_specialize``), so one launch of each variant compiles everything
launches with any other pair count of that variant need. The engine's prefill warm-up relies on
this (runtime/prefill_warmup.py ``prefill_warm_shapes``): a first request that compiles a plan
variant adds ~0.95 s to LFM2-8B-A1B's TTFT (docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton
from .exact_dot import exact_dot
from .linear.skinny_linear_fp8 import FP8_WEIGHT_DTYPE


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _expert_of(ids_ptr, p, P, TOPK, stride_in, stride_ik, E: tl.constexpr):
    """Expert id of pairs ``p`` (``token*k + j``), ``-1`` past ``P`` (and for ids outside ``[0, E)``)."""
    e = tl.load(ids_ptr + (p // TOPK) * stride_in + (p % TOPK) * stride_ik, mask=p < P, other=-1).to(tl.int32)
    return tl.where(e < E, e, -1)


@triton.jit(do_not_specialize=["P"])
def _moe_count_kernel(
    ids_ptr, counts_ptr,
    P, TOPK,
    stride_in, stride_ik,
    E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # pairs per expert in chunk `pid` of CHUNK pairs: counts [n_chunks, E_PAD]
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    q = pid * CHUNK + tl.arange(0, CHUNK)
    hit = (_expert_of(ids_ptr, q, P, TOPK, stride_in, stride_ik, E)[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + pid * E_PAD + experts, tl.sum(hit, axis=0))


@triton.jit(do_not_specialize=["P", "n_blocks"])
def _moe_plan_kernel(
    ids_ptr, counts_ptr, slot_pair_ptr, block_expert_ptr, block_rows_ptr,
    P, TOPK, n_blocks,
    stride_in, stride_ik,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, COUNT_CHUNK: tl.constexpr, PRECOUNTED: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program `pid` places pairs [pid*CHUNK, pid*CHUNK + CHUNK) and fills the same range of the
    # block table (there are never more blocks than pairs). Each program needs the pairs per expert
    # overall and before its chunk: with few programs each counts all pairs itself (one launch);
    # with many (prefill) it sums the per-chunk counts of _moe_count_kernel instead, so the work
    # stays linear in the number of pairs.
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    first_pair = pid * CHUNK
    total = tl.zeros([E_PAD], dtype=tl.int32)   # pairs per expert
    before = tl.zeros([E_PAD], dtype=tl.int32)  # ... among the pairs before this program's
    if PRECOUNTED:
        n_chunks = tl.cdiv(P, CHUNK)
        for r0 in range(0, n_chunks, COUNT_CHUNK):
            r = r0 + tl.arange(0, COUNT_CHUNK)
            c = tl.load(counts_ptr + r[:, None] * E_PAD + experts[None, :], mask=(r < n_chunks)[:, None], other=0)
            total += tl.sum(c, axis=0)
            before += tl.sum(c * (r < pid).to(tl.int32)[:, None], axis=0)
    else:
        for c0 in range(0, P, COUNT_CHUNK):
            q = c0 + tl.arange(0, COUNT_CHUNK)
            hit = (_expert_of(ids_ptr, q, P, TOPK, stride_in, stride_ik, E)[:, None] == experts[None, :]).to(tl.int32)
            total += tl.sum(hit, axis=0)
            before += tl.sum(hit * (q < first_pair).to(tl.int32)[:, None], axis=0)
    n_blk = (total + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(n_blk, axis=0)
    blk_start = blk_end - n_blk

    # slot of each pair: its expert's first slot + its rank among that expert's pairs, in pair
    # order (so a block holds increasing tokens); the rank inside this chunk is a pairwise count
    lanes = tl.arange(0, CHUNK)
    p = first_pair + lanes
    e = _expert_of(ids_ptr, p, P, TOPK, stride_in, stride_ik, E)
    rank = tl.sum(((e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    hit = (e[:, None] == experts[None, :]).to(tl.int32)
    slot = tl.sum(hit * (blk_start * BLOCK_M + before)[None, :], axis=1) + rank
    tl.store(slot_pair_ptr + slot, p, mask=e >= 0)

    # block table: expert of each block (-1 past the used blocks) and its number of real rows
    b = pid * CHUNK + lanes
    e_of_b = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
    sel = experts[None, :] == e_of_b[:, None]
    first = tl.sum(tl.where(sel, blk_start[None, :], 0), axis=1)
    count = tl.sum(tl.where(sel, total[None, :], 0), axis=1)
    used = e_of_b < E
    rows = tl.minimum(count - (b - first) * BLOCK_M, BLOCK_M)
    tl.store(block_expert_ptr + b, tl.where(used, e_of_b, -1), mask=b < n_blocks)
    tl.store(block_rows_ptr + b, tl.where(used, rows, 0), mask=b < n_blocks)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, s13_ptr, inter_ptr, slot_pair_ptr, block_expert_ptr, block_rows_ptr,
    TOPK,
    stride_xn, stride_xh, stride_we, stride_wn, stride_wh, stride_se,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, DOT_ROWWISE: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    # W_SCALE: w13 holds fp8 values (upcast as loaded), each column's sum times s13 [E, 2I] (module doc)
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk)
    if e < 0:
        return  # a surplus block of the static grid
    slots = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + blk)
    token = tl.load(slot_pair_ptr + slots, mask=row_ok, other=0) // TOPK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xn + ks[None, :] * stride_xh
    g_ptrs = w13_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wh
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = ks < H - kk * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptrs, mask=w_ok, other=0.0)
        u = tl.load(u_ptrs, mask=w_ok, other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        elif W_SCALE:
            g, u = g.to(a.dtype), u.to(a.dtype)
        acc_g = exact_dot(a, g, acc_g, DOT_PRECISION, DOT_ROWWISE)
        acc_u = exact_dot(a, u, acc_u, DOT_PRECISION, DOT_ROWWISE)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    if W_SCALE:
        s_ptrs = s13_ptr + e.to(tl.int64) * stride_se + cols
        acc_g = acc_g * tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
        acc_u = acc_u * tl.load(s_ptrs + I, mask=col_ok, other=0.0)[None, :]
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(inter_ptr + slots[:, None] * I + cols[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, w2_ptr, s2_ptr, tw_ptr, pair_out_ptr, slot_pair_ptr, block_expert_ptr, block_rows_ptr,
    TOPK,
    stride_tn, stride_tk, stride_we, stride_wh, stride_wi, stride_se,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, DOT_ROWWISE: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    # W_SCALE: w2 holds fp8 values (upcast as loaded), each column's sum times s2 [E, H] (module doc)
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk)
    if e < 0:
        return
    slots = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + blk)
    pair = tl.load(slot_pair_ptr + slots, mask=row_ok, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + slots[:, None] * I + ks[None, :]
    w_ptrs = w2_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wh + ks[:, None] * stride_wi
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(I, BLOCK_K)):
        k_ok = ks < I - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        elif W_SCALE:
            w = w.to(a.dtype)
        acc = exact_dot(a, w, acc, DOT_PRECISION, DOT_ROWWISE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wi
    if W_SCALE:
        acc = acc * tl.load(s2_ptr + e.to(tl.int64) * stride_se + cols, mask=col_ok, other=0.0)[None, :]
    token = pair // TOPK
    rw = tl.load(tw_ptr + token * stride_tn + (pair - token * TOPK) * stride_tk, mask=row_ok, other=0.0)
    acc = acc * rw.to(tl.float32)[:, None]
    tl.store(pair_out_ptr + pair[:, None].to(tl.int64) * H + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(
    pair_out_ptr, out_ptr,
    stride_on, stride_oh,
    H: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):  # fixed order: deterministic
        acc += tl.load(pair_out_ptr + (n * TOPK + j).to(tl.int64) * H + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + n.to(tl.int64) * stride_on + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# launcher

@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the expert GEMM kernels (clamped to the problem for tiny shapes)."""
    block_m: int            # pair slots per block (all of one expert)
    block_n1: int           # gate_up: columns of I per program (each of gate and up)
    block_k1: int           # gate_up: reduction tile over H
    block_n2: int           # down: columns of H per program
    block_k2: int           # down: reduction tile over I
    num_warps: int = 4
    num_stages: int = 4
    plan_chunk: int = 0     # pairs per plan program and counting step (0: automatic)


def moe_config(n_pairs: int, n_experts: int) -> MoeConfig:
    """Tiles for ``n_pairs = N*k`` pairs over ``n_experts`` experts (chosen by sweeps at
    LFM2-8B-A1B shapes: ``python benchmarks/kernels/moe.py --sweep``).

    Decode and verify sizes (a few pairs per expert) are bound by reading the weights: blocks of
    16-32 pairs (one per expert) and narrow column tiles, so that even 4 experts make a few hundred
    programs. Prefill sizes are bound by the matrix units: 128 x 128 tiles, 8 warps.
    """
    per_expert = n_pairs / n_experts  # if routing were uniform
    if per_expert <= 1 / 8:  # one decode token of LFM2-8B-A1B (4 pairs, 32 experts): wider column tiles,
        # 38.9 against 40.8 us per layer with 32 columns (moe.py --sweep --sizes 1; docs/decisions.md)
        return MoeConfig(block_m=16, block_n1=64, block_k1=256, block_n2=64, block_k2=256,
                         num_warps=4, num_stages=4)
    if per_expert <= 16:
        return MoeConfig(block_m=16, block_n1=32, block_k1=256, block_n2=32, block_k2=256,
                         num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeConfig(block_m=32, block_n1=64, block_k1=128, block_n2=64, block_k2=128,
                         num_warps=4, num_stages=4)
    return MoeConfig(block_m=128, block_n1=128, block_k1=64, block_n2=128, block_k2=64,
                     num_warps=8, num_stages=3)


def default_config(n_pairs: int, n_experts: int, elem_size: int) -> MoeConfig:
    """The tiles a launch uses: :func:`moe_config`, with the reduction tiles halved for fp32 (they
    are sized for 16-bit shared-memory stages)."""
    cfg = moe_config(n_pairs, n_experts)
    if elem_size > 2:
        cfg = replace(cfg, block_k1=cfg.block_k1 // 2, block_k2=cfg.block_k2 // 2)
    return cfg


def exact_config(n_experts: int, elem_size: int) -> MoeConfig:
    """Exact mode's tiles: those of one decode token, for every pair count (module doc)."""
    return default_config(1, n_experts, elem_size)


@dataclass(frozen=True)
class PlanLaunch:
    """How :func:`moe_plan` launches for ``P`` pairs."""
    chunk: int          # pairs placed per plan program (and counted per counting program): CHUNK
    count_chunk: int    # pairs (or count rows, when precounted) summed per step: COUNT_CHUNK
    precount: bool      # a separate counting launch first (PRECOUNTED)
    n_chunks: int       # programs of each launch


def plan_launch(n_pairs: int, n_experts: int, chunk: int = 0, precount: bool | None = None) -> PlanLaunch:
    """The plan's chunking for ``n_pairs`` pairs (``chunk`` / ``precount``: overrides, for tests)."""
    e_pad = triton.next_power_of_2(n_experts)
    # pairs placed per program (one program up to 64 pairs) and counted per step: both keep the
    # [chunk, E] one-hots small (a plan over [512, 32] tiles takes ~29 us, this one 2-7)
    n_pow2 = triton.next_power_of_2(max(n_pairs, 16))
    count_chunk = chunk or min(n_pow2, max(16, 8192 // e_pad))
    chunk = chunk or min(n_pow2, 64)
    n_chunks = triton.cdiv(n_pairs, chunk)
    if precount is None:
        precount = n_chunks > 8  # else every program re-counts all pairs: quadratic in P
    if precount:  # the plan programs then sum rows of the per-chunk counts, count_chunk of them per step
        count_chunk = min(count_chunk, max(16, triton.next_power_of_2(n_chunks)))
    return PlanLaunch(chunk=chunk, count_chunk=count_chunk, precount=precount, n_chunks=n_chunks)


def launch_variant(n_pairs: int, n_experts: int, elem_size: int) -> tuple[MoeConfig, int, int, bool]:
    """The compile-time choices of a default ``moe_experts`` launch over ``n_pairs`` pairs: its tiles
    and compile options, and the plan's chunking constexprs. Launches with equal variants (and the
    same model shapes and dtype) run the same compiled kernels (module doc, "Compile-time
    variants")."""
    cfg = default_config(n_pairs, n_experts, elem_size)
    plan = plan_launch(n_pairs, n_experts, cfg.plan_chunk)
    return cfg, plan.chunk, plan.count_chunk, plan.precount


def _tile(block: int, dim: int) -> int:
    """``block`` shrunk for a small ``dim`` (never under 16: ``tl.dot``'s minimum)."""
    return max(16, min(block, triton.next_power_of_2(dim)))


def n_blocks_bound(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Most blocks any routing of ``n_pairs`` pairs can fill: ``sum_e ceil(c_e / block_m)`` with at
    most ``min(E, n_pairs)`` experts used (never more than ``n_pairs``)."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


def moe_plan(topk_ids: torch.Tensor, n_experts: int, block_m: int, chunk: int = 0,
             precount: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the ``N*k`` pairs by expert on the device (static shapes; one launch up to 512 pairs,
    two beyond, or when ``precount`` says so).

    Returns ``slot_pair [n_blocks*block_m]`` (pair ``token*k + j`` held by each slot; padding slots
    are left unwritten), ``block_expert [n_blocks]`` (``-1`` past the used blocks) and
    ``block_rows [n_blocks]`` (real slots of each block, filled from its start).
    """
    P = topk_ids.numel()
    n_blocks = n_blocks_bound(P, n_experts, block_m)
    e_pad = triton.next_power_of_2(n_experts)
    plan = plan_launch(P, n_experts, chunk, precount)
    chunk, n_chunks = plan.chunk, plan.n_chunks
    dev = topk_ids.device
    slot_pair = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    block_rows = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    counts = block_rows  # unused (a placeholder pointer) unless precounted
    if plan.precount:
        counts = torch.empty(n_chunks, e_pad, dtype=torch.int32, device=dev)
        _moe_count_kernel[(n_chunks,)](
            topk_ids, counts, P, topk_ids.shape[1], topk_ids.stride(0), topk_ids.stride(1),
            E=n_experts, E_PAD=e_pad, CHUNK=chunk, **pdl_kwargs(topk_ids),
        )
    _moe_plan_kernel[(n_chunks,)](
        topk_ids, counts, slot_pair, block_expert, block_rows,
        P, topk_ids.shape[1], n_blocks,
        topk_ids.stride(0), topk_ids.stride(1),
        E=n_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, COUNT_CHUNK=plan.count_chunk,
        PRECOUNTED=plan.precount, **pdl_kwargs(topk_ids),
    )
    return slot_pair, block_expert, block_rows


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
           w2_scale: torch.Tensor | None) -> None:
    """The weight formats the op takes: both stacks in ``x``'s dtype without scales, or both fp8
    with their per-channel scales (module doc)."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("moe_experts: pass both w13_scale and w2_scale (fp8 stacks) or neither")
    E, I2, H = w13.shape
    if w13_scale is None:
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"moe_experts: the expert stacks must be in x's dtype {x.dtype} (or fp8 with scales), "
                             f"got {w13.dtype} and {w2.dtype}")
        return
    if w13.dtype != FP8_WEIGHT_DTYPE or w2.dtype != FP8_WEIGHT_DTYPE:
        raise ValueError(f"moe_experts: scaled expert stacks must be {FP8_WEIGHT_DTYPE}, got {w13.dtype} and {w2.dtype}")
    for name, scale, shape in (("w13_scale", w13_scale, (E, I2)), ("w2_scale", w2_scale, (E, H))):
        if scale.shape != shape or scale.dtype != torch.float32 or scale.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} must be fp32 [E, out] = {list(shape)} with unit last stride (one "
                             f"scale per expert and output channel), got {scale.dtype} {list(scale.shape)}")


def moe_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, config: MoeConfig | None = None,
                       exact: bool = False, w13_scale: torch.Tensor | None = None,
                       w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``config``: tile override, for tests and tuning; ``exact``: exact
    mode's tiles; ``w13_scale``, ``w2_scale``: fp8 stacks' scales; module doc)."""
    _check(x, w13, w2, w13_scale, w2_scale)
    N, H = x.shape
    k = topk_ids.shape[1]
    E, I = w13.shape[0], w13.shape[1] // 2
    out = torch.empty_like(x)
    if N == 0:
        return out
    if k == 0:
        return out.zero_()
    P = N * k
    cfg = config or (exact_config(E, x.element_size()) if exact else default_config(P, E, x.element_size()))
    bm = cfg.block_m
    slot_pair, block_expert, block_rows = moe_plan(topk_ids, E, bm, cfg.plan_chunk)
    n_blocks = block_expert.shape[0]
    inter = torch.empty(n_blocks * bm, I, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(P, H, dtype=torch.float32, device=x.device)
    # fp32 dots must not run in tf32 (Triton's default); the setting is irrelevant to 16-bit inputs
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Triton's interpreter multiplies bf16 dot operands as their raw bits: upcast them there
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
    # exact mode under the interpreter: each element's own sum, not the CPU's BLAS (ops/exact_dot.py)
    rowwise = exact and x.device.type != "cuda"

    scaled = w13_scale is not None
    s13 = w13_scale if scaled else w13          # not read without W_SCALE
    s2 = w2_scale if scaled else w2

    bn1, bk1 = _tile(cfg.block_n1, I), _tile(cfg.block_k1, H)
    _moe_gate_up_kernel[(n_blocks, triton.cdiv(I, bn1))](
        x, w13, s13, inter, slot_pair, block_expert, block_rows,
        k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), s13.stride(0),
        H=H, I=I, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, DOT_PRECISION=precision, UPCAST=upcast,
        DOT_ROWWISE=rowwise, W_SCALE=scaled, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_kwargs(x),
    )
    bn2, bk2 = _tile(cfg.block_n2, H), _tile(cfg.block_k2, I)
    _moe_down_kernel[(n_blocks, triton.cdiv(H, bn2))](
        inter, w2, s2, topk_weights, pair_out, slot_pair, block_expert, block_rows,
        k,
        topk_weights.stride(0), topk_weights.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), s2.stride(0),
        H=H, I=I, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, DOT_PRECISION=precision, UPCAST=upcast,
        DOT_ROWWISE=rowwise, W_SCALE=scaled, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_kwargs(inter),
    )
    block_h = min(triton.next_power_of_2(H), 1024)
    _moe_combine_kernel[(N, triton.cdiv(H, block_h))](
        pair_out, out,
        out.stride(0), out.stride(1),
        H=H, TOPK=k, BLOCK_H=block_h, **pdl_kwargs(pair_out),
    )
    return out


# ---------------------------------------------------------------------------------------------
# reference

def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Expert by expert in increasing id; fp8 stacks are dequantized to ``x``'s dtype first."""
    if w13_scale is not None:
        w13 = (w13.float() * w13_scale[..., None]).to(x.dtype)
        w2 = (w2.float() * w2_scale[..., None]).to(x.dtype)
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, which = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, which, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, exact: bool = False, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's selected SwiGLU experts, ``[N, H]`` (``exact``: each token's bits
    independent of the other tokens of the call; ``w13_scale [E, 2I]``, ``w2_scale [E, H]``: the
    stacks are fp8 with these per-channel scales; module doc)."""
    if use_triton(x):
        return moe_experts_triton(x, topk_ids, topk_weights, w13, w2, exact=exact, w13_scale=w13_scale,
                                  w2_scale=w2_scale)
    _check(x, w13, w2, w13_scale, w2_scale)   # the same limits on every device
    return moe_experts_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale)


@moe_experts.register_kernel("cuda")
def _moe_experts_cuda(x, topk_ids, topk_weights, w13, w2, exact=False, w13_scale=None, w2_scale=None):
    return moe_experts_triton(x, topk_ids, topk_weights, w13, w2, exact=exact, w13_scale=w13_scale,
                              w2_scale=w2_scale)


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w13, w2, exact=False, w13_scale=None, w2_scale=None):
    _check(x, w13, w2, w13_scale, w2_scale)
    return torch.empty_like(x)
