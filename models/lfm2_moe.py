"""LFM2-MoE target: the LFM2 backbone with sparse MoE feed-forwards after ``num_dense_layers``
(HF ``Lfm2MoeForCausalLM``; reference/lfm2.md §4).

Routing: sigmoid of the router logits; the fp32 ``expert_bias`` is added for **selection only**,
the weights are the unbiased sigmoids of the chosen experts, renormalised (``/ (sum + 1e-6)``) and
scaled by ``routed_scaling_factor``. There are no shared experts. The experts run through the
``lfmspark::moe_experts`` op, which reads only the selected experts.

**Routing locality (benchmark mode).** With random weights a sequence's tokens route almost
uniformly, so a verify window of 10 tokens reads ~24 of 32 experts per layer; a trained model's
consecutive tokens share experts far more. :func:`impose_routing_locality` mimics that, labelled,
for benchmarks: each slot (the sequence holding it) may choose only among a fixed random subset of
experts per layer, imposed as a large negative selection bias on the others (the weights of the
chosen experts are unchanged). It changes the model: outputs under it are not the checkpoint's.

**FP8 weights** (:func:`quantize_target`, models/quant.py): the target's projections (attention
``qkv_proj`` / ``out_proj``, ShortConv ``in_proj`` / ``out_proj``, the dense feed-forwards' ``w13`` /
``w2``) become :class:`~lfmspark.models.layers.Fp8Linear` and the MoE experts :class:`Fp8MoeExperts`,
each with per-output-channel scales. The embeddings (and so the tied LM head), the norms, the conv
filters and the MoE router stay in the model dtype. The expert kernels read per-channel fp8 stacks
as they are (ops/moe.py); stacks with block scales (fp8 exports quantized per block) are
dequantized to the model dtype for each call.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..ops.routing import exact_mode
from .config import TargetConfig
from .layers import Fp8Linear, Linear, SwiGLU
from .lfm2 import Lfm2ForCausalLM
from .quant import Fp8Weight, quantize_fp8, relative_error

lfm = torch.ops.lfmspark
log = logging.getLogger("lfmspark")


class Lfm2MoeExperts(nn.Module):
    """Stacked expert weights: ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``."""

    def __init__(self, n_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, ffn))

    def stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` in the model dtype."""
        return self.w13, self.w2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The tokens ``x [N, H]`` through their selected experts ``ids [N, k]``, weighted."""
        return lfm.moe_experts(x, ids, weights, self.w13, self.w2, exact_mode())


class Fp8MoeExperts(nn.Module):
    """The stacked expert weights in fp8 (models/quant.py): ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``
    float8 e4m3fn, with fp32 scales per expert and output channel (``w13_scale [E, 2I]``, ``w2_scale
    [E, H]``, or ``[..., G]`` per ``group_size`` inputs)."""

    def __init__(self, w13: Fp8Weight, w2: Fp8Weight):
        super().__init__()
        self.w13 = nn.Parameter(w13.weight, requires_grad=False)
        self.w13_scale = nn.Parameter(w13.scale, requires_grad=False)
        self.w2 = nn.Parameter(w2.weight, requires_grad=False)
        self.w2_scale = nn.Parameter(w2.scale, requires_grad=False)
        self.group_sizes = (w13.group_size, w2.group_size)

    @classmethod
    def quantize(cls, experts: Lfm2MoeExperts) -> Fp8MoeExperts:
        return cls(quantize_fp8(experts.w13.detach()), quantize_fp8(experts.w2.detach()))

    @property
    def fp8(self) -> tuple[Fp8Weight, Fp8Weight]:
        return (Fp8Weight(self.w13, self.w13_scale, self.group_sizes[0]),
                Fp8Weight(self.w2, self.w2_scale, self.group_sizes[1]))

    def stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` dequantized to ``dtype``."""
        w13, w2 = self.fp8
        return w13.dequantize(dtype), w2.dequantize(dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As :meth:`Lfm2MoeExperts.forward`: per-channel stacks go to the kernels in fp8, block-scaled
        ones dequantized (module doc)."""
        if self.group_sizes == (0, 0):
            return lfm.moe_experts(x, ids, weights, self.w13, self.w2, exact_mode(), self.w13_scale, self.w2_scale)
        w13, w2 = self.stacks(x.dtype)
        return lfm.moe_experts(x, ids, weights, w13, w2, exact_mode())


class Lfm2MoeBlock(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.use_expert_bias = cfg.use_expert_bias
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Lfm2MoeExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        # kept fp32 whatever the model dtype (HF creates it fp32; the loader preserves that)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # [slots, E] fp32 selection bias per slot (impose_routing_locality), None: routing as trained
        self.register_buffer("routing_bias", None, persistent=False)

    def route(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [N, k], topk_weights [N, k])`` for tokens ``x [N, H]``; ``bias [N, E]`` (the
        routing-locality mode's) is added to the selection scores only (``lfmspark::moe_route``)."""
        return lfm.moe_route(self.gate(x), self.expert_bias if self.use_expert_bias else None, bias,
                             self.top_k, self.norm_topk_prob, self.routed_scaling_factor)

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, H]`` (or ``[N, H]``); ``slots [B]``: each row's slot, which the routing-locality
        mode reads (the decoder layer passes it only in that mode)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        bias = None
        if self.routing_bias is not None and slots is not None:
            per_row = self.routing_bias[slots.clamp(min=0)]                      # padding rows (-1): any subset
            bias = per_row[:, None, :].expand(-1, x.shape[0] // slots.shape[0], -1).reshape(x.shape[0], -1)
        ids, weights = self.route(x, bias)
        return self.experts(x, ids, weights).view(shape)


# the selection bias of the experts outside a slot's subset: far below any sigmoid score plus expert bias
_EXCLUDED = -1e4


def impose_routing_locality(target: nn.Module, experts: int | None, slots: int, seed: int = 0) -> None:
    """Benchmark mode (see the module doc): the tokens of each of ``slots`` slots choose among
    ``experts`` experts per MoE layer, a subset drawn per (slot, layer) from ``seed``; ``None`` lifts
    it. Set before the engine compiles (the layers read it when traced)."""
    blocks = [m for m in target.modules() if isinstance(m, Lfm2MoeBlock)]
    if experts is None:
        for block in blocks:
            block.routing_bias = None
        return
    if not blocks:
        raise ValueError("routing locality needs an MoE target (this one has no MoE layers)")
    n_experts, top_k = blocks[0].gate.weight.shape[0], blocks[0].top_k
    if not top_k <= experts <= n_experts:
        raise ValueError(f"routing locality of {experts} experts: must lie in [{top_k}, {n_experts}] "
                         f"(the experts each token picks, the experts a layer has)")
    gen = torch.Generator().manual_seed(seed)
    for block in blocks:
        keep = torch.rand(slots, n_experts, generator=gen).argsort(dim=1)[:, :experts]
        bias = torch.full((slots, n_experts), _EXCLUDED, dtype=torch.float32).scatter_(1, keep, 0.0)
        block.routing_bias = bias.to(block.expert_bias.device)


def routing_locality(target: nn.Module) -> int | None:
    """The experts per slot and layer the routing-locality mode allows (None: routing as trained)."""
    for m in target.modules():
        if isinstance(m, Lfm2MoeBlock) and m.routing_bias is not None:
            return int((m.routing_bias[0] == 0).sum())
    return None


def moe_feed_forward(cfg: TargetConfig, layer: int) -> nn.Module:
    if cfg.is_moe_layer(layer):
        return Lfm2MoeBlock(cfg)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def __init__(self, cfg: TargetConfig):
        super().__init__(cfg, make_feed_forward=moe_feed_forward)


def target_projections(model: Lfm2ForCausalLM) -> dict[str, nn.Module]:
    """The modules whose weights FP8 serving stores in fp8, by name: each decoder layer's mixer
    projections, its dense feed-forward's ``w13`` / ``w2`` or its MoE experts (module doc)."""
    out: dict[str, nn.Module] = {}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        if layer.is_attention:
            out[p + "self_attn.qkv_proj"], out[p + "self_attn.out_proj"] = layer.self_attn.qkv_proj, layer.self_attn.out_proj
        else:
            out[p + "conv.in_proj"], out[p + "conv.out_proj"] = layer.conv.in_proj, layer.conv.out_proj
        ff = layer.feed_forward
        if isinstance(ff, Lfm2MoeBlock):
            out[p + "feed_forward.experts"] = ff.experts
        else:
            out[p + "feed_forward.w13"], out[p + "feed_forward.w2"] = ff.w13, ff.w2
    return out


@torch.no_grad()
def quantize_target(model: Lfm2ForCausalLM) -> int:
    """Store the target's projections in fp8 with per-output-channel scales, in place (module doc);
    those already in fp8 are left as they are. Returns how many modules were quantized; logs the
    bytes saved and the largest relative weight error (models/quant.py ``relative_error``)."""
    done, before, after, worst = 0, 0, 0, (0.0, "")
    for name, module in target_projections(model).items():
        if isinstance(module, (Fp8Linear, Fp8MoeExperts)):
            continue
        if isinstance(module, Lfm2MoeExperts):
            fp8 = Fp8MoeExperts.quantize(module)
            pairs = [(module.w13, fp8.fp8[0]), (module.w2, fp8.fp8[1])]
        else:
            fp8 = Fp8Linear.quantize(module)
            pairs = [(module.weight, fp8.fp8)]
        for weight, q in pairs:
            before += weight.numel() * weight.element_size()
            after += q.weight.numel() + q.scale.numel() * q.scale.element_size()
            err = relative_error(weight, q)
            worst = max(worst, (err, name))
        model.set_submodule(name, fp8)
        done += 1
    if done:
        log.info("fp8 weights: %d target modules quantized per output channel (%.1f MiB -> %.1f MiB); largest "
                 "relative weight error %.4f (%s)", done, before / 2**20, after / 2**20, *worst)
    return done


def build_target(cfg: TargetConfig) -> Lfm2ForCausalLM:
    """The target module for a config (dense or MoE), with uninitialised weights."""
    return Lfm2MoeForCausalLM(cfg) if cfg.is_moe else Lfm2ForCausalLM(cfg)
