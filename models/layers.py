"""Building blocks shared by the target and draft modules, and where their products run.

Every product ``x @ W^T`` of the models goes through :func:`linear` / :func:`linear_pair` or the
norm helpers below, which ask ops/routing.py which kernel takes it. What they add to a plain module
chain, on CUDA (CPU and other shapes run the modules):

- **One-row decode** (batch 1): each residual add + RMSNorm + the product after it is one
  ``lfmspark::add_rmsnorm_gemv`` (:func:`norm_linear`, :func:`norm_feed_forward`); a dense
  :class:`SwiGLU`'s ``silu(gate) * up`` rides in the same kernel.
- **2-16 rows outside decode** (the batch-1 verify, the draft's block, short prompt chunks): a
  mixer's output projection adds the residual and computes the feed-forward norm's statistics in
  its epilogue, and the gate/up product applies the row scale in its own
  (:func:`project_norm_feed_forward`); where the caller asks (the target's verify, the draft's
  block), the norms *between* layers ride in the products' epilogues too, handed on as a
  :class:`NormedCarry` that the next ``in_proj`` / ``qkv_proj`` / draft q + K/V pair or the LM head
  finishes. No norm kernel runs between the round's products.

FP8 weights (models/quant.py): a projection stored in float8 is an :class:`Fp8Linear`, whose
products all go through :func:`fp8_linear`: ``lfmspark::skinny_linear_fp8`` where the bf16 weight
would take ``skinny_linear`` (the carry's row scale included), the dequantized weight elsewhere
(``F.linear`` on more rows, ``exact_linear`` in exact mode). The fused kernels above read bf16
weights only, so a norm before an fp8 projection runs as a module (the dtype checks below send
it there) and a dense :class:`SwiGLU` with fp8 weights applies its activation after the product.

Numerics: the sums ``s`` are the modules'; a normalised input is rounded once as ``s * weight``
where the module rounds ``s * rstd`` and then its product with the weight, a difference within
bf16 noise; the one-row decode rounds as the several-row path does, so target-only decoding and
the verify agree (ops/linear/add_rmsnorm_gemv.py ``scale_last``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.linear.skinny_linear import pair_problem
from ..ops.routing import NormRoute, exact_mode, norm_route, pair_product, rows_of, skinny_product
from .quant import Fp8Weight, quantize_fp8

lfm = torch.ops.lfmspark


def linear(x: torch.Tensor, weight: torch.Tensor, side_stream: bool = False) -> torch.Tensor:
    """``x @ weight.T`` (no bias): ``lfmspark::skinny_linear`` for 1-16 rows on CUDA
    (ops/routing.py ``skinny_product``), else ``F.linear`` (cuBLAS). ``side_stream``: the product
    runs on a stream beside the main one (its own split-K counters: ops/linear/skinny_linear.py).
    In exact mode (ops/routing.py) ``lfmspark::exact_linear``, whatever the rows."""
    if exact_mode():
        out = lfm.exact_linear(x.reshape(rows_of(x), x.shape[-1]), weight)   # refuses mixed dtypes
        return out.view(*x.shape[:-1], weight.shape[0])
    if skinny_product(x):
        rows = rows_of(x)
        out = lfm.skinny_linear(x.reshape(rows, x.shape[-1]), weight, side_stream=side_stream)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, row_ssq: torch.Tensor | None = None, eps: float = 0.0,
               side_stream: bool = False) -> torch.Tensor:
    """``x @ dequantize(w).T`` for an fp8 weight (models/quant.py), in ``x``'s dtype: every product of
    an :class:`Fp8Linear` runs here. Per-channel scales take ``lfmspark::skinny_linear_fp8`` where
    :func:`linear` would take ``skinny_linear`` (1-16 rows on CUDA, and every product with a row
    scale); K-grouped scales (block-scaled checkpoints), more rows and the CPU run the reference,
    ``F.linear`` of the weight dequantized to ``x``'s dtype (until fp8 prefill kernels exist); exact
    mode ``exact_linear`` of the dequantized weight (the dequantization is elementwise, so a row's
    bits still do not depend on the launch). ``row_ssq``, ``eps``: the row scale of a
    :class:`NormedCarry`'s product (``skinny_linear``'s)."""
    rows, width, n_out = rows_of(x), x.shape[-1], w.weight.shape[0]
    x2 = x.reshape(rows, width)
    if exact_mode() and row_ssq is None:
        out = lfm.exact_linear(x2, w.dequantize(x.dtype))
    elif w.per_channel and (row_ssq is not None or skinny_product(x)):
        out = lfm.skinny_linear_fp8(x2, w.weight, w.scale, row_ssq, eps, side_stream)
    elif row_ssq is not None:
        out = lfm.skinny_linear(x2, w.dequantize(x.dtype), row_ssq, eps, side_stream)
    else:
        return F.linear(x, w.dequantize(x.dtype))
    return out.view(*x.shape[:-1], n_out)


def _carried_product(carry: NormedCarry, proj: nn.Module, eps: float) -> torch.Tensor:
    """The product of the norm a carry stands for and ``proj``'s weight (bf16 or fp8)."""
    if isinstance(proj, Fp8Linear):
        return fp8_linear(carry.scaled, proj.fp8, carry.ssq, eps)
    return lfm.skinny_linear(carry.scaled, proj.weight, carry.ssq, eps)


