"""The public Engine API: request validation, draft validation, checkpoints on disk, tokenizers and
text, streaming and scheduling, statistics, presets.

Expected values come from independent computations: target-only engines (greedy speculation is
lossless), fresh engines, the tokenizer itself or hand-built token ids, the bigram targets of
``spec_fixtures`` whose greedy continuation is a known permutation.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from engine_fixtures import (BOS, IM_END, IM_START, TOKEN_ID, VOCAB, assert_no_page_leaked, byte_level_text,
                             byte_tokenizer, draft_config_dict, draft_tensors, ids_to_text, save_tiny_draft, save_tiny_target,
                             word_tokenizer, words_to_ids, write_generation_eos)
from lfmspark.models.config import ConfigError, DraftConfig, TargetConfig
from lfmspark.models.loading import load_draft
from lfmspark.runtime import Engine, GenerationOutput, RequestError, SamplingParams
from spec_fixtures import (V, bigram_target, derangement_of, oracle_draft, permutation, random_tiny_draft)

GAMMA = 4                        # block size of the spec_fixtures drafts
F32 = dict(dtype=torch.float32, device="cpu")


def engine(target, draft=None, max_batch=4, max_seq_len=96, **kw) -> Engine:
    return Engine(target, draft, max_batch=max_batch, max_seq_len=max_seq_len, **kw)


def greedy(n, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)


def assert_clean(e: Engine) -> None:
    assert e.scheduler.pool.in_use == 0 and e.scheduler.pool.n_free == e.max_batch
    assert e.idle
    assert_no_page_leaked(e)


def one_by_one(target, prompts, params) -> list[list[int]]:
    """Target-only greedy outputs, each prompt alone in a fresh engine."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [engine(target, None, max_batch=1).generate([p], q)[0].token_ids for p, q in zip(prompts, params)]


# =============================================================================================
# 1. request validation

GOOD_PROMPTS = [[3, 9, 27, 5], [11]]


@pytest.fixture(scope="module")
def good_reference(target):
    """What a fresh engine generates for GOOD_PROMPTS."""
    return [o.token_ids for o in engine(target, random_tiny_draft(seed=4)).generate(GOOD_PROMPTS, greedy(7))]


@pytest.fixture(scope="module")
def shared_engine(target):
    """One engine that sees every bad request (module scope: failures must not leave traces)."""
    return engine(target, random_tiny_draft(seed=4), max_seq_len=64)


def assert_still_serves(e: Engine, good_reference) -> None:
    assert_clean(e)
    assert [o.token_ids for o in e.generate(GOOD_PROMPTS, greedy(7))] == good_reference
    assert_clean(e)


