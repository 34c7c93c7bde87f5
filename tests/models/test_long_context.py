"""A target with the context length of LFM2.5-8B-A1B (128K positions, RoPE theta 5e6) loads with
that context and serves a prompt longer than 4,096 tokens, against transformers on the same weights."""

from __future__ import annotations

import random

import torch

from lfmspark.runtime import Engine, SamplingParams
from lfm_testing import TINY_MOE, hf_logits, make_checkpoint


def test_a_128k_context_target_serves_a_5000_token_prompt_as_transformers_does(tmp_path):
    config = dict(TINY_MOE, max_position_embeddings=131_072,
                  rope_parameters={"rope_theta": 5_000_000.0, "rope_type": "default"})
    ckpt = make_checkpoint(tmp_path, "long", config, seed=2)
    engine = Engine.from_pretrained(ckpt.path, dtype=torch.float32, device="cpu", max_batch=1)
    assert engine.max_seq_len == 131_072                     # the checkpoint's context length
    rng = random.Random(0)
    prompt = [rng.randrange(8, 128) for _ in range(5000)]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=0))[0]
    logits = hf_logits(ckpt.model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
    assert out.token_ids == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), want, rtol=0, atol=2e-3)
