"""DSpark draft (DeepSpec layout, as published for LFM2.5 by LiquidAI; reference/dspark.md).

A few Qwen3-style GQA decoder layers whose keys/values are augmented with projected target hidden
states ("KV injection"), a query block ``[x0, MASK x (gamma-1)]`` attended non-causally over
context + block, the target's final LM head, a Markov head that makes the block
semi-autoregressive, and an optional confidence head. Slot ``k`` of a block (position ``s + k``)
predicts the token at position ``s + k + 1``. The embedding and LM head are borrowed from the
target (LFM2 drafts ship neither).

State: the draft KV cache holds **context** entries only (positions ``< s``), written from the
target's aux hidden states by :meth:`DSparkDraft.inject_context` (``fc`` → ``hidden_norm`` → every
layer's ``k_proj``/``v_proj`` → ``kv_norm_rope_write``). The block's own K/V are scratch written at
positions ``s .. s+gamma-1`` and overwritten when the round commits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.argmax_rows import argmax_last
from ..ops.attention.rope import apply_rope, gather_cos_sin, window_positions
from ..ops.routing import window_attention
from .cache import DraftCache, LayerCache
from .config import ConfigError, DraftConfig, TargetConfig
from .layers import (Linear, NormedCarry, Pending, RMSNorm, SwiGLU, completed, linear, linear_pair, norm_linear,
                     project_norm_feed_forward)

log = logging.getLogger("lfmspark")
lfm = torch.ops.lfmspark

def check_draft_fits_target(cfg: DraftConfig, target: TargetConfig) -> None:
    """Raise :class:`ConfigError` when the draft cannot serve this target."""
    if cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"draft hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}: the draft "
                          "embeds with the target's embedding and projects with its LM head, so they must match")
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}: the draft "
                          "was trained for another target (e.g. a 128000-token LFM2.5 vocabulary)")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ConfigError(f"draft mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
                          f"[0, {target.vocab_size})")
    last = target.num_hidden_layers - 1
    bad = [i for i in cfg.target_layer_ids if not -1 <= i < last]
    if bad:
        raise ConfigError(f"draft target_layer_ids {list(cfg.target_layer_ids)} include {bad}: ids must be in "
                          f"[-1, {last - 1}] for this {target.num_hidden_layers}-layer target (the last layer is "
                          "excluded: drafts are trained on raw layer outputs, not the final-normed state)")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_hidden_layers:
        raise ConfigError(f"draft num_target_layers {cfg.num_target_layers} != target num_hidden_layers "
                          f"{target.num_hidden_layers}: the draft was trained for another target")
    if cfg.target_hidden_size is not None and cfg.target_hidden_size != target.hidden_size:
        raise ConfigError(f"draft target_hidden_size {cfg.target_hidden_size} != target hidden_size "
                          f"{target.hidden_size}")
    if cfg.rope_theta != target.rope_theta:
        log.warning("draft rope_theta %g differs from the target's %g; using the draft's own value",
                    cfg.rope_theta, target.rope_theta)
    if cfg.rope_is_neox_style:
        log.warning("draft uses neox RoPE pairing; LiquidAI's LFM2 DSpark drafts are interleaved "
                    "(rope_is_neox_style=false). If acceptance collapses (~1.9 instead of ~5), check this field.")


class DraftAttention(nn.Module):
    """Query side of a draft layer; K/V projections and k_norm weights live stacked on the draft."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.eps, self.is_neox = cfg.rms_norm_eps, cfg.rope_is_neox_style
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, delta: Pending, kv_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, rope: torch.Tensor,
                slots: torch.Tensor,
                start: torch.Tensor, lens: torch.Tensor, next_norm: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Pending]:
        """One layer over the block ``x [B, G, H]`` plus the previous layer's pending MLP output
        ``delta`` (None for the first layer): the residual carry of models/lfm2.py, so the compiled
        layer fuses the add into ``input_layernorm``. Returns ``(x, delta)``, the residual stream
        after attention and this layer's pending MLP output (the layer's output is their sum).
        This layer's stacked K/V projection, k_norm weight and cache come in as one-layer slices
        (addressed as layer 0 by the ops), so one compiled graph serves every layer but the first;
        ``lens`` (all ``G`` columns, :meth:`DSparkDraft.block_begin`) is the block's.

        On the skinny route (2-16 rows: the batch-1 round's block) q and the block's K/V come from one
        ``lfmspark::skinny_linear_pair`` launch over ``q_proj`` and this layer's ``kv_proj`` slice, and
        one ``lfmspark::qkv_norm_rope_write`` (as the target's attention) normalises and rotates q and
        k and writes K/V: two launches where the unfused path below takes six (two products,
        Inductor's three q norm + RoPE kernels, the K/V write); where the window fits one attention
        tile (ops/routing.py ``window_attention``: the served blocks do) ``lfmspark::qkv_window_attention``
        does that inside the attention's launch. The numbers are the unfused path's:
        the op computes the ``q_norm`` module's RMSNorm and ``apply_rope`` in fp32 on the same table
        rows (``start + t``) with the same roundings; only the products' fp32 summation order may
        differ (the pair's split-K is chosen for its total width), by an ulp in bf16.

        The unfused path gathers the block's RoPE cos/sin itself (``rope`` rows ``start + t``, which
        Inductor folds into the rotation's kernel): computed once per block and handed to every
        layer, they would be a kernel of the draft's head region whose output crosses region boundaries,
        which Inductor keeps even where, on the fused path, no layer reads it.

        ``delta`` may be a ``NormedCarry`` of ``input_layernorm`` (``x`` is then the previous
        layer's output), which the pair product finishes; with ``next_norm`` (the next layer's
        ``input_layernorm`` weight, or the final norm's) this layer may hand one on
        (models/layers.py ``project_norm_feed_forward``)."""
        attn = self.self_attn
        B, G, _ = x.shape
        x = completed(x, delta)
        qkv = None
        if isinstance(delta, NormedCarry):
            qkv = linear_pair(x, attn.q_proj.weight, kv_weight, delta, self.input_layernorm.eps)
        if qkv is None:
            h = self.input_layernorm(x)
            qkv = linear_pair(h, attn.q_proj.weight, kv_weight)
        scale = attn.head_dim ** -0.5
        # one eps serves q and k: q_norm's is the config's rms_norm_eps, as self.eps
        if qkv is not None and window_attention(G, attn.n_heads, k_cache.shape[-2]):
            o = lfm.qkv_window_attention(qkv, attn.q_norm.weight, k_norm_weight[0], rope, k_cache, v_cache, page_table, 0,
                                         slots, start, lens, self.eps, self.is_neox, False, scale)
        else:
            if qkv is not None:
                q = lfm.qkv_norm_rope_write(qkv, attn.q_norm.weight, k_norm_weight[0], rope, k_cache, v_cache,
                                            page_table, 0, slots, start, lens, self.eps, self.is_neox)
            else:
                q = attn.q_norm(attn.q_proj(h).view(B, G, attn.n_heads, attn.head_dim))
                cos, sin = gather_cos_sin(rope, window_positions(start, G))
                q = apply_rope(q.float(), cos[:, :, None, :], sin[:, :, None, :], self.is_neox).to(x.dtype)
                lfm.kv_norm_rope_write(linear(h, kv_weight), k_norm_weight, rope, k_cache, v_cache, page_table, 0, slots,
                                       start,
                                       lens, self.eps, self.is_neox)
            o = lfm.cache_attention(q, k_cache, v_cache, page_table, 0, slots, start, False, scale)
        return project_norm_feed_forward(x, o.reshape(B, G, -1), attn.o_proj, self.post_attention_layernorm, self.mlp,
                                         decode=False, next_norm=next_norm)


