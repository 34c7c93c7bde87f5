"""Sampling defaults from the checkpoint's generation_config.json, as transformers and
vLLM take them: params=None means those defaults; an explicit SamplingParams wins; fields lfmspark
cannot apply yet are named in a warning, never dropped silently; a malformed one names the file."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lfmspark.models.config import ConfigError
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.prompts import generation_defaults
from lfmspark.serve.protocol import CompletionRequest
from engine_fixtures import save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("gen") / "target")


def with_generation_config(target_dir, tmp_path, **fields):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(target_dir, d)
    with open(d / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 5, **fields}, f)
    return d


def load(d) -> Engine:
    return Engine.from_pretrained(d, dtype=torch.float32, device="cpu", max_batch=2, max_seq_len=64, chat=False)


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_checkpoint_defaults_apply_when_no_params_are_given(target_dir, tmp_path):
    d = with_generation_config(target_dir, tmp_path, do_sample=True, temperature=0.7, top_k=5, top_p=0.9,
                               max_new_tokens=6, repetition_penalty=1.05, typical_p=0.9)
    captured = Captured()
    logging.getLogger("lfmspark").addHandler(captured)
    try:
        e = load(d)
    finally:
        logging.getLogger("lfmspark").removeHandler(captured)
    assert any("typical_p=0.9" in m and "does not apply" in m for m in captured.messages)
    p = e.default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens, p.repetition_penalty) == (0.7, 5, 0.9, 6, 1.05)
    prompt = "w3 w4"
    assert len(e.generate(prompt)[0].token_ids) <= 6
    e.sampling_defaults["seed"] = 11           # seeded, so the default run can be compared
    seeded = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6, repetition_penalty=1.05, seed=11)
    assert e.generate(prompt)[0].token_ids == e.generate(prompt, seeded)[0].token_ids
    greedy = e.generate(prompt, SamplingParams(max_new_tokens=3))[0]           # an explicit object wins
    assert greedy.token_ids == load(target_dir).generate(prompt, SamplingParams(max_new_tokens=3))[0].token_ids


def test_do_sample_false_means_greedy(target_dir, tmp_path):
    d = with_generation_config(target_dir, tmp_path, do_sample=False, temperature=0.6)
    assert generation_defaults(d) == {"temperature": 0.0}


def test_no_sampling_fields_means_the_built_in_defaults(target_dir):
    assert generation_defaults(target_dir) == {}
    assert load(target_dir).default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("fields, message", [
    (dict(temperature="hot"), 'temperature: expected a number, got "hot"'),
    (dict(top_k=2.5), "top_k: expected an integer, got 2.5"),
    (dict(do_sample="false"), 'do_sample: expected true or false, got "false"'),
])
def test_a_malformed_default_names_the_file(target_dir, tmp_path, fields, message):
    d = with_generation_config(target_dir, tmp_path, **fields)
    with pytest.raises(ConfigError, match=f"generation_config.json: {message}"):
        load(d)


def test_the_server_fills_what_a_request_leaves_out_from_the_defaults():
    defaults = {"temperature": 0.1, "top_k": 50, "top_p": 0.1}
    p = CompletionRequest(prompt="x").sampling(16, defaults)
    assert (p.temperature, p.top_k, p.top_p) == (0.1, 50, 0.1)
    p = CompletionRequest(prompt="x", temperature=0.0, top_p=1.0).sampling(16, defaults)
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 50, 1.0)
    assert CompletionRequest(prompt="x").sampling(16, {}).temperature == 1.0     # OpenAI's default
