"""Logprobs of the emitted tokens and of the prompt against a plain transformers forward of
the same tokens (fp32 on CPU), target-only and speculative. With imposed acceptance 1.0 every draft
is accepted, so most emitted tokens are the draft's: their logprobs must still be the target's."""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime import Engine, RequestError, SamplingParams
from engine_fixtures import save_tiny_draft, save_tiny_target

PROMPT = [1, 17, 42, 9, 33, 28, 11]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return save_tiny_target(root / "target", seed=0), save_tiny_draft(root / "draft")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt[0]), dtype=torch.float32).eval()


def engine(ckpt, speculative: bool, **kw) -> Engine:
    return Engine.from_pretrained(ckpt[0], ckpt[1] if speculative else None, dtype=torch.float32, device="cpu",
                                  max_batch=4, max_seq_len=96, chat=False, **kw)


@torch.no_grad()
def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: row i the log-softmax of the logits after ``tokens[:i + 1]``."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_against(expected: torch.Tensor, records, tokens: list[int], n_top: int) -> None:
    """Each record: the token, its logprob and rank, and the top-``n_top`` under ``expected [n, V]``."""
    assert [r.token_id for r in records] == tokens
    for row, rec in zip(expected, records):
        assert rec.logprob == pytest.approx(row[rec.token_id].item(), abs=1e-4)
        assert rec.rank == int((row > row[rec.token_id] + 1e-6).sum()) + 1
        values, ids = row.topk(n_top)
        assert [i for i, _ in rec.top] == ids.tolist()
        assert [v for _, v in rec.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("speculative", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_output_logprobs_are_the_targets_log_softmax(ckpt, hf, speculative, temperature):
    kw = dict(imposed_acceptance=[1.0] * 4) if speculative else {}
    e = engine(ckpt, speculative, **kw)
    p = SamplingParams(max_new_tokens=13, temperature=temperature, seed=7, logprobs=5, ignore_eos=True)
    out = e.generate([PROMPT], p)[0]
    assert len(out.logprobs) == len(out.token_ids) == 13
    expected = hf_logprobs(hf, PROMPT + out.token_ids[:-1])[len(PROMPT) - 1:]
    check_against(expected, out.logprobs, out.token_ids, 5)
    assert out.cumulative_logprob == pytest.approx(sum(r.logprob for r in out.logprobs))
    if speculative:          # the imposed 1.0 accepts every draft: most tokens were proposed by the draft
        assert out.stats.tau > 3


def test_prompt_logprobs_across_prefill_chunks(ckpt, hf):
    """A prompt in three chunks (prefill_chunk 3): every token after the first gets its logprob, the
    chunk boundaries included; the first has None."""
    prompt = PROMPT + [5, 60, 61]
    e = engine(ckpt, True, prefill_chunk=3)
    out = e.generate([prompt], SamplingParams(max_new_tokens=4, prompt_logprobs=3, logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    expected = hf_logprobs(hf, prompt)[:-1]
    check_against(expected, out.prompt_logprobs[1:], prompt[1:], 3)
    assert all(r.top == [] for r in out.logprobs)          # logprobs=0: the token's own, no alternatives
    solo = engine(ckpt, True).generate([prompt], SamplingParams(max_new_tokens=4))[0]
    assert out.token_ids == solo.token_ids and solo.prompt_logprobs is None and solo.logprobs is None


def test_processed_logprobs_are_of_the_distribution_sampled_from(ckpt, hf):
    """logprobs_mode="processed": temperature, top-k and the repetition penalty (over the prompt and
    the earlier outputs) applied to the HF logits; filtered tokens are left out of the top list."""
    e = engine(ckpt, True, logprobs_mode="processed", imposed_acceptance=[1.0] * 4)
    p = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=4, repetition_penalty=1.6, seed=3, logprobs=6,
                       ignore_eos=True)
    out = e.generate([PROMPT], p)[0]
    raw = hf(torch.tensor([PROMPT + out.token_ids[:-1]])).logits[0].float().detach()[len(PROMPT) - 1:]
    for i, rec in enumerate(out.logprobs):
        seen = torch.zeros(raw.shape[-1], dtype=torch.bool)
        seen[PROMPT + out.token_ids[:i]] = True
        x = raw[i].clone()
        x = torch.where(seen, torch.where(x > 0, x / 1.6, x * 1.6), x) / 0.7
        kth = x.topk(4).values[-1]
        expected = torch.log_softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
        assert rec.logprob == pytest.approx(expected[rec.token_id].item(), abs=1e-4)
        assert len(rec.top) == 4                               # 6 asked, 4 survive top-k
        assert [t for t, _ in rec.top] == expected.topk(4).indices.tolist()


def test_streamed_logprobs_add_up_to_the_output_and_stop_where_the_tokens_do(ckpt):
    """A stop inside an accepted block: the events' logprobs concatenate to the output's, one per kept
    token; a request without logprobs beside it is unchanged."""
    e = engine(ckpt, True, imposed_acceptance=[1.0] * 4)
    with_lp = SamplingParams(max_new_tokens=6, logprobs=2, ignore_eos=True)      # 6 = first + 1 block + 1
    plain = SamplingParams(max_new_tokens=6, ignore_eos=True)
    events = list(e.stream([PROMPT, PROMPT[:4]], [with_lp, plain]))
    streamed = [r for ev in events if ev.index == 0 for r in (ev.logprobs or [])]
    final = next(ev.output for ev in events if ev.index == 0 and ev.finished)
    assert [r.token_id for r in streamed] == final.token_ids and len(final.token_ids) == 6
    assert streamed == final.logprobs
    assert all(ev.logprobs is None for ev in events if ev.index == 1)
    alone = engine(ckpt, True, imposed_acceptance=[1.0] * 4).generate([PROMPT[:4]], plain)[0]
    assert next(ev.output for ev in events if ev.index == 1 and ev.finished).token_ids == alone.token_ids


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", -1), ("logprobs", True),
                                         ("prompt_logprobs", 2.5), ("prompt_logprobs", 99)])
def test_bad_logprob_counts_are_refused(ckpt, field, value):
    with pytest.raises(RequestError, match=field):
        engine(ckpt, False).generate([PROMPT], SamplingParams(**{field: value}))


def test_an_unknown_logprobs_mode_is_refused(ckpt):
    with pytest.raises(ValueError, match="logprobs_mode"):
        engine(ckpt, False, logprobs_mode="normalized")
