"""Where models come from (runtime/loader.py): local directories, or Hugging Face Hub ids resolved
through huggingface_hub's cache (offline here: a cache directory laid out as the Hub's), with the
tokenizer, chat template and sampling defaults from where the config says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine_fixtures import save_tiny_target
from lfmspark import Engine, EngineConfig, SamplingParams
from lfmspark.models.loading import CheckpointError
from lfmspark.runtime.loader import load_models, resolve_checkpoint


def with_sampling_defaults(checkpoint: Path, **fields) -> Path:
    """``fields`` added to the checkpoint's generation_config.json."""
    path = checkpoint / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return checkpoint


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hub cache holding ``lfm/tiny`` at main (commit aaaa) and at tag v2 (commit bbbb)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--lfm--tiny"
    source = with_sampling_defaults(save_tiny_target(tmp_path / "source"), temperature=0.3, top_k=7)
    for commit in ("aaaa", "bbbb"):
        shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaaa")
    (repo / "refs" / "v2").write_text("bbbb")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_from_the_cache_at_its_revision(hub_cache):
    assert resolve_checkpoint("lfm/tiny") == hub_cache / "models--lfm--tiny" / "snapshots" / "aaaa"
    assert resolve_checkpoint("lfm/tiny", revision="v2").name == "bbbb"
    engine = Engine.from_config(EngineConfig(target="lfm/tiny", device="cpu", max_batch=1, max_seq_len=64))
    out = engine.generate("w1 w2", SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text is not None
    assert engine.sampling_defaults == {"temperature": 0.3, "top_k": 7}


def test_an_id_neither_cached_nor_reachable_is_named(hub_cache):
    with pytest.raises(CheckpointError, match=r"target 'lfm/other' is not in the local Hugging Face cache"):
        resolve_checkpoint("lfm/other")
    with pytest.raises(CheckpointError, match=r"at revision 'v9'"):
        resolve_checkpoint("lfm/tiny", revision="v9")
    with pytest.raises(CheckpointError, match="not a checkpoint directory, nor a Hugging Face Hub id"):
        resolve_checkpoint("no/such/dir")


def test_tokenizer_chat_template_and_generation_config_come_from_where_the_config_says(tmp_path):
    target = with_sampling_defaults(save_tiny_target(tmp_path / "target"), temperature=0.5)
    other = tmp_path / "defaults"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    base = EngineConfig(target=str(target), device="cpu")
    assert load_models(base).sampling_defaults == {"temperature": 0.5}
    assert load_models(base.replace(generation_config="vllm")).sampling_defaults == {}
    assert load_models(base.replace(generation_config=str(other))).sampling_defaults == {"top_p": 0.5}
    with pytest.raises(CheckpointError, match="no generation_config.json there"):
        load_models(base.replace(generation_config=str(tmp_path)))
    models = load_models(base.replace(chat_template=str(template)))
    assert models.tokenizer.chat_template == template.read_text()
    inline = "{{ messages[0]['content'] }}"
    assert load_models(base.replace(chat_template=inline)).tokenizer.chat_template == inline
    bare = save_tiny_target(tmp_path / "bare", tokenizer=False)
    assert load_models(base.replace(target=str(bare), tokenizer=str(target))).tokenizer is not None
    with pytest.raises(ValueError, match="tokenizer go with a checkpoint"):
        EngineConfig(preset="tiny", tokenizer=str(target))