BAD_PROMPTS = {
    "no prompts": ([], "no prompts"),
    "empty token list": ([[]], "empty"),
    "empty token list among good": ([[1, 2], [], [3]], "request 1: the prompt is empty"),
    "negative id": ([1, -1, 2], "[-1] are outside the vocabulary [0, 64)"),
    "id == vocab": ([1, V, 2], "[64] are outside the vocabulary [0, 64)"),
    "id > vocab in 2nd prompt": ([[1, 2], [3, 1000]], "request 1: token ids [1000]"),
    "float id": ([1, 2.0, 3], "must hold integers, got [2.0]"),
    "bool id": ([[True, 2]], "must hold integers, got [True]"),
    "str id": ([[1, "2"]], "must hold integers, got ['2']"),
    "None prompt": ([[1, 2], None], "prompts [1] are None"),
    "text without tokenizer": ("hello there", "needs a tokenizer"),
    "texts without tokenizer": (["hello", "there"], "needs a tokenizer"),
    "chat without template": ([{"role": "user", "content": "hi"}], "chat template"),
    "too long": ([list(range(1, 51))], "= 70 exceeds max_seq_len 64"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_and_leaves_the_engine_clean(case, shared_engine, good_reference):
    prompts, message = BAD_PROMPTS[case]
    with pytest.raises(RequestError) as err:
        shared_engine.generate(prompts, greedy(20))
    assert message in str(err.value)
    assert_still_serves(shared_engine, good_reference)


def test_too_long_message_names_every_term_and_the_limit_is_exact(target, draft):
    """max_seq_len is the context length: prompt + max_new_tokens (the verify window is scratch
    the engine keeps past it, for speculative and target-only engines alike)."""
    for d in (draft, None):
        e = engine(target, d, max_seq_len=64)
        with pytest.raises(RequestError) as err:
            e.generate([list(range(1, 46))], greedy(20))          # 45 + 20 = 65 > 64
        msg = str(err.value)
        assert all(s in msg for s in ("prompt (45 tokens)", "max_new_tokens (20)", "= 65", "max_seq_len 64"))
        assert_clean(e)
        # exactly at the limit: served, all the way to max_new_tokens, and lossless
        prompt = list(range(1, 45))                                # 44 + 20 = 64
        out = e.generate([prompt], greedy(20))[0]
        assert out.finish_reason == "length" and out.token_ids == one_by_one(target, [prompt], greedy(20))[0]
        assert_clean(e)


BAD_PARAMS = {
    "negative temperature": (dict(temperature=-0.5), "temperature"),
    "nan temperature": (dict(temperature=float("nan")), "temperature"),
    "inf temperature": (dict(temperature=float("inf")), "temperature"),
    "str temperature": (dict(temperature="0.7"), "temperature"),
    "tiny temperature": (dict(temperature=1e-7), "too small"),
    "negative top_k": (dict(top_k=-1), "top_k"),
    "float top_k": (dict(top_k=2.5), "top_k"),
    "top_p 0": (dict(top_p=0.0), "top_p"),
    "top_p > 1": (dict(top_p=1.5), "top_p"),
    "nan top_p": (dict(top_p=float("nan")), "top_p"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens"),
    "negative max_new_tokens": (dict(max_new_tokens=-4), "max_new_tokens"),
    "float max_new_tokens": (dict(max_new_tokens=8.0), "max_new_tokens"),
    "stop id == vocab": (dict(stop_token_ids=[3, V]), "stop_token_ids [64]"),
    "negative stop id": (dict(stop_token_ids=[-2]), "stop_token_ids [-2]"),
    "str stop id": (dict(stop_token_ids=["x"]), "stop_token_ids ['x']"),
    "stop ids not a list": (dict(stop_token_ids=7), "stop_token_ids must be a list"),
    "float seed": (dict(seed=1.5), "seed"),
    "str seed": (dict(seed="42"), "seed"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_are_refused(case, shared_engine, good_reference):
    fields, name = BAD_PARAMS[case]
    params = SamplingParams(**{"max_new_tokens": 5, **fields})
    with pytest.raises(RequestError) as err:
        shared_engine.generate(GOOD_PROMPTS, params)
    assert name in str(err.value) and "request 0" in str(err.value)
    # one bad SamplingParams among good ones: refused as a whole, naming the request
    with pytest.raises(RequestError, match="request 1"):
        shared_engine.generate(GOOD_PROMPTS + [[4]], [greedy(5), params, greedy(5)])
    assert_still_serves(shared_engine, good_reference)


def test_params_list_must_match_the_prompts(shared_engine, good_reference):
    with pytest.raises(RequestError, match="3 SamplingParams for 2 prompts"):
        shared_engine.generate(GOOD_PROMPTS, [greedy(3)] * 3)
    with pytest.raises(RequestError, match="1 SamplingParams for 2 prompts"):
        shared_engine.generate(GOOD_PROMPTS, [greedy(3)])
    with pytest.raises(RequestError, match="not SamplingParams"):
        shared_engine.generate(GOOD_PROMPTS, [greedy(3), None])
    # one prompt with a one-element list of params is fine
    assert len(shared_engine.generate([5, 6], [greedy(3)])) == 1
    assert_still_serves(shared_engine, good_reference)


def test_validation_is_lazy_for_stream_but_complete_before_anything_runs(shared_engine, good_reference):
    it = shared_engine.stream([[1, 2], [3, -5]], greedy(4))
    assert_clean(shared_engine)                          # nothing submitted yet
    with pytest.raises(RequestError, match="request 1"):
        next(it)
    assert_still_serves(shared_engine, good_reference)


def test_bad_request_while_another_stream_runs_does_not_disturb_it(target, draft):
    e = engine(target, draft, max_batch=2)
    prompts = [[7, 8, 9], [10], [20, 21]]
    expected = one_by_one(target, prompts, greedy(12))
    it = e.stream(prompts, greedy(12))
    got = {i: [] for i in range(3)}
    first = next(it)
    got[first.index] += first.token_ids
    with pytest.raises(RequestError):
        e.generate([[1, 99]], greedy(4))
    for ev in it:
        got[ev.index] += ev.token_ids
    assert [got[i] for i in range(3)] == expected
    assert_clean(e)


def test_warmup_prefills_scratch_slots_without_changing_what_the_engine_generates(target, good_reference):
    """The prefill warm-up runs dummy prompts on free slots (1 and 2 rows, lengths 16 and 17); the
    requests served afterwards must not see any of it."""
    e = engine(target, random_tiny_draft(seed=4), max_batch=2)
    report = e.warmup(progress=False, sampling=False)
    assert report.prefill_s > 0 and report.as_dict()["prefill_s"] == report.prefill_s
    assert_still_serves(e, good_reference)


def test_warmup_captures_the_prefill_before_the_step_graphs(target, draft, monkeypatch):
    """The order matters on a GPU: prefill bucket graphs captured after the step graphs leave every
    later decode step ~20 us slower, captured before them nothing (graphs/prefill.py)."""
    e = engine(target, draft, max_batch=2)
    calls = []

    def recorded(name: str, warmup):
        def run(*args, **kwargs):
            calls.append(name)
            return warmup(*args, **kwargs)
        return run

    monkeypatch.setattr(e.model_runner.prefill_runner, "warmup", recorded("prefill", e.model_runner.prefill_runner.warmup))
    monkeypatch.setattr(e.model_runner.step_runner, "warmup", recorded("steps", e.model_runner.step_runner.warmup))
    e.warmup(progress=False, sampling=False)
    assert calls == ["prefill", "steps"]


def test_warmup_is_refused_while_requests_are_in_flight(target, draft):
    e = engine(target, draft, max_batch=2)
    it = e.stream([[7, 8, 9]], greedy(6))
    next(it)                                          # admitted and prefilled: its slot is in use
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        e.warmup(progress=False, sampling=False)
    list(it)
    assert_clean(e)


IMPOSED_BAD = {
    "too short": ([1.0] * (GAMMA - 1), f"must give {GAMMA} per-position rates"),
    "too long": ([0.5] * (GAMMA + 1), f"must give {GAMMA} per-position rates"),
    "above 1": ([1.0, 1.2, 0.5, 0.5], "in [0, 1]"),
    "negative": ([0.5, -0.1, 0.5, 0.5], "in [0, 1]"),
    "nan": ([0.5, float("nan"), 0.5, 0.5], "in [0, 1]"),
    "not numbers": (["1", 1, 1, 1], "in [0, 1]"),
}


@pytest.mark.parametrize("case", list(IMPOSED_BAD))
def test_bad_imposed_acceptance_is_refused(case, target, draft):
    rates, message = IMPOSED_BAD[case]
    with pytest.raises(ValueError) as err:
        engine(target, draft, imposed_acceptance=rates)
    assert message in str(err.value)


def test_imposed_acceptance_needs_a_draft(target):
    with pytest.raises(ValueError, match="imposed_acceptance needs a draft"):
        engine(target, None, imposed_acceptance=[1.0] * GAMMA)


def test_engine_construction_limits(target, draft):
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        engine(target, draft, max_batch=0)
    with pytest.raises(ValueError, match="max_seq_len must be None .* or >= 2"):
        engine(target, draft, max_seq_len=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
            engine(target, draft, cuda_graphs=True)


@pytest.mark.parametrize("variable, value", [
    ("LFMSPARK_PDL", "yes"), ("LFMSPARK_TRITON_ON_CPU", "on"), ("LFMSPARK_TUNE", "gemv.block=4"),
])
def test_a_bad_variable_is_refused_when_the_engine_is_built(target, monkeypatch, variable, value):
    """The variables act at launch or trace time (on a CPU some never do): the engine reads them all
    first (lfmspark/environment.py), as a fresh process would."""
    from lfmspark import environment

    monkeypatch.setenv(variable, value)
    environment.environment.cache_clear()
    with pytest.raises(ValueError, match=variable):
        engine(target, None)


def test_an_unknown_variable_draws_a_warning(target, monkeypatch):
    """A removed switch (or a typo) is named, never silently obeyed or silently dropped."""
    import logging

    from lfmspark import environment

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logging.getLogger("lfmspark").addHandler(records)
    monkeypatch.setenv("LFMSPARK_WALK", "steps")
    environment.environment.cache_clear()
    try:
        engine(target, None)
    finally:
        logging.getLogger("lfmspark").removeHandler(records)
    assert any(m.startswith("LFMSPARK_WALK: not an lfmspark variable, ignored") for m in records.messages)


def test_a_bad_markov_walk_is_refused(target):
    with pytest.raises(ValueError, match="markov_walk='grid': use one of jacobi, persistent, steps"):
        engine(target, random_tiny_draft(seed=4), markov_walk="grid")


# =============================================================================================
# 2. draft validation

def draft_with(**changes):
    d = random_tiny_draft(seed=4)
    d.config = dataclasses.replace(d.config, **changes)
    return d


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=48), "draft hidden_size 48 != target hidden_size 32"),
    (dict(vocab_size=128), "draft vocab_size 128 != target vocab_size 64"),
    (dict(mask_token_id=V), "mask_token_id 64 is outside the target vocabulary"),
    (dict(mask_token_id=-1), "mask_token_id -1 is outside the target vocabulary"),
    (dict(target_layer_ids=(0, 2, 4)), "include [4]"),         # the 5-layer target's last layer
    (dict(target_layer_ids=(1, 7)), "include [7]"),            # beyond the target
    (dict(target_layer_ids=(-2, 1)), "include [-2]"),
    (dict(num_target_layers=9), "num_target_layers 9 != target num_hidden_layers 5"),
], ids=["hidden", "vocab", "mask-high", "mask-negative", "last-layer", "beyond", "below-embedding",
        "num_target_layers"])
def test_engine_refuses_a_draft_that_does_not_fit(target, changes, message):
    with pytest.raises(ConfigError) as err:
        engine(target, draft_with(**changes))
    assert message in str(err.value)


def test_speculators_config_is_refused_with_the_slot_convention():
    raw = {"speculators_model_type": "dflash", "transformer_layer_config": {"hidden_size": 32},
           "block_size": 4, "aux_hidden_state_layer_ids": [0, 2], "mask_token_id": 63}
    with pytest.raises(ConfigError) as err:
        DraftConfig.from_dict(raw)
    msg = str(err.value)
    assert "speculators_model_type" in msg
    assert "slot j predicts anchor + j" in msg and "slot k predicts anchor + k + 1" in msg
    # the marker alone is enough, even with DeepSpec-looking fields around it
    with pytest.raises(ConfigError, match="speculators"):
        DraftConfig.from_dict({**draft_config_dict(), "speculators_model_type": "dspark"})


def test_draft_config_without_rope_pairing_is_refused():
    with pytest.raises(ConfigError, match="no 'rope_is_neox_style'"):
        DraftConfig.from_dict(draft_config_dict(rope_is_neox_style=None))
    assert DraftConfig.from_dict(draft_config_dict(rope_is_neox_style=False)).rope_is_neox_style is False


# -- checkpoints on disk ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny HF target (with the word tokenizer; generation_config.json as transformers writes it,
    eos = <|im_end|>) and tiny DSpark drafts for it."""
    root = tmp_path_factory.mktemp("engine_ckpt")
    dirs = {"target": save_tiny_target(root / "target", seed=0), "draft": save_tiny_draft(root / "draft")}
    dirs["draft_no_rope"] = save_tiny_draft(root / "draft_no_rope", rope_is_neox_style=None)
    return dirs


def load(ckpt, draft: str | None = "draft", **kw) -> Engine:
    return Engine.from_pretrained(ckpt["target"], ckpt[draft] if draft else None, max_batch=4, max_seq_len=128,
                                  **F32, **kw)


PLAIN = SamplingParams(max_new_tokens=16, ignore_eos=True)
ID_PROMPTS = [[7, 8, 9, 10, 11], [BOS, 20], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def test_from_pretrained_with_a_draft_is_lossless(ckpt):
    spec, plain = load(ckpt), load(ckpt, None)
    assert spec.draft is not None and spec.block_size == 4 and plain.draft is None
    assert spec.draft.config.rope_is_neox_style is False
    outs = spec.generate(ID_PROMPTS, PLAIN)
    ref = plain.generate(ID_PROMPTS, PLAIN)
    for o, r in zip(outs, ref):
        assert len(o.token_ids) == 16 and o.token_ids == r.token_ids
        assert o.stats.rounds > 0 and r.stats.rounds == 0
    assert any(len(set(r.token_ids)) > 2 for r in ref)         # the model is not degenerate
    assert_clean(spec)


@torch.no_grad()
def test_from_pretrained_matches_transformers_greedy(ckpt):
    """End to end: the engine (with its draft) continues like transformers' own model does."""
    from transformers import Lfm2ForCausalLM as HFLfm2

    hf = HFLfm2.from_pretrained(str(ckpt["target"]), dtype=torch.float32).eval()
    for prompt in ID_PROMPTS[:2]:
        ids = list(prompt)
        for _ in range(10):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        out = load(ckpt).generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
        assert out.token_ids == ids[len(prompt):]


def test_from_pretrained_loads_the_draft_tensors(ckpt):
    """The loaded draft holds the file's tensors (fc, Markov head, norms), not random ones."""
    saved = draft_tensors(draft_config_dict(), seed=1)
    d = load(ckpt).draft
    torch.testing.assert_close(d.fc.weight, saved["fc.weight"], rtol=0, atol=0)
    torch.testing.assert_close(d.markov_head.markov_w1.weight, saved["markov_head.markov_w1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(d.norm.weight, saved["norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(d.layers[1].self_attn.q_proj.weight, saved["layers.1.self_attn.q_proj.weight"],
                               rtol=0, atol=0)


def test_draft_rope_pairing_missing_on_disk_is_refused_then_supplied(ckpt):
    with pytest.raises(ConfigError, match="rope_is_neox_style"):
        load(ckpt, "draft_no_rope")
    ref = load(ckpt, None).generate(ID_PROMPTS, PLAIN)
    for neox in (False, True):
        e = load(ckpt, "draft_no_rope", draft_rope_is_neox_style=neox)
        assert e.draft.config.rope_is_neox_style is neox
        assert [o.token_ids for o in e.generate(ID_PROMPTS, PLAIN)] == [r.token_ids for r in ref]
    # the supplied value overrides one the file has
    assert load(ckpt, "draft", draft_rope_is_neox_style=True).draft.config.rope_is_neox_style is True


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=48), "hidden_size 48"),
    (dict(vocab_size=128), "vocab_size 128"),
    (dict(mask_token_id=VOCAB), "mask_token_id 64"),
    (dict(target_layer_ids=[0, 3]), "include [3]"),            # the 4-layer target's last layer
    (dict(target_layer_ids=[1, 6]), "include [6]"),
], ids=["hidden", "vocab", "mask", "last-layer", "beyond"])
def test_load_draft_refuses_a_draft_that_does_not_fit(ckpt, tmp_path, changes, message):
    path = save_tiny_draft(tmp_path / "bad_draft", **changes)
    target_cfg = TargetConfig.from_pretrained(ckpt["target"])
    with pytest.raises(ConfigError) as err:
        load_draft(path, target_cfg, dtype=torch.float32)
    assert message in str(err.value)
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
        Engine.from_pretrained(ckpt["target"], path, **F32)


