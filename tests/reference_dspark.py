"""A plain, cache-free DSpark draft written from reference/dspark.md (§2-§4): the oracle for
``models/dspark.py``. It shares only the weights with the module under test; every step (context
projection, K/V injection, RMSNorms, RoPE, non-causal attention, Markov walk, confidence head) is
recomputed here from the whole context at once, with no cache and no custom ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, neox: bool) -> torch.Tensor:
    """Rotate ``x [N, heads, D]`` at integer positions ``pos [N]`` (fp32 math)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x = x.float()
    if neox:
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


@torch.no_grad()
def reference_block(draft, features: torch.Tensor, anchor: int, embed: torch.Tensor, lm_head: torch.Tensor,
                    pick=None):
    """Draft one block for a single sequence.

    ``features [s, n_taps * H_t]``: target aux hidden states of the committed positions ``0..s-1``;
    ``anchor``: the token at position ``s``. Returns ``(tokens [gamma], logits [gamma, V] fp32,
    confidence [gamma] or None)``. ``pick(k, logits_k [V]) -> int`` defaults to argmax.
    """
    cfg = draft.config
    eps, G, s = cfg.rms_norm_eps, cfg.block_size, features.shape[0]
    n_h, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kvw = n_kv * hd
    dtype = embed.dtype

    ctx = _rms(F.linear(features, draft.fc.weight), draft.hidden_norm.weight, eps)          # [s, H]
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (G - 1))
    x = embed[ids]                                                                           # [G, H]
    pos_ctx, pos_blk = torch.arange(s), s + torch.arange(G)
    for i, layer in enumerate(draft.layers):
        k_w, v_w = draft.kv_proj[i][:kvw], draft.kv_proj[i][kvw:]
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = _rms(F.linear(h, layer.self_attn.q_proj.weight).view(G, n_h, hd), layer.self_attn.q_norm.weight, eps)
        k = F.linear(torch.cat([ctx, h]), k_w).view(s + G, n_kv, hd)
        v = F.linear(torch.cat([ctx, h]), v_w).view(s + G, n_kv, hd)
        k = _rms(k, draft.k_norm[i], eps)
        q = _rope(q, pos_blk, cfg.rope_theta, cfg.rope_is_neox_style)
        k = _rope(k, torch.cat([pos_ctx, pos_blk]), cfg.rope_theta, cfg.rope_is_neox_style)
        k = k.repeat_interleave(n_h // n_kv, dim=1)
        v = v.float().repeat_interleave(n_h // n_kv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5, dim=-1)         # no mask at all
        o = torch.einsum("hqk,khd->qhd", att, v).to(dtype).reshape(G, n_h * hd)
        x = x + F.linear(o, layer.self_attn.o_proj.weight)
        gate, up = F.linear(_rms(x, layer.post_attention_layernorm.weight, eps), layer.mlp.w13.weight).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.w2.weight)
    h_out = _rms(x, draft.norm.weight, eps)
    base = F.linear(h_out, lm_head).float()                                                 # [G, V]

    head, conf = draft.markov_head, draft.confidence_head
    tokens, logits, confidence = [], [], []
    prev, state = anchor, None
    if head is not None and head.kind == "rnn":
        state = torch.zeros(cfg.markov_rank, dtype=dtype)
    for k in range(G):
        lk = base[k]
        e = None
        if head is not None:
            e = head.markov_w1.weight[prev]
            if head.kind == "vanilla":
                bias = head.markov_w2.weight @ e
            elif head.kind == "gated":
                g = torch.sigmoid(F.linear(torch.cat([h_out[k], e]), head.gate_proj.weight, head.gate_proj.bias))
                bias = head.markov_w2.weight @ (g * e)
            else:
                z = torch.cat([state, e, h_out[k]])
                g_, c_, o_ = F.linear(z, head.joint_proj.weight, head.joint_proj.bias).chunk(3)
                bias = head.markov_w2.weight @ torch.tanh(o_)
                state = torch.sigmoid(g_) * state + (1 - torch.sigmoid(g_)) * torch.tanh(c_)
            lk = lk + bias.float()
        if conf is not None:
            feat = torch.cat([h_out[k], e]) if conf.with_markov else h_out[k]
            confidence.append(torch.sigmoid(F.linear(feat, conf.proj.weight, conf.proj.bias).float())[0])
        prev = int(lk.argmax()) if pick is None else int(pick(k, lk))
        tokens.append(prev)
        logits.append(lk)
    return (torch.tensor(tokens), torch.stack(logits), torch.stack(confidence) if confidence else None)
