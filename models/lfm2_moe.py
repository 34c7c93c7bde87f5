"""LFM2-MoE target: the LFM2 backbone with sparse MoE feed-forwards after ``num_dense_layers``
(HF ``Lfm2MoeForCausalLM``; reference/lfm2.md §4).

Routing: sigmoid of the router logits; the fp32 ``expert_bias`` is added for **selection only**,
the weights are the unbiased sigmoids of the chosen experts, renormalised (``/ (sum + 1e-6)``) and
scaled by ``routed_scaling_factor``. There are no shared experts. The experts run through the
``lfmspark::moe_experts`` op, which reads only the selected experts.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TargetConfig
from .layers import Linear, SwiGLU
from .lfm2 import Lfm2ForCausalLM

lfm = torch.ops.lfmspark


class Lfm2MoeExperts(nn.Module):
    """Stacked expert weights: ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``."""

    def __init__(self, n_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, ffn))


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of each row of ``scores [N, E]``, in descending order, like
    ``torch.topk(...).indices`` for distinct scores; ties go to the lower expert index (torch.topk
    leaves tie order unspecified, so bf16 router scores without an expert bias may pick another of
    two tied experts than HF does). Computed from pairwise ranks,
    which Inductor fuses into one small kernel; ``torch.topk`` costs a sort and a gather kernel
    per layer (~9 us of a ~2 ms LFM2-8B-A1B decode step, 22 times)."""
    E = scores.shape[-1]
    idx = torch.arange(E, device=scores.device)
    s_i, s_j = scores[:, :, None], scores[:, None, :]
    beats = (s_j > s_i) | ((s_j == s_i) & (idx[None, :] < idx[:, None])[None])   # [N, i, j]: j ranks above i
    rank = beats.sum(-1)                                                          # [N, E], a permutation of 0..E-1
    slot = torch.arange(k, device=scores.device)
    return ((rank[:, None, :] == slot[None, :, None]) * idx).sum(-1)              # [N, k]: the expert at each rank


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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [N, k], topk_weights [N, k])`` for tokens ``x [N, H]``."""
        probs = self.gate(x).sigmoid()
        scores = probs + self.expert_bias if self.use_expert_bias else probs   # fp32 scores select
        ids = top_k_ids(scores, self.top_k)
        weights = probs.gather(1, ids)                                          # unbiased weights
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return ids, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.route(x)
        return lfm.moe_experts(x, ids, weights, self.experts.w13, self.experts.w2).view(shape)


def moe_feed_forward(cfg: TargetConfig, layer: int) -> nn.Module:
    if cfg.is_moe_layer(layer):
        return Lfm2MoeBlock(cfg)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def __init__(self, cfg: TargetConfig):
        super().__init__(cfg, make_feed_forward=moe_feed_forward)


def build_target(cfg: TargetConfig) -> Lfm2ForCausalLM:
    """The target module for a config (dense or MoE), with uninitialised weights."""
    return Lfm2MoeForCausalLM(cfg) if cfg.is_moe else Lfm2ForCausalLM(cfg)