def test_speculators_checkpoint_on_disk_is_refused(ckpt, tmp_path):
    path = save_tiny_draft(tmp_path / "spec_draft", speculators_model_type="dflash")
    with pytest.raises(ConfigError, match="slot convention"):
        Engine.from_pretrained(ckpt["target"], path, **F32)
    with pytest.raises(ConfigError, match="slot convention"):    # supplying the RoPE pairing does not help
        Engine.from_pretrained(ckpt["target"], path, draft_rope_is_neox_style=False, **F32)


# =============================================================================================
# 3. tokenizer and text

CHAT_PROMPTS = ["w1 w2 w3", "user w5 w5", "w40"]


def test_string_prompts_are_wrapped_in_the_chat_template(ckpt):
    e = load(ckpt)
    tok = word_tokenizer()
    outs = e.generate(CHAT_PROMPTS, PLAIN)
    for prompt, out in zip(CHAT_PROMPTS, outs):
        expected = [BOS, IM_START, TOKEN_ID["user"]] + words_to_ids(prompt) + [IM_END, IM_START,
                                                                                 TOKEN_ID["assistant"]]
        templated = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        assert out.prompt_token_ids == expected == list(templated["input_ids"])
        assert out.text == ids_to_text(out.token_ids) == tok.decode(out.token_ids, skip_special_tokens=True)
    # the same ids given directly produce the same continuation
    direct = e.generate([o.prompt_token_ids for o in outs], PLAIN)
    assert [d.token_ids for d in direct] == [o.token_ids for o in outs]
    assert_clean(e)


