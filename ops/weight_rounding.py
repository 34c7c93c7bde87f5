"""Rounding an fp32 sum to the weight dtype inside a kernel, as ``F.linear`` in that dtype rounds
its fp32 accumulator once: shared by the Markov walk's kernels (ops/markov_walk/op.py,
ops/markov_walk/persistent.py), whose argmax must see the bias the module would compute."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUND_MODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # the kernels' ROUND constexpr


@triton.jit
def round_to_weight_dtype(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded to the weight dtype (0: fp32, 1: bf16, 2: fp16) and back to fp32. bf16
    rounds to nearest even by bit arithmetic, the same on the GPU and in the interpreter (which
    truncates on a plain cast); NaN stays NaN."""
    if ROUND == 1:
        u = x.to(tl.uint32, bitcast=True)
        u = u + (0x7FFF + ((u >> 16) & 1))
        r = ((u >> 16) << 16).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, r)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x
