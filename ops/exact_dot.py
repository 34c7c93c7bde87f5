"""Exact mode's tile products: ``tl.dot``, or under the interpreter each element's own sum.

Exact mode promises that a row's bits do not depend on the launch: its kernels (exact_linear,
exact_swiglu, the MoE experts' exact tiles, cache_attention's exact plan) fix the tile shapes and
the K order whatever the batch, and that is enough when the tile product computes every row and
column of the tile with the same arithmetic. The GPU's ``tl.dot`` does (fp32 "ieee": an FMA chain
per element; 16-bit operands: the same MMA instructions for every row). The interpreter's does not
promise it: ``tl.dot`` there is numpy's matmul, i.e. the machine's BLAS, whose kernels may sum an
element's products in an order that follows where the element sits in the product (OpenBLAS's AVX2
sgemm: rows 0-5, 6-11 and 12-15 of a 16-row product give three different last-place results for the
same row, and an element's column position changes them as well). A row alone (row 0 of its tile)
and the same row at position 8 of a verify window then differ in fp32 (bf16's rounding mostly hides
it), on CPUs whose BLAS blocks that way and not on others.

``ROWWISE`` (set by the launchers in exact mode off CUDA, never on the GPU) makes the product the
elementwise multiply and a sum over ``k`` in fp32 (:func:`rowwise_dot`): each element then depends
on its own row of ``a`` and column of ``b`` alone, whatever its position, the other rows or the BLAS
build. It is the same mathematical product with fp32 accumulation as the GPU's dot (16-bit operands
multiply exactly in fp32); only the order in which a K step's products and the accumulator are
added differs, and it is one order for every element. With ``ROWWISE`` off the helpers are the
plain ``tl.dot`` calls, so the compiled GPU code is that of ``tl.dot``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rowwise_dot(a, b):
    # [M, K] x [K, N] -> [M, N] fp32: element (m, n) is a[m, :] * b[:, n] summed over k, the same
    # reduction for every element (module doc)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def exact_dot(a, b, acc, PRECISION: tl.constexpr, ROWWISE: tl.constexpr):
    # acc + a @ b: tl.dot(a, b, acc) with PRECISION, or (ROWWISE, interpreter only) acc plus
    # rowwise_dot's sums
    if ROWWISE:
        c = acc + rowwise_dot(a, b)
    else:
        c = tl.dot(a, b, acc, input_precision=PRECISION)
    return c