def test_chat_false_tokenises_plainly(ckpt):
    e = load(ckpt, chat=False)
    out = e.generate("w1 w2 w3", PLAIN)[0]
    assert out.prompt_token_ids == [BOS] + words_to_ids("w1 w2 w3") == word_tokenizer()("w1 w2 w3")["input_ids"]
    assert out.text == ids_to_text(out.token_ids)


def test_chat_message_prompts(ckpt):
    e = load(ckpt)
    conv = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}]
    expected = ([BOS, IM_START, TOKEN_ID["system"], TOKEN_ID["w9"], IM_END]
                + [IM_START, TOKEN_ID["user"], TOKEN_ID["w1"], TOKEN_ID["w2"], IM_END]
                + [IM_START, TOKEN_ID["assistant"], TOKEN_ID["w3"], IM_END]
                + [IM_START, TOKEN_ID["user"], TOKEN_ID["w4"], IM_END, IM_START, TOKEN_ID["assistant"]])
    single = e.generate(conv, PLAIN)                       # one conversation = one prompt
    assert len(single) == 1 and single[0].prompt_token_ids == expected
    two = e.generate([conv, conv[:2]], PLAIN)              # a list of conversations
    assert len(two) == 2 and two[0].token_ids == single[0].token_ids
    assert two[1].prompt_token_ids == expected[:10] + [IM_START, TOKEN_ID["assistant"]]
    assert two[0].token_ids == load(ckpt, None).generate([expected], PLAIN)[0].token_ids


