"""The benchmark's prefill FLOP count (runtime/bench.py ``prefill_flops``), against the arithmetic
of the tiny presets written out from their configs: every weight matrix once per token (an MoE
layer's experts at k of E), causal attention, and the LM head once per row."""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime import Engine
from lfmspark.tools.bench import prefill_flops


def tiny(name: str) -> Engine:
    return Engine.from_preset(name, None, device="cpu", dtype=torch.float32, max_batch=1, max_seq_len=64)


@pytest.mark.parametrize("rows, tokens", [(1, 1), (1, 37), (3, 20)])
def test_dense_prefill_flops(rows: int, tokens: int):
    e = tiny("tiny")
    c = e.model_config
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    ffn = 2 * I * H + H * I                                    # w13 (gate and up), w2
    conv = 3 * H * H + H * H + H * 3                           # in_proj (B, C, x), out_proj, the 3-tap filter
    attn = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd * H + H * H
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    per_token = 2 * (n_attn * (attn + ffn) + (c.num_hidden_layers - n_attn) * (conv + ffn))
    scores = n_attn * 4 * c.num_attention_heads * hd * tokens * (tokens + 1) // 2
    assert prefill_flops(e, rows, tokens) == rows * (tokens * per_token + scores + 2 * c.vocab_size * H)


def test_moe_prefill_flops_count_the_routed_experts_only():
    e = tiny("tiny-moe")
    c = e.model_config
    H, hd, k, E, Im = c.hidden_size, c.head_dim, c.num_experts_per_tok, c.num_experts, c.moe_intermediate_size
    dense_ffn = 3 * c.intermediate_size * H
    moe_ffn = E * H + k * 3 * Im * H                           # the router, and k experts' gate, up and down
    conv = 3 * H * H + H * H + H * 3
    attn = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd * H + H * H
    mixers = [attn if t == "full_attention" else conv for t in c.layer_types]
    ffns = [dense_ffn if i < c.num_dense_layers else moe_ffn for i in range(c.num_hidden_layers)]
    per_token = 2 * (sum(mixers) + sum(ffns))
    tokens = 10
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    scores = n_attn * 4 * c.num_attention_heads * hd * tokens * (tokens + 1) // 2
    assert prefill_flops(e, 1, tokens) == tokens * per_token + scores + 2 * c.vocab_size * H
