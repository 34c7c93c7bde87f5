"""FP8 targets end to end (``Engine(quantization="fp8")``): speculation stays lossless relative to the
quantized target (greedy speculative output == greedy target-only output of the same fp8 target,
fp32 activations on CPU), the draft stays in the model dtype, checkpoints and presets are
quantized at load, and an fp8 tiny preset's logits stay close to its bf16 logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lfmspark.models.cache import TargetCache
from lfmspark.models.layers import Fp8Linear
from lfmspark.models.lfm2_moe import Fp8MoeExperts, quantize_target, target_projections
from lfmspark.models.presets import random_target, target_preset
from lfmspark.runtime import Engine, SamplingParams
from engine_fixtures import save_tiny_draft, save_tiny_target
from spec_fixtures import bigram_target, oracle_draft, permutation, random_tiny_draft, random_tiny_target

PROMPTS = [[3, 9, 27], [5], [11, 12], list(range(1, 40)), [60, 2, 2, 2, 7, 8, 1]]


def run(target, draft, prompts, max_new=20, **options):
    engine = Engine(target, draft, max_batch=4, max_seq_len=128, quantization="fp8", **options)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
    assert engine.scheduler.pool.in_use == 0 and engine.idle
    return outs


def all_fp8(target) -> bool:
    return all(isinstance(m, (Fp8Linear, Fp8MoeExperts)) for m in target_projections(target).values())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("draft_kind", ["oracle", "random"])
def test_greedy_speculation_equals_target_only_with_an_fp8_target(moe, draft_kind):
    seed = 7 + len(draft_kind)
    if draft_kind == "oracle":      # a leaky bigram target and a draft that knows its permutation
        perm = permutation(seed)
        target, draft = bigram_target(perm, leak=0.05, moe=moe, seed=seed), oracle_draft(perm)
    else:
        target, draft = random_tiny_target(moe=moe, seed=seed), random_tiny_draft(seed=seed + 1)
    reference = run(target, None, PROMPTS[:3])
    assert all_fp8(target)                                   # the engine quantized it in place
    spec = run(target, draft, PROMPTS[:3])
    for ref, out in zip(reference, spec):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason == "length"
    assert all(p.dtype == torch.float32 for p in draft.parameters())   # the draft keeps the model dtype
    if draft_kind == "oracle":
        assert sum(o.stats.tau for o in spec) / len(spec) > 1.5       # drafts still accepted


def test_exact_mode_with_an_fp8_target():
    """Exact mode's products of the dequantized fp8 weights (models/layers.py ``fp8_linear``)."""
    target, draft = random_tiny_target(seed=3), random_tiny_draft(seed=4)
    reference = run(target, None, PROMPTS[:2], max_new=10, exact=True)
    spec = run(target, draft, PROMPTS[:2], max_new=10, exact=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]


def test_a_checkpoint_quantized_at_load_serves_losslessly(tmp_path):
    target_dir = save_tiny_target(tmp_path / "target", seed=3)
    draft_dir = save_tiny_draft(tmp_path / "draft", seed=4)
    kw = dict(dtype=torch.float32, device="cpu", max_batch=2, max_seq_len=96, quantization="fp8")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    only = Engine.from_pretrained(target_dir, **kw)
    spec = Engine.from_pretrained(target_dir, draft_dir, **kw)
    assert all_fp8(only.target) and all_fp8(spec.target) and spec.config.quantization == "fp8"
    prompts = [[1, 9, 12, 30], [1, 44]]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in only.generate(prompts, params)]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_presets_quantized_at_load(preset):
    engine = Engine.from_preset(preset, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64,
                                quantization="fp8")
    assert all_fp8(engine.target) and engine.target.lm_head.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in engine.draft.parameters())
    out = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fp8_logits_stay_close_to_the_model_dtype(preset, dtype):
    """Quality on the tiny presets (random weights): the logits of 2 x 24 tokens within 8% of the
    model dtype's (relative Frobenius error; about 4% measured), a mean KL divergence under 1e-3
    (about 2e-5) and the same greedy token at 95% of the positions (all of them measured)."""
    cfg = target_preset(preset)
    full = random_target(cfg, dtype, "cpu", seed=0)
    fp8 = copy.deepcopy(full)
    quantize_target(fp8)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    for model in (full, fp8):
        cache = TargetCache.allocate(cfg, 2, 64, 1, dtype, "cpu")
        with torch.no_grad():
            logits.append(model(ids, cache, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long)).logits.float())
    a, b = logits
    kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
    assert ((a - b).norm() / a.norm()).item() < 0.08 and kl < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.95