def test_tokenizer_without_chat_template(target):
    e = engine(target, None, tokenizer=word_tokenizer(chat_template=None))
    out = e.generate("w1 w2", greedy(3))[0]
    assert out.prompt_token_ids == [BOS] + words_to_ids("w1 w2")       # plain, despite chat=True
    with pytest.raises(RequestError, match="chat template"):
        e.generate([{"role": "user", "content": "w1"}], greedy(3))
    assert_clean(e)


def test_stream_text_deltas_concatenate_to_the_final_text(ckpt):
    e = load(ckpt)
    texts = {i: "" for i in range(len(CHAT_PROMPTS))}
    finals = {}
    for ev in e.stream(CHAT_PROMPTS, PLAIN):
        assert isinstance(ev.text, str)
        texts[ev.index] += ev.text
        if ev.finished:
            finals[ev.index] = ev.output.text
    assert finals == texts
    assert all(t.strip() for t in texts.values())


def test_no_tokenizer_means_no_text(target):
    e = engine(target, None)
    out = e.generate([1, 2], greedy(3))[0]
    assert out.text is None
    assert all(ev.text is None for ev in e.stream([1, 2], greedy(3)))


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
def test_text_deltas_hold_back_a_character_split_across_tokens(spec):
    """``é`` is two byte tokens: a delta must not emit U+FFFD for the first half and then the
    whole text again (the deltas must concatenate to the final text)."""
    tok, (e1, e2) = byte_tokenizer()
    rest = [t for t in range(V) if t not in (e1, e2)]
    order = rest[:3] + [e1, e2] + rest[3:]                 # a cycle through all tokens: ... a b c é d ...
    perm = torch.empty(V, dtype=torch.int64)
    for i, t in enumerate(order):
        perm[t] = order[(i + 1) % V]
    target = bigram_target(perm, leak=0.0)                 # greedy continuation of t: perm[t]
    e = engine(target, oracle_draft(perm) if spec else None, tokenizer=tok)
    for n in (3, 4, 6, 9):                                 # ends inside the split, right after it, later
        deltas, final = [], None
        for ev in e.stream([order[0]], greedy(n)):
            deltas.append(ev.text)
            if ev.finished:
                final = ev.output
        assert final.token_ids == order[1:n + 1]
        assert final.text == byte_level_text(tok, order[1:n + 1])
        assert "".join(deltas) == final.text
        if n >= 4:
            assert "é" in final.text and "\ufffd" not in "".join(deltas)
    assert_clean(e)


# -- stop tokens from generation_config.json ----------------------------------------------------

def test_generation_config_eos_ids_are_the_default_stop_ids(ckpt, tmp_path):
    ref = load(ckpt).generate(ID_PROMPTS, PLAIN)                    # ignore_eos: the plain continuations
    cont = max((r.token_ids for r in ref), key=lambda t: len(set(t)))
    # two stop ids: one seen late in a continuation, one earlier (a list in generation_config.json)
    late, early = cont[6], cont[2]
    stops = {late, early}
    path = tmp_path / "target_with_stops"
    shutil.copytree(ckpt["target"], path)
    write_generation_eos(path, [late, early])
    e = Engine.from_pretrained(path, ckpt["draft"], max_batch=4, max_seq_len=128, **F32)
    assert set(e.stop_token_ids) == stops
    outs = e.generate(ID_PROMPTS, SamplingParams(max_new_tokens=16))
    for o, r in zip(outs, ref):
        hits = [i for i, t in enumerate(r.token_ids) if t in stops]
        if hits:
            assert o.finish_reason == "stop" and o.token_ids == r.token_ids[:hits[0] + 1]
            assert o.token_ids[-1] in stops
        else:
            assert o.finish_reason == "length" and o.token_ids == r.token_ids
    assert any(o.finish_reason == "stop" for o in outs)
    # ignore_eos continues past them; explicit stop_token_ids replace them
    assert [o.token_ids for o in e.generate(ID_PROMPTS, PLAIN)] == [r.token_ids for r in ref]
    other = next(t for t in cont if t not in stops)
    for o, r in zip(e.generate(ID_PROMPTS, SamplingParams(max_new_tokens=16, stop_token_ids=[other])), ref):
        k = r.token_ids.index(other) + 1 if other in r.token_ids else 16
        assert o.token_ids == r.token_ids[:k]
    assert_clean(e)