class MarkovHead(nn.Module):
    """Low-rank first-order logit bias ``B_k`` from the previous token (reference/dspark.md §3)."""

    def __init__(self, cfg: DraftConfig, vocab: int):
        super().__init__()
        r, H = cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(vocab, r)
        self.markov_w2 = Linear(r, vocab)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r, bias=True)

    def step(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias ``[B, V]`` for one slot from ``e = W1[prev] [B, r]``, ``h [B, H]`` and the RNN state."""
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return self.markov_w2(g * e), state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        new_state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), new_state     # the bias uses s_{k-1}, not s_k


class ConfidenceHead(nn.Module):
    """``c_k = sigmoid(proj([h_k ; W1[x_{k-1}]]) / T_k)`` (reference/dspark.md §4.1, §4.4): the chance that
    draft ``k`` survives verification given that drafts ``1..k-1`` did. It reads ``x_{k-1}``, never
    ``x_k``, which is what lets a scheduler use it without looking at the token it admits."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        width = cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(width, 1, bias=True)
        # STS temperatures per block slot (DraftConfig.sts_temperatures; None: uncalibrated). Plain floats,
        # not a buffer: the checkpoint does not hold them, and a module built on the meta device keeps
        # its buffers there
        self.temperatures = cfg.sts_temperatures

    def forward(self, h: torch.Tensor, e_prev: torch.Tensor | None) -> torch.Tensor:
        """``h [B, G, H]`` (the block's normed states) and ``e_prev [B, G, r]`` (``W1`` of each slot's
        previous token) -> fp32 ``[B, G]``."""
        features = torch.cat([h, e_prev], dim=-1) if self.with_markov else h
        logit = self.proj(features).float().squeeze(-1)
        if self.temperatures is not None:
            # the block's first slots (a narrower round's): sliced as a tensor, which a symbolic slot
            # count under torch.compile can slice (a Python list cannot)
            logit = logit / logit.new_tensor(self.temperatures)[:h.shape[1]]
        return torch.sigmoid(logit)


@dataclass
class DraftProposal:
    # G: the slots walked, the whole block (gamma) or its first slots (DSparkDraft.block_prefix)
    tokens: torch.Tensor            # [B, G] int64: x_1 .. x_G
    logits: torch.Tensor | None      # [B, G, V] fp32 Markov-corrected logits (q = softmax(logits / T)),
                                     # or None where the fused walk was not asked for them
    confidence: torch.Tensor | None  # [B, G] conditional acceptance estimates c_k (None: no confidence head)


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, target_hidden: int):
        super().__init__()
        self.config = cfg
        H, L = cfg.hidden_size, cfg.num_hidden_layers
        self.kv_width = cfg.num_key_value_heads * cfg.head_dim
        self.fc = Linear(cfg.n_taps * target_hidden, H)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(L))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        # every layer's [k_proj; v_proj] stacked, so context injection for all layers is one GEMM
        # (layer i's block K/V use the slice kv_proj[i]); k_norm weights stacked for the fused kernel
        self.kv_proj = nn.Parameter(torch.empty(L, 2 * self.kv_width, H))
        self.k_norm = nn.Parameter(torch.ones(L, cfg.head_dim))
        self.markov_head = MarkovHead(cfg, cfg.vocab_size) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.enable_confidence_head else None
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None

    def attach_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Borrow the target's embedding and LM head (kept out of this module's parameters)."""
        self._shared = (embed_tokens, lm_head)

    @property
    def embed_tokens(self) -> nn.Embedding:
        assert self._shared is not None, "call attach_target() first"
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        assert self._shared is not None, "call attach_target() first"
        return self._shared[1]

    # -- context ----------------------------------------------------------------------------
    def inject_context(self, aux: torch.Tensor, cache: DraftCache, slots: torch.Tensor, start: torch.Tensor,
                       lens: torch.Tensor, side_stream: bool = False) -> None:
        """Write context K/V for the first ``lens[b]`` columns of ``aux [B, T, n_taps*H_t]`` at
        positions ``start[b] + t`` in every draft layer. ``side_stream``: the call runs beside the
        main stream (the speculative round's, runtime/steps.py), which its products must know
        (models/layers.py ``linear``)."""
        ctx = self.hidden_norm(linear(aux, self.fc.weight, side_stream))
        kv = linear(ctx, self.kv_proj.flatten(0, 1), side_stream)
        lfm.kv_norm_rope_write(kv, self.k_norm, cache.rope, cache.k, cache.v, cache.page_table, 0, slots, start, lens,
                               self.config.rms_norm_eps, self.config.rope_is_neox_style)

    # -- block ------------------------------------------------------------------------------
    def block_hidden(self, anchor: torch.Tensor, cache: DraftCache, slots: torch.Tensor, start: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last-layer output ``[B, gamma, H]`` (before the final norm) of the block
        ``[anchor, MASK, ...]`` at positions ``start .. start + gamma - 1``, as the pair ``(x, delta)``
        whose sum it is: :meth:`head_and_walk` adds them, fused with the final norm under compile.
        :meth:`block_begin`, then :meth:`run_layers` over every layer (the runtime calls them
        separately, with the first layer compiled together with the glue: runtime/steps.py)."""
        x, lens = self.block_begin(anchor, start)
        return self.run_layers(x, None, cache.layer_caches(), cache.rope, slots, start, lens, self.layers)

    def block_begin(self, anchor: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input up to its first layer: the embeddings ``[B, gamma, H]`` of
        ``[anchor, MASK, ...]`` and the columns each layer writes to its cache (``lens [B]``, all
        ``gamma``: made once here, not by a kernel per layer). The layers read their RoPE rows at
        ``start + t`` themselves (:meth:`DraftLayer.forward`)."""
        cfg = self.config
        B, G = anchor.shape[0], cfg.block_size
        masks = torch.full((B, G - 1), cfg.mask_token_id, dtype=anchor.dtype, device=anchor.device)
        x = self.embed_tokens(torch.cat([anchor[:, None], masks], dim=1))
        return x, torch.full_like(start, G)

    def run_layers(self, x: torch.Tensor, delta: Pending,
                   layer_caches: Sequence[LayerCache], rope: torch.Tensor,
                   slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, layers: Sequence[nn.Module],
                   first: int = 0) -> tuple[torch.Tensor, Pending]:
        """Layers ``first, first + 1, ..`` over the block ``x`` plus the pending ``delta`` (None before
        the first layer), each with its K/V slices and page table (``DraftCache.layer_caches``) and the weight of the norm
        after it, which the layer may start in its epilogue (models/layers.py ``NormedCarry``).
        ``layers`` are those of ``self.layers``, or stand-ins for them: the runtime passes compiled
        wrappers (graphs/compile.py)."""
        for i, (layer, (k_cache, v_cache, page_table)) in enumerate(zip(layers, layer_caches, strict=True),
                                                                    start=first):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, delta = layer(x, delta, self.kv_proj[i], self.k_norm[i:i + 1], k_cache, v_cache, page_table, rope,
                             slots, start, lens, next_norm.weight)
        return x, delta

    def propose(self, anchor: torch.Tensor, cache: DraftCache, slots: torch.Tensor, start: torch.Tensor,
                noise: torch.Tensor | None = None, logits: bool = False) -> DraftProposal:
        """Draft one block: the layers, final norm and LM head, then the Markov walk left to right
        (:meth:`walk`: ``noise`` and ``logits`` as there)."""
        x, delta = self.block_hidden(anchor, cache, slots, start)
        return self.head_and_walk(x, delta, anchor, noise, logits=logits)

    @staticmethod
    def block_prefix(x: torch.Tensor, delta: Pending, g: int) -> tuple[torch.Tensor, Pending]:
        """The first ``g`` slots of the block's last-layer output ``x [B, G, H]`` plus its pending part
        (see :meth:`block_hidden`), for a round that verifies only ``g`` drafts: the final norm, the
        LM head, the walk and the confidences then run over those slots alone. The layers ran the
        whole block (its attention is bidirectional), so these states are the whole block's.

        A ``NormedCarry``'s rows are the block's flattened ``b * G + k``: its scaled rows and its
        per-tile sums of squares are gathered per block row (contiguous, as the row-scaled
        products read them), each row's sums unchanged, so the LM head computes the rows' norms as
        it would over the whole block."""
        B, G, H = x.shape
        if g == G:
            return x, delta
        if isinstance(delta, NormedCarry):
            tiles = delta.ssq.shape[0]
            delta = NormedCarry(delta.scaled.view(B, G, H)[:, :g].reshape(B * g, H),
                                delta.ssq.view(tiles, B, G)[:, :, :g].reshape(tiles, B * g).contiguous())
        elif isinstance(delta, torch.Tensor):
            delta = delta[:, :g]
        return x[:, :g], delta

    def head_and_walk(self, x: torch.Tensor, delta: Pending, anchor: torch.Tensor, noise: torch.Tensor | None = None,
                      walk: str = "jacobi", count_passes: bool = False, confidence: bool = True,
                      logits: bool = False) -> DraftProposal:
        """Final norm and LM head over the block's last-layer output ``x + delta`` (see
        :meth:`block_hidden`; or its first slots, :meth:`block_prefix`), then the Markov walk
        (``noise``, ``walk``, ``count_passes``, ``logits``: :meth:`walk`), then the confidences of
        the drafted tokens (:meth:`confidences`; with ``confidence`` and a head).
        With a ``NormedCarry`` of the final norm, the fused walk (which reads the logits only)
        takes the LM head's product of the carry; the general walk runs the norm on ``x``, as it
        also reads the normed states."""
        want_confidence = confidence and self.confidence_head is not None
        if isinstance(delta, NormedCarry) and self.fused_walk:
            proposal = self.walk(norm_linear(x, delta, self.norm, self.lm_head)[1], None, anchor, noise, walk,
                                 count_passes, logits)
            h = self.norm(completed(x, delta)) if want_confidence else None
        else:
            h = self.norm(completed(x, delta))
            proposal = self.walk(self.lm_head(h), h, anchor, noise, walk, count_passes, logits)
        if want_confidence:
            proposal.confidence = self.confidences(h, anchor, proposal.tokens)
        return proposal

    def confidences(self, h: torch.Tensor, anchor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The confidence head over the whole block at once: ``h [B, G, H]`` the normed states, the
        anchor ``[B]`` and the drafted ``tokens [B, G]`` (slot ``k``'s previous token is ``x_{k-1}``, the
        anchor for slot 0) -> fp32 ``[B, G]``."""
        e_prev = None
        if self.confidence_head.with_markov:
            prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
            e_prev = self.markov_head.markov_w1(prev)
        return self.confidence_head(h, e_prev)

    @property
    def fused_walk(self) -> bool:
        """Whether :meth:`walk` runs fused (``lfmspark::markov_greedy_walk``; the normed states unread):
        a vanilla Markov head, or none."""
        return self.markov_head is None or self.markov_head.kind == "vanilla"

    def walk(self, base: torch.Tensor, h: torch.Tensor | None, anchor: torch.Tensor, noise: torch.Tensor | None = None,
             walk: str = "jacobi", count_passes: bool = False, logits: bool = False) -> DraftProposal:
        """The Markov walk over the LM-head logits ``base [B, G, V]`` (any float dtype; the corrected
        logits are fp32, and the fused ops read ``base`` as it is, so no fp32 copy is made): slot
        ``k``'s token is the argmax of its corrected logits plus ``noise[:, k]`` (fp32 ``[B, G, V]``;
        None: the plain argmax), and the correction of slot ``k + 1`` follows that token. Noise
        ``T * g`` with ``g`` Gumbel draws makes the walk sample each slot from ``softmax(logits / T)``
        (the Gumbel-max trick; runtime/randomness.py ``gumbel``), so one walk serves greedy and
        sampled rounds.

        With a vanilla Markov head, or none, the walk is fused: ``lfmspark::markov_greedy_walk`` over
        ``base + noise`` (one launch at batch 1 on the kernel family ``walk`` names, ops/routing.py
        ``WALKS``; ``count_passes``: the Jacobi kernel tallies its passes for the benchmark), and the
        corrected logits are computed afterwards, in one product over the block's drawn tokens, only
        with ``logits``. Gated and RNN heads walk slot by slot (``h``, the normed states ``[B, G, H]``,
        is read there only) and always return their logits. ``confidence`` is left None here:
        :meth:`head_and_walk` adds it."""
        head = self.markov_head
        B, G, _ = base.shape
        noisy = base if noise is None else base.float() + noise
        if head is None:
            return DraftProposal(tokens=argmax_last(noisy), logits=base.float() if logits else None, confidence=None)
        if head.kind == "vanilla":
            tokens = lfm.markov_greedy_walk(noisy, anchor, head.markov_w1.weight, head.markov_w2.weight,
                                            walk, count_passes)
            corrected = None
            if logits:   # the biases the walk added: each slot's from the token before it
                prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
                corrected = base.float() + head.markov_w2(head.markov_w1(prev)).float()
            return DraftProposal(tokens=tokens, logits=corrected, confidence=None)
        prev = anchor
        state = h.new_zeros(B, head.rank) if head.kind == "rnn" else None
        tokens, corrected = [], []
        for k in range(G):
            bias, state = head.step(head.markov_w1(prev), h[:, k], state)
            logits_k = base[:, k].float() + bias.float()
            prev = (logits_k if noise is None else logits_k + noise[:, k]).argmax(dim=-1)
            tokens.append(prev)
            corrected.append(logits_k)
        return DraftProposal(tokens=torch.stack(tokens, dim=1), logits=torch.stack(corrected, dim=1), confidence=None)
