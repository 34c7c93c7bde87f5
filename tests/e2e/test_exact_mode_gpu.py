"""Exact mode on the GPU (skipped on CPU): bf16, CUDA graphs, the presets' shapes.

Greedy speculative output equals greedy target-only output token for token, for drafts accepted
rarely (the presets' random-weight drafts) and often (a bigram target with the draft that guesses
its bigrams, at production head size); and a prompt's output is the same alone and inside batches
of 8 and 32. ``LFMSPARK_EXACT_PROMPTS`` (default 200) prompts of ``LFMSPARK_EXACT_TOKENS`` (256)
tokens for the presets. ``lfmspark bench exact`` reports the same identity rates for the default mode,
for contrast, and what exact mode costs.
"""

from __future__ import annotations

import os

import pytest
import torch

from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.distributions import SamplingMode
from spec_fixtures import bigram_target, oracle_draft, permutation

pytestmark = pytest.mark.gpu

N_PROMPTS = int(os.environ.get("LFMSPARK_EXACT_PROMPTS", "200"))
N_TOKENS = int(os.environ.get("LFMSPARK_EXACT_TOKENS", "256"))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab // 10, vocab, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tokens(engine: Engine, batch: list[list[int]], n: int) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(batch, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def in_batches(engine: Engine, all_prompts: list[list[int]], size: int, n: int) -> list[list[int]]:
    out = []
    for i in range(0, len(all_prompts), size):
        out += tokens(engine, all_prompts[i:i + size], n)
    return out


@pytest.mark.parametrize("preset", ["lfm2.5-1.2b", "lfm2-8b-a1b"])
def test_exact_speculation_equals_target_only_on_the_presets(preset: str):
    kw = dict(max_batch=32, max_seq_len=N_TOKENS + 128, batch_sizes=[1, 8, 32], exact=True)
    gamma = draft_preset(DEFAULT_DRAFT[preset]).block_size
    # every round verifies the whole block (the width policy would fall back to width 1 for a draft
    # that is rarely accepted, and the windows are what is tested)
    spec = Engine.from_preset(preset, verify_widths=[gamma + 1], **kw)
    spec.warmup(progress=False, sampling=False)
    batch = prompts(N_PROMPTS, spec.model_config.vocab_size)
    out_spec = in_batches(spec, batch, 32, N_TOKENS)
    alone = [tokens(spec, [p], N_TOKENS)[0] for p in batch[:32]]
    by_eight = in_batches(spec, batch[:32], 8, N_TOKENS)
    del spec
    plain = Engine.from_preset(preset, None, **kw)
    plain.warmup(progress=False, sampling=False)
    out_plain = in_batches(plain, batch, 32, N_TOKENS)
    assert out_spec == out_plain
    assert alone == out_spec[:32] and by_eight == out_spec[:32]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_exact_speculation_with_an_often_accepted_draft(moe: bool):
    perm = permutation(4, vocab=512)
    target = bigram_target(perm, leak=0.2, moe=moe, head_dim=64).to("cuda", torch.bfloat16)
    draft = oracle_draft(perm, head_dim=64).to("cuda", torch.bfloat16)
    batch = prompts(64, 512, seed=1)
    outs = {}
    for name, d in (("spec", draft), ("plain", None)):
        widths = None if d is None else [d.config.block_size + 1]
        engine = Engine(target, d, max_batch=32, max_seq_len=256, batch_sizes=[1, 8, 32], exact=True,
                        verify_widths=widths)
        engine.warmup(progress=False, sampling=False)
        outs[name] = engine.generate(batch, SamplingParams(max_new_tokens=128, ignore_eos=True))
    assert [o.token_ids for o in outs["spec"]] == [o.token_ids for o in outs["plain"]]
    assert sum(o.stats.tau for o in outs["spec"]) / len(batch) > 2      # the draft was accepted often


def test_exact_seeded_sampling_does_not_depend_on_the_batch():
    """Seeded sampling with the model card's kind of settings (temperature, top-k, top-p; per-request
    seeds): each of 32 prompts gets the same tokens and log-probabilities alone, in batches of 8 and
    in one batch of 32, speculative and target-only (the dense preset: the sampled rounds' warm-up
    is the longest of the file, so only the threshold mode is warmed; the MoE layers' exactness is the
    greedy tests')."""
    preset = "lfm2.5-1.2b"
    batch = prompts(32, 1000, seed=2)
    for draft in ("default", None):
        engine = Engine.from_preset(preset, draft, max_batch=32, max_seq_len=256, batch_sizes=[1, 8, 32], exact=True)
        engine.warmup(progress=False, sampling=[SamplingMode.THRESHOLD])   # these requests' mode (top_k <= 128)

        def run(group: list[list[int]], first: int) -> list:
            params = [SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0.3, top_k=50, top_p=0.9,
                                     seed=100 + first + i, logprobs=0) for i in range(len(group))]
            return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in engine.generate(group, params)]

        together = run(batch, 0)
        by_eight = [o for i in range(0, 32, 8) for o in run(batch[i:i + 8], i)]
        alone = [run([p], i)[0] for i, p in enumerate(batch[:8])]
        assert by_eight == together, draft
        assert alone == together[:8], draft
        del engine