def test_stop_ids_fall_back_to_config_eos(ckpt, tmp_path):
    path = tmp_path / "target_no_genconfig"
    shutil.copytree(ckpt["target"], path)
    (path / "generation_config.json").unlink()
    assert Engine.from_pretrained(path, **F32).stop_token_ids == (IM_END,)        # config.json eos_token_id
    write_generation_eos(path, 17)                                                # a single int
    assert Engine.from_pretrained(path, **F32).stop_token_ids == (17,)


# =============================================================================================
# 4. streaming and scheduling

SCHED_PROMPTS = [[3, 9, 27], [5], [11, 12], list(range(1, 30)), [60, 2, 2, 2, 7], [33] * 5, [4, 40]]


def collect(stream) -> tuple[dict[int, list[int]], dict[int, GenerationOutput], list]:
    tokens, outputs, events = {}, {}, []
    for ev in stream:
        events.append(ev)
        assert ev.index not in outputs, "an event after the request's finished event"
        tokens.setdefault(ev.index, []).extend(ev.token_ids)
        if ev.finished:
            outputs[ev.index] = ev.output
        else:
            assert ev.output is None
    return tokens, outputs, events


def test_stream_events_concatenate_to_generate(target, draft):
    prompts = SCHED_PROMPTS[:4]
    params = [greedy(9), greedy(14), greedy(1), greedy(20)]
    ref = engine(target, draft).generate(prompts, params)
    e = engine(target, draft)
    tokens, outputs, events = collect(e.stream(prompts, params))
    assert sorted(outputs) == list(range(4))
    for i, r in enumerate(ref):
        assert tokens[i] == r.token_ids == outputs[i].token_ids
        assert outputs[i].prompt_token_ids == prompts[i] and outputs[i].finish_reason == "length"
        assert sum(ev.finished for ev in events if ev.index == i) == 1
        assert all(ev.token_ids for ev in events if ev.index == i)          # no empty events
    assert_clean(e)


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
def test_more_prompts_than_slots(target, draft, spec):
    """7 prompts through 2 slots, finishing at different times (lengths and a stop token): every
    output equals the prompt run alone, at most 2 slots are ever in use, none leaks."""
    lengths = [9, 3, 17, 6, 12, 1, 8]
    alone = one_by_one(target, SCHED_PROMPTS, [greedy(n) for n in lengths])
    stop = alone[2][4]                                      # request 2 stops early on its 5th token
    params = [greedy(n) for n in lengths]
    params[2] = greedy(lengths[2], stop_token_ids=[stop])
    e = engine(target, draft if spec else None, max_batch=2)
    tokens, outputs = {}, {}
    for ev in e.stream(SCHED_PROMPTS, params):
        assert e.scheduler.pool.in_use <= 2
        tokens.setdefault(ev.index, []).extend(ev.token_ids)
        if ev.finished:
            outputs[ev.index] = ev.output
    assert sorted(outputs) == list(range(7))
    for i, expected in enumerate(alone):
        if i == 2:
            expected = expected[:expected.index(stop) + 1]
            assert outputs[i].finish_reason == "stop"
        else:
            assert outputs[i].finish_reason == "length"
        assert outputs[i].token_ids == tokens[i] == expected
    assert_clean(e)
    # and again through the same (reused) slots, with generate
    assert [o.token_ids for o in e.generate(SCHED_PROMPTS, params)] == [outputs[i].token_ids for i in range(7)]
    assert_clean(e)


@pytest.mark.parametrize("how", ["break", "close"])
def test_leaving_a_stream_early_cancels_and_frees_everything(target, draft, how):
    e = engine(target, draft, max_batch=2)
    seen = []
    if how == "break":              # the generator is dropped (and closed) when the loop is left
        for ev in e.stream(SCHED_PROMPTS[:5], greedy(30)):
            seen.append(ev)
            if len(seen) == 3:
                break
    else:
        it = e.stream(SCHED_PROMPTS[:5], greedy(30))
        seen = [next(it) for _ in range(3)]
        assert e.scheduler.pool.in_use == 2                          # both slots busy, three prompts queued
        it.close()
    assert not any(ev.finished for ev in seen)
    assert_clean(e)
    fresh = [[1, 2, 3], [8], [50, 51]]
    assert [o.token_ids for o in e.generate(fresh, greedy(10))] == one_by_one(target, fresh, greedy(10))
    assert_clean(e)


def test_single_prompt_vs_list_of_prompts(target):
    e = engine(target, None)
    one = e.generate([1, 2, 3], greedy(5))
    assert len(one) == 1 and one[0].prompt_token_ids == [1, 2, 3]
    assert e.generate([[1, 2, 3]], greedy(5))[0].token_ids == one[0].token_ids
    assert e.generate((1, 2, 3), greedy(5))[0].token_ids == one[0].token_ids
    two = e.generate([[1, 2], [3]], greedy(5))
    assert [o.prompt_token_ids for o in two] == [[1, 2], [3]]
    assert [o.token_ids for o in two] == one_by_one(target, [[1, 2], [3]], greedy(5))
    single_token = e.generate([7], greedy(5))
    assert len(single_token) == 1 and single_token[0].prompt_token_ids == [7]
    assert_clean(e)


