"""Damaged downloads and malformed configs: each refused as ConfigError / CheckpointError
naming the file and the problem, never a bare library error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lfm_testing import read_safetensors, write_safetensors
from lfmspark.models.config import ConfigError
from lfmspark.models.loading import CheckpointError, load_target
from lfmspark.runtime import Engine


@pytest.fixture
def ckpt_copy(dense_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(dense_ckpt.path, tmp_path / "copy"))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_truncated_safetensors(ckpt_copy):
    weights = ckpt_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file .*fetch it again"):
        load_target(ckpt_copy)


def test_garbage_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_target(ckpt_copy)


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object, got a list")])
def test_malformed_config_json(ckpt_copy, text, message):
    (ckpt_copy / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"config\.json: {message}"):
        load_target(ckpt_copy)


@pytest.mark.parametrize("field, value", [("layer_types", 3), ("norm_eps", "small"), ("eos_token_id", "end"),
                                          ("hidden_size", 2.5)])
def test_mistyped_config_fields_name_the_file(ckpt_copy, field, value):
    _edit_config(ckpt_copy, **{field: value})
    with pytest.raises(ConfigError, match="config.json"):
        load_target(ckpt_copy)


def test_index_that_maps_a_tensor_to_the_wrong_shard(ckpt_copy):
    tensors = read_safetensors(ckpt_copy / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    write_safetensors({n: tensors[n] for n in names[:half]}, ckpt_copy / "model-00001-of-00002.safetensors")
    write_safetensors({n: tensors[n] for n in names[half:]}, ckpt_copy / "model-00002-of-00002.safetensors")
    (ckpt_copy / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors"
                  for i, n in enumerate(names)}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"       # the wrong shard
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"maps .* to model-00002-of-00002\.safetensors, which does not hold"):
        load_target(ckpt_copy)


def test_malformed_index_json(ckpt_copy):
    (ckpt_copy / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        load_target(ckpt_copy)


def test_integer_weights_are_refused(ckpt_copy):
    tensors = read_safetensors(ckpt_copy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    write_safetensors(tensors, ckpt_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is torch.int32 .*quantized export"):
        load_target(ckpt_copy)


def test_malformed_generation_config(ckpt_copy):
    (ckpt_copy / "generation_config.json").write_text("{\"eos_token_id\": ")
    with pytest.raises(ConfigError, match=r"generation_config\.json: not valid JSON"):
        Engine.from_pretrained(ckpt_copy, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64)


def test_non_integer_engine_sizes_are_refused(dense_ckpt):
    with pytest.raises(ValueError, match="max_batch must be an integer, got 2.5"):
        Engine.from_pretrained(dense_ckpt.path, dtype=torch.float32, device="cpu", max_batch=2.5, max_seq_len=64)
