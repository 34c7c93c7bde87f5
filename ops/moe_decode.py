"""One decode token's MoE feed-forward in one launch: routing, the chosen experts, their weighted sum.

``x [1, H]`` (the normed hidden state), ``logits [1, E]`` (the router product) and the routing's
inputs of ``lfmspark::moe_route`` -> ``[1, H]``, the value of ``moe_route`` followed by
``moe_experts`` (ops/moe.py) to a rounding.

Why (issue 38): at one token the general path is four launches after the router product (route,
plan, the gate/up and down products, combine) around ~88 MB of expert weights per LFM2-8B-A1B layer,
and it streamed them at 72-75% of copy bandwidth on the H100: each launch's ramp-up and drain is
paid 22 times a step, and the two short products (~20 and ~10 us) pay them in full. Here one grid
does it all:

- every program routes the token itself (the ``moe_route`` kernel's code, :func:`_route_rows`, on 32
  scores: cheaper than a launch), so no plan and no routing launch;
- **gate/up tasks** ``(expert slot j, tile of BLOCK_N1 columns of I)``: one-row GEMVs (each weight tile
  loaded whole, as the dense decode's GEMV does: no ``tl.dot`` padding) storing
  ``silu(x w1^T) * (x w3^T)`` (fp32 sums, rounded once) to a ``[k, I]`` scratch;
- **down tasks** ``(tile of BLOCK_N2 columns of H)``: load the tile of all ``k`` chosen experts' ``w2``,
  *then* wait until every gate/up task has stored its part of the scratch, and sum
  ``weight_j * (scratch_j w2_j^T)`` over ``j``: the down weights stream while the gate/up tail drains.

Tasks, not programs, are numbered gate/up first: each program takes the next number from an atomic
counter. A down task waits only on gate/up tasks whose numbers were all taken before its own, by
programs that are running and never wait, so the wait ends whatever the residency or the order the
hardware starts programs in (the dynamic numbering of CUB's single-pass scan, for the same reason).
Synchronisation: a gate/up task's threads store, a CTA barrier, then one release increment of a
``done`` counter at GPU scope; a down task polls ``done`` with acquire loads (the grid barrier
of ops/markov_walk/persistent.py polls so), then a CTA barrier, and reads the scratch past L1
(``.cg``). The last program to finish (a third counter) resets
the three counters to zero, so each launch leaves them as it found them (the counter buffer of
ops/linear/skinny_linear.py, index :data:`COUNTERS`, whose ordering rule applies: launches that
use it must be ordered on the device, as PDL keeps consecutive kernels).

Triton's interpreter runs programs one after another, so a waiting program would wait forever:
on the CPU the op launches the gate/up tasks and then the down tasks as two grids (``PHASE`` 1 and
2), which run the same task code without the counters.

Numerics: gate/up as ops/moe.py (fp32 sums, the activation rounded once to x's dtype); the down
sums are fp32, weighted and summed over the ``k`` experts in fp32, rounded once. The per-element
reduction order differs from the grouped kernels', so results differ from ``moe_experts`` in the
last bits: exact mode (issue 39) never takes this path (models/lfm2_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton
from .linear.skinny_linear import counter_buffer
from .moe import moe_experts_reference
from .moe_route import _check, _route_rows, moe_route_reference, route_constexprs
from .tuning import tuned

COUNTERS = 2  # index of this op's counter buffer (0 and 1: the split-K products' main and side streams)
# the counters: tasks taken, gate/up tasks stored, programs finished
_TASK, _DONE, _FINISHED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gate_up_task(x_ptr, w13_ptr, inter_ptr, ids, slots, j, c, stride_w13e, stride_w13n,
                  H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N1: tl.constexpr):
    """Columns ``c`` of ``silu(x w1_e^T) * (x w3_e^T)`` for the expert ``e`` in slot ``j``, stored to
    the scratch row ``j``: one load of each weight tile whole, fp32 sums, rounded once."""
    e = tl.sum(tl.where(slots == j, ids, 0)).to(tl.int64)
    cols = c * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    ks = tl.arange(0, BLOCK_H)
    mask = (cols < I)[:, None] & (ks < H)[None, :]
    g_ptrs = w13_ptr + e * stride_w13e + cols[:, None] * stride_w13n + ks[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I * stride_w13n, mask=mask, other=0.0)
    xk = tl.load(x_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
    gate = tl.sum(g.to(tl.float32) * xk[None, :], axis=1)
    up = tl.sum(u.to(tl.float32) * xk[None, :], axis=1)
    h = gate * tl.sigmoid(gate) * up
    tl.store(inter_ptr + j * I + cols, h.to(inter_ptr.dtype.element_ty), mask=cols < I)


@triton.jit
def _down_weights(w2_ptr, ids, slots, c, stride_w2e, stride_w2n, H: tl.constexpr, I: tl.constexpr,
                  TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N2: tl.constexpr):
    """Rows ``c`` (``BLOCK_N2`` columns of the output) of every chosen expert's ``w2``,
    ``[K_PAD, BLOCK_N2, BLOCK_I]``: they depend on the routing only, so they load before the wait."""
    cols = c * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    ks = tl.arange(0, BLOCK_I)
    ptrs = (w2_ptr + ids.to(tl.int64)[:, None, None] * stride_w2e + cols[None, :, None] * stride_w2n
            + ks[None, None, :])
    return tl.load(ptrs, mask=(slots < TOPK)[:, None, None] & (cols < H)[None, :, None] & (ks < I)[None, None, :],
                   other=0.0)


@triton.jit
def _down_task(w, inter_ptr, out_ptr, weights, slots, c, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
               BLOCK_I: tl.constexpr, BLOCK_N2: tl.constexpr):
    """Columns ``c`` of ``sum_j weight_j * (scratch_j w2_j^T)`` from the loaded ``w``, rounded once."""
    cols = c * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    ks = tl.arange(0, BLOCK_I)
    a = tl.load(inter_ptr + slots[:, None] * I + ks[None, :], mask=(slots < TOPK)[:, None] & (ks < I)[None, :],
                other=0.0, cache_modifier=".cg").to(tl.float32)   # written by other programs: past L1
    per_expert = tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)          # [K_PAD, BLOCK_N2]
    total = tl.sum(per_expert * weights[:, None], axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _wait_for(counter_ptr, target):
    """Return once ``*counter_ptr >= target`` (an acquire: what was released before the increments
    is visible to every thread of the program after it)."""
    seen = 0
    while seen < target:   # acquire loads: polls need no read-modify-write at the counter
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [counter_ptr],
                                         dtype=tl.uint32, is_pure=False, pack=1).to(tl.int32)
    tl.debug_barrier()   # no thread reads past this before the acquire


@triton.jit
def _moe_decode_kernel(
    x_ptr, logits_ptr, expert_bias_ptr, sel_bias_ptr, w13_ptr, w2_ptr, inter_ptr, out_ptr, cnt_ptr,
    scale,
    stride_le, stride_be, stride_w13e, stride_w13n, stride_w2e, stride_w2n,
    H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr,
    E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    HAS_EXPERT_BIAS: tl.constexpr, ROUND_BIASED: tl.constexpr, HAS_SEL_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    PHASE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: x and the logits come from the predecessors
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    n_up_tasks = TOPK * tl.cdiv(I, BLOCK_N1)
    if PHASE == 0:
        task = tl.atomic_add(cnt_ptr + _TASK, 1, sem="relaxed", scope="gpu")
    elif PHASE == 1:
        task = tl.program_id(0)
    else:
        task = n_up_tasks + tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    one = tl.arange(0, 1)
    logit = tl.load(logits_ptr + experts[None, :] * stride_le, mask=(experts < E)[None, :], other=0.0)
    ids, weights = _route_rows(logit, one, one < 1, expert_bias_ptr, sel_bias_ptr, scale, 0, stride_be,
                               E, E_PAD, TOPK, K_PAD, HAS_EXPERT_BIAS, ROUND_BIASED, HAS_SEL_BIAS, NORMALIZE,
                               out_ptr.dtype.element_ty)
    slots = tl.arange(0, K_PAD)
    ids = tl.reshape(ids, [K_PAD])
    weights = tl.reshape(weights, [K_PAD])
    if task < n_up_tasks:
        # expert slot j the fastest index, so neighbouring tasks read different experts
        _gate_up_task(x_ptr, w13_ptr, inter_ptr, ids, slots, task % TOPK, task // TOPK, stride_w13e, stride_w13n,
                      H, I, BLOCK_H, BLOCK_N1)
        if PHASE == 0:
            tl.debug_barrier()   # every thread's stores before the one-thread release
            tl.atomic_add(cnt_ptr + _DONE, 1, sem="release", scope="gpu")
    else:
        w = _down_weights(w2_ptr, ids, slots, task - n_up_tasks, stride_w2e, stride_w2n, H, I, TOPK, BLOCK_I, BLOCK_N2)
        if PHASE == 0:
            _wait_for(cnt_ptr + _DONE, n_up_tasks)
        _down_task(w, inter_ptr, out_ptr, weights, slots, task - n_up_tasks, H, I, TOPK, BLOCK_I, BLOCK_N2)
    if PHASE == 0:
        tl.debug_barrier()
        finished = tl.atomic_add(cnt_ptr + _FINISHED, 1, sem="acq_rel", scope="gpu")
        if finished == tl.num_programs(0) - 1:   # the last program: every counter is final
            tl.store(cnt_ptr + _TASK, 0)
            tl.store(cnt_ptr + _DONE, 0)
            tl.store(cnt_ptr + _FINISHED, 0)


# ---------------------------------------------------------------------------------------------
# launcher

@dataclass(frozen=True)
class DecodeConfig:
    block_n1: int   # gate/up task: columns of I (each of gate and up)
    block_n2: int   # down task: columns of H (for all k experts)
    num_warps: int


def decode_config() -> DecodeConfig:
    """The launch parameters (``LFMSPARK_TUNE`` kind ``moe_decode``, ops/tuning.py)."""
    return DecodeConfig(block_n1=tuned("moe_decode", "block_n1", 2), block_n2=tuned("moe_decode", "block_n2", 2),
                        num_warps=tuned("moe_decode", "num_warps", 4))


def _check_decode(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or logits.shape[0] != 1:
        raise ValueError(f"moe_decode: one token only, got x {tuple(x.shape)} and logits {tuple(logits.shape)}; "
                         f"several tokens take moe_route + moe_experts")
    E, two_i, H = w13.shape
    if x.shape[1] != H or w2.shape != (E, H, two_i // 2) or logits.shape[1] != E:
        raise ValueError(f"moe_decode: shapes do not match: x {tuple(x.shape)}, logits {tuple(logits.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")


def moe_decode_triton(x: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor | None,
                      selection_bias: torch.Tensor | None, top_k: int, normalize: bool, scale: float,
                      w13: torch.Tensor, w2: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """The op on the Triton kernel (``config``: override, for tests and tuning)."""
    _check(logits, expert_bias, selection_bias, top_k)
    _check_decode(x, logits, w13, w2)
    H, I = x.shape[1], w13.shape[1] // 2
    out = torch.empty_like(x)
    if top_k == 0:
        return out.zero_()
    # the kernels index x, the weights' last dimension and the scratch with unit strides
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    cfg = config or decode_config()
    inter = torch.empty(top_k, I, dtype=x.dtype, device=x.device)
    placeholder = out   # pointer for an absent bias (never read: the constexpr drops the load)
    n_up, n_down = top_k * triton.cdiv(I, cfg.block_n1), triton.cdiv(H, cfg.block_n2)
    phases = [(0, n_up + n_down)] if x.device.type == "cuda" else [(1, n_up), (2, n_down)]
    for phase, programs in phases:
        _moe_decode_kernel[(programs,)](
            x, logits, expert_bias if expert_bias is not None else placeholder,
            selection_bias if selection_bias is not None else placeholder, w13, w2, inter, out,
            counter_buffer(x.device, COUNTERS), float(scale),
            logits.stride(1), selection_bias.stride(1) if selection_bias is not None else 0,
            w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
            H=H, I=I, BLOCK_H=triton.next_power_of_2(H), BLOCK_I=triton.next_power_of_2(I),
            BLOCK_N1=cfg.block_n1, BLOCK_N2=cfg.block_n2, PHASE=phase, num_warps=cfg.num_warps,
            **route_constexprs(logits, expert_bias, selection_bias, top_k, normalize), **pdl_kwargs(x),
        )
    return out


# ---------------------------------------------------------------------------------------------
# reference

def moe_decode_reference(x: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor | None,
                         selection_bias: torch.Tensor | None, top_k: int, normalize: bool, scale: float,
                         w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``moe_route`` then ``moe_experts``, in eager PyTorch."""
    ids, weights = moe_route_reference(logits, expert_bias, selection_bias, top_k, normalize, scale)
    return moe_experts_reference(x, ids, weights, w13, w2)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::moe_decode", mutates_args=())
def moe_decode(x: torch.Tensor, logits: torch.Tensor, expert_bias: torch.Tensor | None,
               selection_bias: torch.Tensor | None, top_k: int, normalize: bool, scale: float,
               w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One token's routed SwiGLU experts, weighted and summed, ``[1, H]`` (module doc)."""
    if use_triton(x):
        return moe_decode_triton(x, logits, expert_bias, selection_bias, top_k, normalize, scale, w13, w2)
    _check(logits, expert_bias, selection_bias, top_k)  # the same limits on every device
    _check_decode(x, logits, w13, w2)
    return moe_decode_reference(x, logits, expert_bias, selection_bias, top_k, normalize, scale, w13, w2)


@moe_decode.register_kernel("cuda")
def _moe_decode_cuda(x, logits, expert_bias, selection_bias, top_k, normalize, scale, w13, w2):
    return moe_decode_triton(x, logits, expert_bias, selection_bias, top_k, normalize, scale, w13, w2)


@moe_decode.register_fake
def _moe_decode_fake(x, logits, expert_bias, selection_bias, top_k, normalize, scale, w13, w2):
    _check(logits, expert_bias, selection_bias, top_k)
    _check_decode(x, logits, w13, w2)
    return torch.empty_like(x)
