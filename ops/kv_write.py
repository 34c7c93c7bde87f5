"""Target KV write: store K (after q/k-norm and RoPE) and V of a token window into the cache.

Index convention shared by every op in this package: batch row ``b`` owns the state slot
``slots[b]`` (``-1`` marks a padding row, skipped everywhere), its window starts at absolute
position ``start[b]``, and only its first ``lens[b]`` columns are real tokens. Token ``t`` of row
``b`` is written to ``cache[layer, slots[b], start[b] + t]``; positions at or past the cache
length are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, start_ptr, lens_ptr,
    T, S,
    stride_kb, stride_kt, stride_vb, stride_vt,
    stride_cs, stride_cp,
    ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # one program per (row, token): copy the token's n_kv * head_dim values
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    slot = tl.load(slots_ptr + b)
    pos = tl.load(start_ptr + b) + t
    valid = (slot >= 0) & (t < tl.load(lens_ptr + b)) & (pos < S)
    dst = slot.to(tl.int64) * stride_cs + pos.to(tl.int64) * stride_cp     # int64: caches exceed 2^31 elements
    n = tl.where(valid, ROW, 0)  # a skipped token copies nothing
    for off in range(0, ROW, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < n
        k = tl.load(k_ptr + b * stride_kb + t * stride_kt + cols, mask=m)
        v = tl.load(v_ptr + b * stride_vb + t * stride_vt + cols, mask=m)
        tl.store(kc_ptr + dst + cols, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst + cols, v.to(vc_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# launcher

def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, n_kv, hd]`` with each token's ``n_kv * hd`` values contiguous (copy only if not)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def kv_write_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor) -> None:
    B, T = k.shape[:2]
    if B * T == 0:
        return
    k, v = _rows(k), _rows(v)
    row = k.shape[-2] * k.shape[-1]
    block = min(triton.next_power_of_2(row), 1024)
    # the layer's view is taken here: an in-kernel `layer * stride` is 32-bit and overflows once a
    # cache passes 2^31 elements (e.g. 6 layers x 32 slots x 32k positions x 512)
    k_layer, v_layer = k_cache[layer], v_cache[layer]
    _kv_write_kernel[(B * T,)](
        k, v, k_layer, v_layer, slots, start, lens,
        T, k_cache.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_layer.stride(0), k_layer.stride(1),
        ROW=row, BLOCK=block, **pdl_kwargs(k),
    )


# ---------------------------------------------------------------------------------------------
# reference

def window_positions(start: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, T]`` absolute positions ``start[b] + t``."""
    return start[:, None] + torch.arange(T, device=start.device)[None, :]


def window_valid(slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, T: int, limit: int) -> torch.Tensor:
    """``[B, T]`` mask of the columns a write may touch: real row, real token, inside the cache."""
    t = torch.arange(T, device=slots.device)[None, :]
    return (slots[:, None] >= 0) & (t < lens[:, None]) & (window_positions(start, T) < limit)


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor) -> None:
    T = k.shape[1]
    valid = window_valid(slots, start, lens, T, k_cache.shape[2])
    b, t = valid.nonzero(as_tuple=True)
    pos = window_positions(start, T)[b, t]
    k_cache[layer, slots[b], pos] = k[b, t].to(k_cache.dtype)
    v_cache[layer, slots[b], pos] = v[b, t].to(v_cache.dtype)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             layer: int, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor) -> None:
    """Write ``k``/``v [B, T, n_kv, hd]`` into ``k_cache``/``v_cache [L, slots, S, n_kv, hd]``."""
    if use_triton(k):
        kv_write_triton(k, v, k_cache, v_cache, layer, slots, start, lens)
    else:
        kv_write_reference(k, v, k_cache, v_cache, layer, slots, start, lens)


@kv_write.register_kernel("cuda")
def _kv_write_cuda(k, v, k_cache, v_cache, layer, slots, start, lens) -> None:
    kv_write_triton(k, v, k_cache, v_cache, layer, slots, start, lens)


@kv_write.register_fake
def _kv_write_fake(k, v, k_cache, v_cache, layer, slots, start, lens) -> None:
    return None
