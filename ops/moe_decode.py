"""MoE experts at decode sizes in two launches, without a plan (issue 38: the batch-1 decode step).

The general path (ops/moe.py) groups the ``N*k`` (token, expert) pairs by expert on the device
(count and plan kernels), runs ``tl.dot`` tiles of 16+ pair slots, and sums each token's ``k`` rows
in a combine kernel: four launches per MoE layer. At one decode token that is 4 pairs in 16-row
tiles, and the plan, the combine and the launches between them are pure overhead on a step bound
by reading the 4 selected experts' weights (~88 MB per layer at LFM2-8B-A1B shapes).

Here each pair streams its expert directly, one row:

1. ``gate_up``, grid ``(pairs, column tiles of I)``: program ``(p, c)`` reads token ``p // k``'s row and
   its expert's gate and up rows of tile ``c`` (a GEMV, fp32 sums), and stores
   ``silu(gate) * up`` in the activation dtype (as ops/moe.py's ``inter``).
2. ``down``, grid ``(tokens, column tiles of H)``: program ``(n, c)`` sums, for ``j = 0 .. k-1`` in order,
   the routing weight times its pair's down-projection tile (fp32), and rounds once.

Every selected expert's weights are read once per call (a pair's program is the only reader of its
expert's tile; two tokens choosing one expert read it twice, which is why this path is for a few
pairs only). Numerics as ops/moe.py (fp32 sums, one rounding of ``inter`` and of the output), but
each dot is a GEMV's row sum, not ``tl.dot``'s, so results differ from the general path in the last
bits. Deterministic. Which calls take it: ``moe_experts`` with at most ``moe_decode.max_pairs`` pairs
(``LFMSPARK_TUNE``; 0 by default, i.e. none, until the device measures it against the general
path: ``benchmarks/kernels/moe.py --decode`` and the ``ab`` step of scripts/device_run.sh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs
from .tuning import tuned


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, w13_ptr, inter_ptr,
    TOPK, stride_xn, stride_in, stride_ik, stride_we, stride_wn,
    H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: the routing and x come from the predecessors
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    p = tl.program_id(0)
    n, j = p // TOPK, p % TOPK
    e = tl.load(ids_ptr + n * stride_in + j * stride_ik).to(tl.int64)
    e = tl.minimum(tl.maximum(e, 0), E - 1)          # ids lie in [0, E) (ops/moe.py); never read outside
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + e * stride_we + cols[:, None] * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks < H - k0
        xk = tl.load(x_ptr + n * stride_xn + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = col_ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xk[None, :], axis=1)
        acc_u += tl.sum(u * xk[None, :], axis=1)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(inter_ptr + p * I + cols, h.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _decode_down_kernel(
    inter_ptr, ids_ptr, tw_ptr, w2_ptr, out_ptr,
    stride_in, stride_ik, stride_tn, stride_tk, stride_we, stride_wh, stride_on,
    TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOPK):                  # in order, as ops/moe.py's combine
        e = tl.load(ids_ptr + n * stride_in + j * stride_ik).to(tl.int64)
        e = tl.minimum(tl.maximum(e, 0), E - 1)
        rw = tl.load(tw_ptr + n * stride_tn + j * stride_tk).to(tl.float32)
        w_ptrs = w2_ptr + e * stride_we + cols[:, None] * stride_wh + ks[None, :]
        a_ptr = inter_ptr + (n * TOPK + j) * I
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = ks < I - k0
            a = tl.load(a_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
            w_ptrs += BLOCK_K
        total += acc * rw
    tl.store(out_ptr + n * stride_on + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class DecodeConfig:
    block_n1: int = 16      # gate_up: columns of I per program (each of gate and up)
    block_n2: int = 16      # down: columns of H per program
    block_k: int = 256      # reduction step of both
    num_warps: int = 4


def max_pairs() -> int:
    """The most pairs a ``moe_experts`` call may have to take this path (module doc)."""
    return tuned("moe_decode", "max_pairs", 0)


def default_config() -> DecodeConfig:
    return DecodeConfig(block_n1=tuned("moe_decode", "block_n1", 16), block_n2=tuned("moe_decode", "block_n2", 16),
                        block_k=tuned("moe_decode", "block_k", 256), num_warps=tuned("moe_decode", "num_warps", 4))


def moe_decode_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """ops/moe.py's ``moe_experts`` in two launches (module doc); ``x`` and the weights row-major in
    their last dimension."""
    N, H = x.shape
    k = topk_ids.shape[1]
    E, I = w13.shape[0], w13.shape[1] // 2
    out = torch.empty_like(x)
    if N == 0:
        return out
    if k == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or default_config()
    bk1, bk2 = min(cfg.block_k, triton.next_power_of_2(H)), min(cfg.block_k, triton.next_power_of_2(I))
    inter = torch.empty(N * k, I, dtype=x.dtype, device=x.device)
    _decode_gate_up_kernel[(N * k, triton.cdiv(I, cfg.block_n1))](
        x, topk_ids, w13, inter,
        k, x.stride(0), topk_ids.stride(0), topk_ids.stride(1), w13.stride(0), w13.stride(1),
        H=H, I=I, E=E, BLOCK_N=cfg.block_n1, BLOCK_K=bk1, num_warps=cfg.num_warps, **pdl_kwargs(x),
    )
    _decode_down_kernel[(N, triton.cdiv(H, cfg.block_n2))](
        inter, topk_ids, topk_weights, w2, out,
        topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        w2.stride(0), w2.stride(1), out.stride(0),
        TOPK=k, H=H, I=I, E=E, BLOCK_N=cfg.block_n2, BLOCK_K=bk2, num_warps=cfg.num_warps, **pdl_kwargs(x),
    )
    return out