def linear_pair(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, carry: NormedCarry | None = None,
                eps: float = 0.0) -> torch.Tensor | None:
    """``x @ [w_a; w_b].T`` (``[..., N_A + N_B]``) as one ``lfmspark::skinny_linear_pair`` launch where
    routing allows (2-16 rows, ``pair_product``) and the weights are ones the op takes (a model in
    one dtype always qualifies); else None, and the caller runs its products as before. Why: two
    weights that must stay apart (the draft's q projection and its slice of the stacked K/V
    projections) cost one launch instead of two, without a stacked copy. With ``carry`` (of the
    RMSNorm of ``eps`` that ``x`` would be the output of), the product of that norm's output."""
    x2 = x.reshape(rows_of(x), x.shape[-1]) if carry is None else carry.scaled
    if not pair_product(x) or pair_problem(x2, w_a, w_b) is not None:
        return None
    if carry is None:
        out = lfm.skinny_linear_pair(x2, w_a, w_b)
    else:
        out = lfm.skinny_linear_pair(x2, w_a, w_b, carry.ssq, eps)
    return out.view(*x.shape[:-1], out.shape[-1])


class NormedCarry(NamedTuple):
    """A layer's output whose next RMSNorm is half done (see the module doc): the sum ``s`` travels
    as the residual stream ``h`` beside it; here are ``scaled = s * g`` ``[rows, H]`` for the consumer
    norm's weight ``g`` and the per-tile row sums of ``s^2`` ``[tiles, rows]`` (fp32), what
    ``row_ssq`` takes. A consumer that cannot use them runs the norm on ``h`` instead."""

    scaled: torch.Tensor
    ssq: torch.Tensor


# what a layer hands the next with its residual stream h: a pending feed-forward output (the layer's
# output is h + delta), a NormedCarry (h is the output), or nothing (h is the output: the embeddings)
Pending = torch.Tensor | NormedCarry | None


