"""Several-row GEMV: ``x [M, K] @ weight[N, K]^T`` for ``2 <= M <= 16`` rows and ``K <= 2048``
without ``tl.dot`` or shared memory (``LFMSPARK_ROWS_GEMV``, opt-in; ops/skinny_linear.py routes).

Why (an experiment, docs/benchmarks.md session 19): inside the batch-1 speculative round the
several-row swap-AB products of small weights (``2048 x 2048``: 8 MiB, 2 us at copy bandwidth) take
~5 us each, while the one-row GEMV of the decode step takes 1.8 us on the same weight. The GEMV
holds no shared memory, so its programs launch beside the predecessor's (PDL) and request their
whole weight slice before waiting for it; the swap-AB programs hold 120-200 KB of pipeline buffers
each and cannot, and their split-K fix-up adds two dependent memory round trips after the last K
step. This kernel is the GEMV's shape for a few rows: program ``j`` owns ``BLOCK_N`` output columns
for all rows and reads its ``[BLOCK_N, K]`` weight slice in one load before the PDL wait, then
multiplies it with each row of ``x`` (fp32 multiply-adds on the CUDA cores: ``M`` times the
one-row kernel's arithmetic, which the weight stream still hides at ``M = 10``), no split.

The accumulator is the swap-AB kernel's transposed tile ``out^T [BLOCK_N, BLOCK_M]``, so the
epilogues are skinny_linear's (plain rounding, ``ADD_NORM``, ``ROW_NORM``), same roundings; only the
fp32 summation order differs (as between any two of the product kernels: a bf16 result may differ
by an ulp).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs
from .skinny_linear import (AddNorm, SkinnyConfig, _load_row_ssq, _row_rstd, _scale_rows, _store_add_norm,
                            _store_out, _tile_offsets)
from .tuning import tuned

MAX_ROWS = 16       # rows: one 16-row accumulator tile
MAX_K = 2048        # the products it is meant for (no split-K: longer rows take the swap-AB kernel)


def rows_gemv_shapes() -> frozenset[tuple[int, int]] | None:
    """``LFMSPARK_ROWS_GEMV``: ``0`` (default, off), ``1`` (every eligible product) or a comma list of
    ``NxK`` shapes (only those). Returns None for all, an empty set for none."""
    value = os.environ.get("LFMSPARK_ROWS_GEMV", "0").strip()
    if value in ("", "0"):
        return frozenset()
    if value == "1":
        return None
    shapes = set()
    for item in value.split(","):
        n, sep, k = item.strip().partition("x")
        if not (sep and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
            raise ValueError(f"LFMSPARK_ROWS_GEMV={value!r}: use 0 (off), 1 (every product of 2-{MAX_ROWS} rows "
                             f"and K <= {MAX_K}) or a comma list of NxK shapes, e.g. 2048x2048,6144x2048")
        shapes.add((int(n), int(k)))
    return frozenset(shapes)


def rows_gemv_eligible(M: int, N: int, K: int) -> bool:
    """Whether ``LFMSPARK_ROWS_GEMV`` routes an ``[M, K] x [N, K]^T`` product here."""
    shapes = rows_gemv_shapes()
    if shapes is not None and not shapes:  # off: decided before touching the (maybe symbolic) sizes
        return False
    if not (2 <= M <= MAX_ROWS and 0 < K <= MAX_K and N > 0):
        return False
    return shapes is None or (int(N), int(K)) in shapes  # weight sizes: static


@triton.jit
def _rows_gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, g_ptr, sg_ptr, ssq_out_ptr, ssq_in_ptr, n_ssq_in, inv_k, eps,
    M, N, K, stride_xm, stride_wn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SSQ_TILES: tl.constexpr,
    ADD_NORM: tl.constexpr, ROW_NORM: tl.constexpr, PDL: tl.constexpr,
):
    # program j: columns [j * BLOCK_N, (j + 1) * BLOCK_N) of all ROWS (== M) rows, the whole K range in
    # BLOCK_K steps
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    rows = tl.arange(0, 16)
    row_ok = rows < M
    # columns past N read row c % N (never stored): unmasked along N. The first K block depends on no
    # earlier kernel: it is requested before the wait (all of the slice when BLOCK_K >= K)
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
    out_offs, out_mask = _tile_offsets(rows, cols, row_ok, N, stride_om, True)
    if ADD_NORM:
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ROW_NORM:
        ssq_part = _load_row_ssq(ssq_in_ptr, n_ssq_in, rows, row_ok, M, SSQ_TILES)
    if ADD_NORM:
        res = tl.load(res_ptr + out_offs, mask=out_mask, other=0.0)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if k > 0:
            w = tl.load(w_ptrs + k, mask=(k + ks < K)[None, :], other=0.0)
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptr + m * stride_xm + k + ks, mask=k + ks < K, other=0.0)
            part = tl.sum(w.to(tl.float32) * xm.to(tl.float32)[None, :], axis=1)
            acc = tl.where(rows[None, :] == m, acc + part[:, None], acc)
    if PDL == 2:  # LFMSPARK_PDL_TRIGGER late (the default for GEMVs): this program's weights are read
        tl.extra.cuda.gdc_launch_dependents()
    if ROW_NORM:
        acc = _scale_rows(acc, _row_rstd(ssq_part, row_ok, inv_k, eps), True)
    if ADD_NORM:
        _store_add_norm(out_ptr, res, g, sg_ptr, ssq_out_ptr, out_offs, out_mask, acc, rows, row_ok, M, pid_n, True)
    else:
        _store_out(out_ptr + out_offs, out_mask, acc, acc, False)


def rows_gemv_config(M: int, N: int, K: int) -> SkinnyConfig:
    """Launch parameters: 16 columns per program (``N / 16`` programs: 128 for ``N = 2048``, about one
    per H200 SM), 256-wide K steps, 4 warps (145 registers a thread at 10 rows: the programs can launch
    beside a tile product's, which holds ~30K of the SM's 64K registers). ``LFMSPARK_TUNE`` kind ``rows_gemv`` replaces
    ``block_n`` / ``block_k`` / ``num_warps``."""
    shape = (N, K)
    block_k = min(tuned("rows_gemv", "block_k", 256, shape), max(16, triton.next_power_of_2(K)))
    return SkinnyConfig(block_n=tuned("rows_gemv", "block_n", 16, shape), block_k=block_k,
                        num_warps=tuned("rows_gemv", "num_warps", 4, shape), num_stages=1, rows_gemv=True)


def launch_rows_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: SkinnyConfig,
                     add_norm: AddNorm | None, row_ssq: torch.Tensor | None, eps: float) -> None:
    """One launch of the kernel on checked inputs (ops/skinny_linear.py ``_launch``): ``out [M, N]``,
    the ``ADD_NORM`` / ``ROW_NORM`` epilogues as there."""
    (M, K), N = x.shape, out.shape[1]
    if not (2 <= M <= MAX_ROWS and K <= MAX_K):
        raise ValueError(f"rows_gemv takes 2-{MAX_ROWS} rows and K <= {MAX_K}, got M = {M}, K = {K}")
    norm = add_norm or AddNorm(out, out, out, out)  # not read without ADD_NORM
    ssq_in = out if row_ssq is None else row_ssq     # not read without ROW_NORM
    _rows_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, out, norm.residual, norm.norm_weight, norm.scaled, norm.ssq, ssq_in,
        0 if row_ssq is None else row_ssq.shape[0], 1.0 / K, eps,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SSQ_TILES=2 if row_ssq is None else max(2, triton.next_power_of_2(row_ssq.shape[0])),
        ADD_NORM=add_norm is not None, ROW_NORM=row_ssq is not None,
        num_warps=cfg.num_warps, num_stages=1, **pdl_kwargs(x, one_row_product=True),
    )