def test_interleaved_streams_each_get_only_their_own_events(target, draft):
    """Two open streams advanced alternately (continuous batching): each yields exactly its own
    requests' events, and a generate() call in between is not fed the other stream's events."""
    a_prompts, b_prompts, c_prompts = [[3, 9, 27], [5]], [[11, 12], [33] * 5, [4]], [[60, 2], [7, 7, 7]]
    ref_a = one_by_one(target, a_prompts, greedy(12))
    ref_b = one_by_one(target, b_prompts, greedy(7))
    ref_c = one_by_one(target, c_prompts, greedy(9))
    e = engine(target, draft, max_batch=4)
    sa, sb = e.stream(a_prompts, greedy(12)), e.stream(b_prompts, greedy(7))
    got_a, got_b = {}, {}
    fin_a, fin_b = {}, {}
    ev = next(sa)
    got_a.setdefault(ev.index, []).extend(ev.token_ids)
    ev = next(sb)
    got_b.setdefault(ev.index, []).extend(ev.token_ids)
    c_out = e.generate(c_prompts, greedy(9))                  # runs while a and b are in flight
    assert [o.token_ids for o in c_out] == ref_c
    done_a = done_b = False
    while not (done_a and done_b):
        for s, got, fin, name in ((sa, got_a, fin_a, "a"), (sb, got_b, fin_b, "b")):
            if (name == "a" and done_a) or (name == "b" and done_b):
                continue
            try:
                ev = next(s)
            except StopIteration:
                if name == "a":
                    done_a = True
                else:
                    done_b = True
                continue
            got.setdefault(ev.index, []).extend(ev.token_ids)
            if ev.finished:
                fin[ev.index] = ev.output.token_ids
    assert [got_a[i] for i in range(2)] == [fin_a[i] for i in range(2)] == ref_a
    assert [got_b[i] for i in range(3)] == [fin_b[i] for i in range(3)] == ref_b
    assert_clean(e)


