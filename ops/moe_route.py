"""MoE routing in one launch: sigmoid router scores, biased top-k selection, unbiased weights.

``logits [N, E]`` (the router product, any float dtype) -> ``(ids [N, k] int64, weights [N, k])``
in the logits' dtype, as HF ``Lfm2MoeSparseMoeBlock`` routes (reference/lfm2.md §4):

- ``p = sigmoid(logits)``, rounded to the logits' dtype (HF takes the sigmoid of the bf16 logits);
- selection scores ``p + expert_bias`` (fp32: HF's bias is an fp32 buffer; a bias in the logits'
  dtype, as in a model cast whole, adds in that dtype as PyTorch does), plus an optional fp32
  per-token ``selection_bias [N, E]`` (the routing-locality benchmark mode, models/lfm2_moe.py);
- the ``k`` best scores in descending order, ties to the lower expert index (HF's ``torch.topk``
  leaves tie order unspecified; bf16 sigmoids without an expert bias do tie);
- weights: the chosen experts' unbiased ``p``, divided by ``(sum + 1e-6)`` when ``normalize``, times
  ``scale`` (``routed_scaling_factor``).

Why an op: left to Inductor, this is the top-k's pairwise-rank kernel, a gather and the
normalisation's reduction, about three small launches per MoE layer at every decode step (with the
plan kernel, ~160 us of LFM2-8B-A1B's 1.54 ms step: docs/benchmarks.md). Here one program
routes a few tokens (one, for 32 experts: :func:`route_launch`), with every reduction over a
token's own experts: a token's results do not depend on the other tokens of the launch (exact mode
needs nothing more).

Numerics: the selection scores are the reference's bits (the sigmoid rounded as HF rounds it, then
the fp32 additions); the weights are normalised and scaled in fp32 and rounded once, where the
reference (eager PyTorch in a 16-bit dtype) rounds after each step: they agree to a rounding of
the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton

PAIRWISE_PER_PROGRAM = 1024  # (token, expert, expert) comparisons one program holds: 32 per thread of one warp


def route_launch(n_tokens: int, n_experts: int) -> tuple[int, int]:
    """``(tokens per program, warps)``. The pairwise ranks are ``[tokens, E, E]`` tensors held in
    registers: at most ``PAIRWISE_PER_PROGRAM`` comparisons per warp (16 tokens of 32 experts per
    program spill, making LFM2-8B-A1B's decode step 6% slower than Inductor's kernels: docs/decisions.md)."""
    e_pad = max(2, triton.next_power_of_2(n_experts))
    block_t = min(triton.next_power_of_2(max(n_tokens, 1)), max(1, PAIRWISE_PER_PROGRAM // (e_pad * e_pad)))
    warps = min(4, max(1, block_t * e_pad * e_pad // PAIRWISE_PER_PROGRAM))
    return block_t, warps


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest, ties to even), returned in fp32. bf16 is rounded on
    the bits: Triton's interpreter truncates a bf16 cast, where the GPU rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _moe_route_kernel(
    logits_ptr, expert_bias_ptr, sel_bias_ptr, ids_ptr, weights_ptr,
    N, scale,
    stride_ln, stride_le, stride_bn, stride_be,
    E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_EXPERT_BIAS: tl.constexpr, ROUND_BIASED: tl.constexpr, HAS_SEL_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    t_ok = tokens < N
    e_ok = experts < E
    ok = t_ok[:, None] & e_ok[None, :]
    logit = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * stride_ln + experts[None, :] * stride_le,
                    mask=ok, other=0.0)
    # HF's sigmoid runs in the logits' dtype: round it there, then select in fp32
    p = _round_to(tl.sigmoid(logit.to(tl.float32)), logit.dtype)
    score = p
    if HAS_EXPERT_BIAS:
        score = score + tl.load(expert_bias_ptr + experts, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND_BIASED:  # a bias in the logits' 16-bit dtype: PyTorch adds in that dtype
            score = _round_to(score, logit.dtype)
    if HAS_SEL_BIAS:
        score = score + tl.load(sel_bias_ptr + tokens[:, None].to(tl.int64) * stride_bn + experts[None, :] * stride_be,
                                mask=ok, other=0.0)
    score = tl.where(e_ok[None, :], score, float("-inf"))   # padding experts rank below every real one
    # rank of expert i: the experts j that beat it (a higher score, or an equal one at a lower index)
    s_i = score[:, :, None]
    s_j = score[:, None, :]
    lower = experts[None, :] < experts[:, None]          # [i, j]: j < i
    beats = (s_j > s_i) | ((s_j == s_i) & lower[None, :, :])
    rank = tl.sum(beats.to(tl.int32), axis=2)              # [BLOCK_T, E_PAD], a permutation per token
    slots = tl.arange(0, K_PAD)
    at_slot = rank[:, None, :] == slots[None, :, None]     # [BLOCK_T, K_PAD, E_PAD]
    ids = tl.sum(tl.where(at_slot, experts[None, None, :], 0), axis=2)
    w = tl.sum(tl.where(at_slot, p[:, None, :], 0.0), axis=2)     # [BLOCK_T, K_PAD]
    k_ok = slots < TOPK
    if NORMALIZE:
        total = tl.sum(tl.where(k_ok[None, :], w, 0.0), axis=1)
        w = w / (total[:, None] + 1e-6)
    w = _round_to(w * scale, weights_ptr.dtype.element_ty)   # exact in the output dtype: the store keeps it
    out_ok = t_ok[:, None] & k_ok[None, :]
    offs = tokens[:, None].to(tl.int64) * TOPK + slots[None, :]
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=out_ok)
    tl.store(weights_ptr + offs, w.to(weights_ptr.dtype.element_ty), mask=out_ok)


def _check(logits: torch.Tensor, expert_bias: torch.Tensor | None, selection_bias: torch.Tensor | None,
           top_k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"moe_route: logits must be a float [N, E] tensor, got {logits.dtype} {tuple(logits.shape)}")
    N, E = logits.shape
    if not 0 <= top_k <= E:
        raise ValueError(f"moe_route: top_k={top_k} must lie in [0, {E}] (the router's experts)")
    if expert_bias is not None and (expert_bias.shape != (E,) or not expert_bias.is_floating_point()):
        raise ValueError(f"moe_route: expert_bias must be a float [{E}] tensor, got "
                         f"{expert_bias.dtype} {tuple(expert_bias.shape)}")
    if selection_bias is not None and (selection_bias.shape != (N, E) or selection_bias.dtype != torch.float32):
        raise ValueError(f"moe_route: selection_bias must be fp32 [{N}, {E}], got "
                         f"{selection_bias.dtype} {tuple(selection_bias.shape)}")


def moe_route_triton(logits: torch.Tensor, expert_bias: torch.Tensor | None, selection_bias: torch.Tensor | None,
                     top_k: int, normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the Triton kernel."""
    _check(logits, expert_bias, selection_bias, top_k)
    N, E = logits.shape
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, top_k, dtype=logits.dtype, device=logits.device)
    if N == 0 or top_k == 0:
        return ids, weights
    placeholder = ids  # pointer for an absent bias (never read: the constexpr drops the load)
    sel = selection_bias if selection_bias is not None else placeholder
    block_t, warps = route_launch(N, E)
    _moe_route_kernel[(triton.cdiv(N, block_t),)](
        logits, expert_bias if expert_bias is not None else placeholder, sel, ids, weights,
        N, float(scale),
        logits.stride(0), logits.stride(1),
        sel.stride(0) if selection_bias is not None else 0, sel.stride(1) if selection_bias is not None else 0,
        E=E, E_PAD=max(2, triton.next_power_of_2(E)), TOPK=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        BLOCK_T=block_t, HAS_EXPERT_BIAS=expert_bias is not None,
        ROUND_BIASED=expert_bias is not None and torch.promote_types(logits.dtype, expert_bias.dtype) == logits.dtype
        and logits.dtype != torch.float32,
        HAS_SEL_BIAS=selection_bias is not None,
        NORMALIZE=normalize, num_warps=warps, **pdl_kwargs(logits),
    )
    return ids, weights


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of each row of ``scores [N, E]``, in descending order, like
    ``torch.topk(...).indices`` for distinct scores; ties go to the lower expert index. Computed
    from pairwise ranks, as the kernel does."""
    E = scores.shape[-1]
    idx = torch.arange(E, device=scores.device)
    s_i, s_j = scores[:, :, None], scores[:, None, :]
    beats = (s_j > s_i) | ((s_j == s_i) & (idx[None, :] < idx[:, None])[None])   # [N, i, j]: j ranks above i
    rank = beats.sum(-1)                                                          # [N, E], a permutation of 0..E-1
    slot = torch.arange(k, device=scores.device)
    return ((rank[:, None, :] == slot[None, :, None]) * idx).sum(-1)              # [N, k]: the expert at each rank


def moe_route_reference(logits: torch.Tensor, expert_bias: torch.Tensor | None, selection_bias: torch.Tensor | None,
                        top_k: int, normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing in eager PyTorch (the CPU implementation and the kernel's oracle)."""
    probs = logits.sigmoid()
    scores = (probs + expert_bias).float() if expert_bias is not None else probs.float()
    if selection_bias is not None:
        scores = scores + selection_bias
    ids = top_k_ids(scores, top_k)
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return ids, weights * scale


@torch.library.custom_op("lfmspark::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, expert_bias: torch.Tensor | None, selection_bias: torch.Tensor | None,
              top_k: int, normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, top_k] int64, weights [N, top_k])`` of router ``logits [N, E]`` (module doc)."""
    if use_triton(logits):
        return moe_route_triton(logits, expert_bias, selection_bias, top_k, normalize, scale)
    _check(logits, expert_bias, selection_bias, top_k)  # the same limits on every device
    return moe_route_reference(logits, expert_bias, selection_bias, top_k, normalize, scale)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, expert_bias, selection_bias, top_k, normalize, scale):
    return moe_route_triton(logits, expert_bias, selection_bias, top_k, normalize, scale)


@moe_route.register_fake
def _moe_route_fake(logits, expert_bias, selection_bias, top_k, normalize, scale):
    _check(logits, expert_bias, selection_bias, top_k)
    N = logits.shape[0]
    return logits.new_empty((N, top_k), dtype=torch.int64), logits.new_empty((N, top_k))