def completed(h: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The layer output that ``h`` and its ``pending`` part stand for."""
    return h + pending if isinstance(pending, torch.Tensor) else h


def _one_dtype(*tensors: torch.Tensor) -> bool:
    # also keeps fp8 weights (Fp8Linear) off the fused kernels, which read weights of x's dtype
    return len({t.dtype for t in tensors}) == 1


def _one_row(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, t.shape[-1]).contiguous()


def _norm_gemv(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, weight: torch.Tensor,
               swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # each product rounds its normalised input as the several-row path's epilogues do (scale_last):
    # the feed-forward's, and those after a layer (delta given: the first layer's input, the
    # embeddings, is normed by the module there too)
    scale_last = swiglu or delta is not None
    s, y = lfm.add_rmsnorm_gemv(_one_row(h), None if delta is None else _one_row(delta), norm.weight, norm.eps,
                                weight, swiglu, scale_last)
    # without delta the sum is h itself (the op's s is a copy of it)
    return h if delta is None else s.view(h.shape), y.view(*h.shape[:-1], y.shape[-1])


def add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` with ``s = h + delta`` (``h`` when ``delta`` is None). In exact mode one
    ``lfmspark::exact_add_rms_norm`` launch, the same bits as the add and the module's norm."""
    if delta is None:
        return h, norm(h)
    if exact_mode():
        rows, width = rows_of(h), h.shape[-1]
        s, normed = lfm.exact_add_rms_norm(h.reshape(rows, width), delta.reshape(rows, width), norm.weight, norm.eps)
        return s.view(h.shape), normed.view(h.shape)
    s = h + delta
    return s, norm(s)


def norm_linear(h: torch.Tensor, delta: Pending, norm: RMSNorm, proj: nn.Linear, decode: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, proj(norm(s)))`` with ``s = h + delta`` (``h`` itself when ``delta`` is None or a
    :class:`NormedCarry`). With a carry (made for this ``norm``), one ``lfmspark::skinny_linear`` with
    its row scale; on the one-row decode route (``decode``: the caller's decode step), one
    ``lfmspark::add_rmsnorm_gemv``; otherwise the modules (bit-identical to calling them)."""
    if isinstance(delta, NormedCarry):
        y = _carried_product(delta, proj, norm.eps)
        return h, y.view(*h.shape[:-1], y.shape[-1])
    if norm_route(h, decode) is NormRoute.GEMV and _one_dtype(h, norm.weight, proj.weight):
        return _norm_gemv(h, delta, norm, proj.weight, swiglu=False)
    s, normed = add_norm(h, delta, norm)
    return s, proj(normed)


def norm_feed_forward(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, feed_forward: nn.Module,
                      decode: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, feed_forward(norm(s)))`` with ``s = h + delta``, as :func:`norm_linear`: a dense
    :class:`SwiGLU` on the one-row decode route computes ``silu(gate) * up`` in
    ``lfmspark::add_rmsnorm_gemv`` (then ``w2``); any other feed-forward (the MoE block) runs unfused."""
    if (isinstance(feed_forward, SwiGLU) and norm_route(h, decode) is NormRoute.GEMV
            and _one_dtype(h, norm.weight, feed_forward.w13.weight)):
        s, act = _norm_gemv(h, delta, norm, feed_forward.w13.weight, swiglu=True)
        return s, feed_forward.w2(act)
    s, normed = add_norm(h, delta, norm)
    return s, feed_forward(normed)


def _carry_of(out: torch.Tensor, next_norm: torch.Tensor) -> NormedCarry:
    """The carry of a layer output made by other kernels (an MoE feed-forward's layer): the
    statistics of ``skinny_linear_add_norm``'s epilogue in plain ops, one fused kernel under compile."""
    out32 = out.reshape(-1, out.shape[-1]).float()
    return NormedCarry((out32 * next_norm.float()).to(out.dtype), out32.pow(2).sum(-1)[None, :])


def project_norm_feed_forward(h: torch.Tensor, y: torch.Tensor, proj: nn.Linear, norm: RMSNorm,
                              feed_forward: nn.Module, decode: bool = True, next_norm: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, Pending]:
    """``(s, feed_forward(norm(s)))`` with ``s = h + proj(y)``: a mixer's output projection, the
    residual add and the feed-forward after its RMSNorm. ``decode``: the caller's decode step.
    ``next_norm``: the weight of the RMSNorm after the layer, which the caller asks the layer to
    start: then, on the epilogue route, ``(out, NormedCarry)`` for the layer's output ``out = s +
    feed_forward(norm(s))``, the down projection adding the residual and writing the statistics
    in its epilogue (``lfmspark::skinny_linear_add_norm``).

    On the epilogue route (ops/routing.py ``norm_route``) with a dense :class:`SwiGLU`, the norm has
    no kernel of its own: ``lfmspark::skinny_linear_add_norm`` adds the residual in the projection's
    epilogue and writes ``s``, ``s * norm.weight`` and the per-row partial sums of ``s^2``, and
    ``lfmspark::skinny_swiglu`` multiplies ``s * norm.weight`` by the gate/up weights and scales each
    row by ``rsqrt(mean square + eps)`` in its epilogue. Otherwise :func:`norm_feed_forward` over
    ``proj(y)``."""
    route = norm_route(y, decode)
    carry = next_norm is not None and route is NormRoute.EPILOGUE and next_norm.dtype == h.dtype
    dense = isinstance(feed_forward, SwiGLU)
    if not (route is NormRoute.EPILOGUE and dense
            and _one_dtype(y, h, proj.weight, norm.weight, feed_forward.w13.weight)):
        s, ff = norm_feed_forward(h, proj(y), norm, feed_forward, decode)
        if carry:
            out = s + ff
            return out, _carry_of(out, next_norm)
        return s, ff
    rows, width = rows_of(y), h.shape[-1]
    s, scaled, ssq = lfm.skinny_linear_add_norm(y.reshape(rows, y.shape[-1]), proj.weight,
                                                h.reshape(rows, width), norm.weight)
    act = lfm.skinny_swiglu(scaled, feed_forward.w13.weight, ssq, norm.eps)
    if carry:
        out, scaled, ssq = lfm.skinny_linear_add_norm(act, feed_forward.w2.weight, s, next_norm)
        return out.view(h.shape), NormedCarry(scaled, ssq)
    return s.view(h.shape), feed_forward.w2(act.view(*h.shape[:-1], act.shape[-1]))


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` computed by :func:`linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is float8 e4m3fn with fp32 scales (models/quant.py),
    computed by :func:`fp8_linear`. ``weight [N, K]`` and ``weight_scale`` (``[N]``, or ``[N, G]`` per
    ``group_size`` inputs) are parameters that never require grad (fp8 has no autograd)."""

    def __init__(self, w: Fp8Weight):
        super().__init__()
        self.weight = nn.Parameter(w.weight, requires_grad=False)
        self.weight_scale = nn.Parameter(w.scale, requires_grad=False)
        self.group_size = w.group_size

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """The fp8 copy of a bias-free linear layer, scaled per output channel."""
        return cls(quantize_fp8(linear.weight.detach()))

    @property
    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.group_size)

    in_features = property(lambda self: self.weight.shape[1])
    out_features = property(lambda self: self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8)

    def extra_repr(self) -> str:
        scales = "per channel" if self.group_size == 0 else f"per channel and {self.group_size} inputs"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3fn, scales {scales}"


class RMSNorm(nn.Module):
    """HF LFM2 / Qwen3 RMSNorm: fp32 statistics, cast to the input dtype, then ``weight *`` (no +1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if exact_mode():    # ops/routing.py: the same bits in any launch
            if x.dtype != self.weight.dtype:
                raise ValueError(f"exact mode needs one dtype: RMSNorm input {x.dtype}, weight {self.weight.dtype}")
            return lfm.exact_rms_norm(x.reshape(rows_of(x), x.shape[-1]), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate x) * up x)`` with gate and up fused into one ``[2F, H]`` weight ``w13``
    (HF ``w1`` rows first, then ``w3``), so a decode step issues one GEMM instead of two."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w13 = Linear(hidden, 2 * ffn)
        self.w2 = Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.w13, Fp8Linear):
            # no fused fp8 gate/up kernel: the product (fp8_linear), then the activation, with the
            # roundings of the fused ops (gate and up rounded, silu rounded, the product rounded)
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        if exact_mode():
            # ops/routing.py: the activation in the gate/up product's epilogue, with the unfused
            # module's roundings, the same bits in any launch
            rows = rows_of(x)
            h = lfm.exact_swiglu(x.reshape(rows, x.shape[-1]), self.w13.weight)
            h = h.view(*x.shape[:-1], self.w13.weight.shape[0] // 2)   # named width: rows may be zero
            return self.w2(h)
        if skinny_product(x):
            # the activation rides in the gate/up product's epilogue: the [rows, 2F] product is
            # never written and costs no separate activation kernel
            rows = rows_of(x)
            h = lfm.skinny_swiglu(x.reshape(rows, x.shape[-1]), self.w13.weight).view(*x.shape[:-1], -1)
            return self.w2(h)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
