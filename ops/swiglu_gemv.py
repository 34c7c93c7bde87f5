"""SwiGLU GEMV: ``silu(x @ w1^T) * (x @ w3^T)`` for one row, with ``w13 = [w1; w3]`` read once.

Why: in a batch-1 decode step every feed-forward first multiplies one row by the fused gate/up
weight ``w13 [2F, H]`` and then applies ``silu(gate) * up`` in a separate elementwise kernel. On the
H200 that kernel, plus its CUDA-graph node, costs about 1.5 us per layer: 16 per LFM2.5-1.2B step.
Here each program computes ``BLOCK_N`` gate columns and the matching up columns (rows ``j`` and
``F + j`` of ``w13``) and applies the activation in its epilogue, so the ``[2F]`` gate/up vector is
never written and the activation costs no launch.

Numerics: those of the unfused module in ``x``'s dtype: each of gate and up is an fp32 sum rounded
once to the dtype (as ``F.linear`` rounds its output), ``silu(gate)`` is rounded, and so is the product.
The summation order differs from cuBLAS's, so bf16 results may differ from the reference by an ulp.
Static grid, no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton
from .skinny_linear import _load_w_block, _load_x_vector, skinny_swiglu_reference

# gate columns per program (and as many up columns): 4 weight rows x 1024 per K step, the shape
# of the best plain GEMV config (ops/skinny_linear.py); 4 + 4 rows x 512 measured 19.5 us per
# LFM2.5-1.2B layer on the H200 against cuBLAS's 17.8 us for the unfused w13 product
_BLOCK_N = 2
_BLOCK_K = 1024


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _swiglu_gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    F, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL == 1:  # the next kernel's programs may launch now (ops/_dispatch.py, PDL_TRIGGER)
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = (cols % F).to(tl.int64)            # past F: a valid row, never stored
    g_ptrs = w_ptr + gate_rows[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    u_ptrs = g_ptrs + F * stride_wn
    # first K block peeled: weights requested before the PDL wait, x (the predecessor's output) after
    wg = _load_w_block(g_ptrs, 0, K, BLOCK_K, EVEN_K, "")
    wu = _load_w_block(u_ptrs, 0, K, BLOCK_K, EVEN_K, "")
    if PDL:
        tl.extra.cuda.gdc_wait()
    xv = _load_x_vector(x_ptr, 0, K, BLOCK_K, EVEN_K)[None, :]
    acc_g = wg.to(tl.float32) * xv
    acc_u = wu.to(tl.float32) * xv
    for k in range(BLOCK_K, K, BLOCK_K):
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        wg = _load_w_block(g_ptrs, k, K, BLOCK_K, EVEN_K, "")
        wu = _load_w_block(u_ptrs, k, K, BLOCK_K, EVEN_K, "")
        xv = _load_x_vector(x_ptr, k, K, BLOCK_K, EVEN_K)[None, :]
        acc_g += wg.to(tl.float32) * xv
        acc_u += wu.to(tl.float32) * xv
    if PDL == 2:  # LFMSPARK_PDL_TRIGGER=late: this program's weights are read
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + cols, (act * up).to(dtype), mask=cols < F)


# ---------------------------------------------------------------------------------------------
# launcher

def _check(x: torch.Tensor, w13: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or w13.dim() != 2 or x.shape[1] != w13.shape[1]:
        raise ValueError(f"expected x [1, H] and w13 [2F, H], got {tuple(x.shape)} and {tuple(w13.shape)}")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows ([2F, H]), got {w13.shape[0]} rows")
    if x.dtype != w13.dtype:
        raise ValueError(f"x and w13 must share a dtype, got {x.dtype} and {w13.dtype}")
    if w13.stride(1) != 1:
        raise ValueError("w13 must be row-major (stride(1) == 1)")


def swiglu_gemv_triton(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    _check(x, w13)
    F_, K = w13.shape[0] // 2, w13.shape[1]
    out = torch.empty((1, F_), dtype=x.dtype, device=x.device)
    if F_ == 0:
        return out
    if K == 0:  # gate = up = 0; the kernel's peeled first K block assumes K > 0
        return out.zero_()
    x = x.contiguous()
    block_k = min(_BLOCK_K, max(16, triton.next_power_of_2(K)))
    _swiglu_gemv_kernel[(triton.cdiv(F_, _BLOCK_N),)](
        x, w13, out, F_, K, w13.stride(0),
        BLOCK_N=_BLOCK_N, BLOCK_K=block_k, EVEN_K=K % block_k == 0, num_warps=4, **pdl_kwargs(x, one_row_product=True),
    )
    return out


# ---------------------------------------------------------------------------------------------
# reference

# the unfused module, as for several rows (ops/skinny_linear.py)
swiglu_gemv_reference = skinny_swiglu_reference


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::swiglu_gemv", mutates_args=())
def swiglu_gemv(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``[gate | up] = x [1, H] @ w13[2F, H]^T`` -> ``[1, F]``."""
    if use_triton(x):
        return swiglu_gemv_triton(x, w13)
    _check(x, w13)
    return swiglu_gemv_reference(x, w13)


@swiglu_gemv.register_kernel("cuda")
def _swiglu_gemv_cuda(x, w13):
    return swiglu_gemv_triton(x, w13)


@swiglu_gemv.register_fake
def _swiglu_gemv_fake(x, w13):
    _check(x, w13)
    return x.new_empty((1, w13.shape[0] // 2))