def test_a_failing_round_ends_every_request_in_it_and_frees_the_slots(target, draft, monkeypatch):
    e = engine(target, draft, max_batch=4)
    sa = e.stream([[1, 2], [3]], greedy(20))
    next(sa)
    sb = e.stream([[4, 5]], greedy(20))
    real_run, calls = e.model_runner.step_runner.run, []

    def failing_run(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return real_run(*args, **kw)

    monkeypatch.setattr(e.model_runner.step_runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="device fell over"):
        for _ in sb:
            pass
    assert e.scheduler.pool.in_use == 0
    with pytest.raises(RuntimeError, match="device fell over"):       # the other stream learns it too
        for _ in sa:
            pass
    monkeypatch.setattr(e.model_runner.step_runner, "run", real_run)
    assert_clean(e)
    assert [o.token_ids for o in e.generate([[6, 7]], greedy(8))] == one_by_one(target, [[6, 7]], greedy(8))


def test_closing_one_stream_leaves_the_others_running(target, draft):
    e = engine(target, draft, max_batch=3)
    a_prompts, b_prompts = [[3, 9, 27], [5]], [[11, 12], [33] * 5, [4]]
    ref_a = one_by_one(target, a_prompts, greedy(15))
    sa, sb = e.stream(a_prompts, greedy(15)), e.stream(b_prompts, greedy(30))
    tokens = {}
    ev = next(sa)
    tokens.setdefault(ev.index, []).extend(ev.token_ids)
    for _ in range(4):
        next(sb)
    sb.close()                                            # b's requests leave; a's keep their slots
    assert e.scheduler.pool.in_use == 2
    for ev in sa:
        tokens.setdefault(ev.index, []).extend(ev.token_ids)
    assert [tokens[0], tokens[1]] == ref_a
    assert_clean(e)


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
def test_seeded_sampling_does_not_depend_on_the_batch(target, draft, spec):
    """A seeded sampled request gives the same tokens alone and sharing a batch with greedy and
    other sampled requests (and greedy rows in a sampling batch stay greedy)."""
    d = draft if spec else None
    hot = [SamplingParams(max_new_tokens=12, temperature=t, top_k=k, top_p=p, seed=s)
           for t, k, p, s in ((0.9, 0, 1.0, 5), (1.3, 8, 0.9, 6))]
    prompts = [[3, 9, 27], [5, 6], [11, 12]]
    params = [hot[0], greedy(12), hot[1]]
    batch = engine(target, d).generate(prompts, params)
    alone = [engine(target, d, max_batch=1).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    assert [o.token_ids for o in batch] == alone
    assert alone[1] == one_by_one(target, [prompts[1]], greedy(12))[0]
    other_seed = engine(target, d).generate([prompts[0]], dataclasses.replace(hot[0], seed=7))[0].token_ids
    assert other_seed != alone[0]                         # the seed matters


def test_special_stop_token_is_in_the_ids_but_not_in_the_text():
    start = TOKEN_ID["w3"]
    chain = [TOKEN_ID["w10"], TOKEN_ID["user"], IM_END, TOKEN_ID["w11"]]
    order = [start] + chain + [t for t in range(V) if t not in [start] + chain]
    perm = torch.empty(V, dtype=torch.int64)
    for i, t in enumerate(order):
        perm[t] = order[(i + 1) % V]
    target = bigram_target(perm, leak=0.0)
    for draft in (None, oracle_draft(perm)):
        e = engine(target, draft, tokenizer=word_tokenizer(), stop_token_ids=[IM_END], chat=False)
        out = e.generate([[start]], greedy(10))[0]
        assert out.token_ids == chain[:3] and out.finish_reason == "stop"
        assert out.text == "w10 user" == ids_to_text(out.token_ids)
        assert e.generate([[start]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids == order[1:6]


# =============================================================================================
# 5. statistics

def test_stats_of_speculative_requests(target, draft):
    prompts = SCHED_PROMPTS[:5]
    outs = engine(target, draft).generate(prompts, greedy(23))
    for o, p in zip(outs, prompts):
        s = o.stats
        n = s.accept_lengths
        assert s.block_size == GAMMA and s.rounds == len(n) > 0 and not s.imposed_acceptance
        assert all(1 <= a <= GAMMA + 1 for a in n)
        assert s.tau == pytest.approx(sum(n) / len(n))
        assert len(s.acceptance_per_position) == GAMMA
        # the first token comes from prefill, every round commits its accept length
        assert 1 + sum(n[:-1]) < len(o.token_ids) == 23 <= 1 + sum(n)
        assert s.prompt_tokens == len(p) and s.ttft_s >= 0 and s.decode_s >= 0
        d = s.as_dict()
        assert d["rounds"] == len(n) and d["tau"] == s.tau and d["accept_lengths"] == n


def test_time_to_first_token_ends_when_the_first_token_is_on_the_host(target, draft, monkeypatch):
    """``ttft_s`` covers the prefill: the first token's time is taken after the token is read back
    (when the host has only queued the prefill, the device may still be computing it). The clock
    jumps 10 s while the first token is read, as a long prefill would make the read wait."""
    import time

    real, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + jump[0])
    e = engine(target, draft)
    read = e.model_runner.read_first_tokens

    def slow_read(started):
        out = read(started)
        jump[0] += 10.0 if started else 0.0
        return out

    monkeypatch.setattr(e.model_runner, "read_first_tokens", slow_read)
    s = e.generate([SCHED_PROMPTS[0]], greedy(6))[0].stats
    assert 10.0 <= s.ttft_s < 20.0 and s.decode_s < 10.0


def test_acceptance_statistics_of_known_drafts():
    perm = permutation(21)
    target = bigram_target(perm, leak=0.0)
    prompts = [[5], [9, 10], [40]]
    full = engine(target, oracle_draft(perm)).generate(prompts, greedy(21))
    never = engine(target, oracle_draft(derangement_of(perm))).generate(prompts, greedy(21))
    for o in full:
        assert o.stats.accept_lengths == [GAMMA + 1] * 4 and o.stats.tau == GAMMA + 1   # 1 + 4 * 5 = 21
        assert o.stats.acceptance_per_position == [1.0] * GAMMA
    for o in never:
        assert o.stats.accept_lengths == [1] * 20 and o.stats.tau == 1.0
        rates = o.stats.acceptance_per_position
        assert rates[0] == 0.0 and all(math.isnan(r) for r in rates[1:])     # position 2+ never reached


def test_target_only_stats(target):
    o = engine(target, None).generate([[1, 2, 3]], greedy(6))[0]
    s = o.stats
    assert s.rounds == 0 and s.accept_lengths == [] and s.tau == 1.0
    assert s.block_size == 0 and s.acceptance_per_position == [] and not s.imposed_acceptance


@pytest.mark.parametrize("max_new", [13, 16])
def test_imposed_full_acceptance(target, draft, max_new):
    e = engine(target, draft, imposed_acceptance=[1.0] * GAMMA)
    outs = e.generate(SCHED_PROMPTS[:3], greedy(max_new))
    for o in outs:
        assert o.stats.imposed_acceptance
        assert o.stats.accept_lengths == [GAMMA + 1] * math.ceil((max_new - 1) / (GAMMA + 1))
        assert len(o.token_ids) == max_new and o.finish_reason == "length"
    assert_clean(e)


def test_imposed_zero_acceptance_is_target_only_decoding(target, draft):
    e = engine(target, draft, imposed_acceptance=[0.0] * GAMMA)
    prompts = SCHED_PROMPTS[:3]
    outs = e.generate(prompts, greedy(9))
    for o, ref in zip(outs, one_by_one(target, prompts, greedy(9))):
        assert o.stats.imposed_acceptance and o.stats.accept_lengths == [1] * 8
        assert o.token_ids == ref                  # nothing accepted: every token is the target's own


def test_imposed_partial_acceptance(target, draft):
    e = engine(target, draft, imposed_acceptance=[1.0, 1.0, 0.0, 1.0])
    o = e.generate([[3, 4]], greedy(10))[0]
    assert o.stats.accept_lengths == [3, 3, 3] and len(o.token_ids) == 10      # 1 + 3 * 3 = 10
    assert o.stats.acceptance_per_position[:3] == [1.0, 1.0, 0.0]


# =============================================================================================
# 6. presets

def test_from_preset_tiny_with_and_without_draft():
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3], [100, 7]]
    spec = Engine.from_preset("tiny", **F32, max_batch=2, max_seq_len=64)
    plain = Engine.from_preset("tiny", None, **F32, max_batch=2, max_seq_len=64)
    assert spec.draft is not None and spec.block_size == 4 and plain.draft is None
    assert spec.model_config.vocab_size == 264 and spec.stop_token_ids == (7,)
    a, b = spec.generate(prompts, params), plain.generate(prompts, params)
    for x, y in zip(a, b):
        assert len(x.token_ids) == 10 and x.token_ids == y.token_ids       # greedy speculation is lossless
        assert x.stats.rounds > 0 and y.stats.rounds == 0
    assert_clean(spec)
    assert_clean(plain)
