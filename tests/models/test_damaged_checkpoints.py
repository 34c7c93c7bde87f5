"""Damaged downloads and malformed configs: each refused as ConfigError / CheckpointError
naming the file and the problem, never a bare library error. A config field of the wrong type
names the file, the field, the value found and what the field takes; a draft or target whose
shapes the kernels cannot run is refused at load, not at its first request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine_fixtures import HIDDEN, LAYER_TYPES, N_LAYERS, VOCAB, save_tiny_draft, word_tokenizer
from lfm_testing import edit_config, read_safetensors, write_safetensors
from lfmspark.models.config import ConfigError, DraftConfig, TargetConfig
from lfmspark.models.loading import CheckpointError, load_draft, load_target
from lfmspark.runtime import Engine
from lfmspark.runtime.prompts import GENERATION_FIELDS, default_stop_ids, generation_defaults, load_tokenizer


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


# ---------------------------------------------------------------------------------------------
# config fields of the wrong type: the file, the field, the value and what the field takes

def _refused(load, *needles: str, exc=ConfigError) -> str:
    with pytest.raises(exc) as e:
        load()
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"message does not name {n!r}: {msg}"
    assert "wrong type or value" not in msg
    return msg


def test_full_attn_idxs_that_is_an_int(ckpt_copy):
    edit_config(ckpt_copy, layer_types=None, full_attn_idxs=3)
    _refused(lambda: load_target(ckpt_copy),
             f"{ckpt_copy / 'config.json'}: full_attn_idxs: expected a list of layer indices, got 3")


def test_norm_eps_that_is_not_a_number(ckpt_copy):
    edit_config(ckpt_copy, norm_eps="small")
    _refused(lambda: load_target(ckpt_copy),
             f"{ckpt_copy / 'config.json'}: norm_eps: expected a non-negative number, got \"small\"")


def test_eos_token_id_that_is_not_a_number(ckpt_copy):
    edit_config(ckpt_copy, eos_token_id="end")
    _refused(lambda: load_target(ckpt_copy), f"{ckpt_copy / 'config.json'}: eos_token_id: expected a token id",
             'got "end"')


def test_eos_token_id_of_generation_config_that_is_not_a_number(ckpt_copy):
    (ckpt_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": ["end"]}))
    where = f"{ckpt_copy / 'generation_config.json'}: eos_token_id: expected a token id"
    _refused(lambda: default_stop_ids(ckpt_copy, (7,)), where, 'got ["end"]')
    _refused(lambda: Engine.from_pretrained(ckpt_copy, dtype=torch.float32, device="cpu", max_batch=1,
                                            max_seq_len=64), where)


def tiny_target_config() -> TargetConfig:
    """The config of engine_fixtures' tiny target, which its drafts are built for."""
    return TargetConfig.from_dict(dict(model_type="lfm2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                       num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                       layer_types=list(LAYER_TYPES), block_auto_adjust_ff_dim=False))


@pytest.mark.parametrize("rank", ["eight", "8"])
def test_draft_markov_rank_that_is_a_string(tmp_path, rank):
    path = save_tiny_draft(tmp_path / "draft")
    edit_config(path, markov_rank=rank)
    where = f"{path / 'config.json'}: markov_rank: expected a non-negative integer, got \"{rank}\""
    _refused(lambda: load_draft(path, tiny_target_config(), dtype=torch.float32), where)
    # a RoPE pairing given on the command line goes through the same reading
    _refused(lambda: DraftConfig.from_pretrained(path, overrides={"rope_is_neox_style": False}), where)


def test_draft_rope_pairing_that_is_a_string(tmp_path):
    """bool("false") is True: a string must not pass for the interleaved pairing."""
    path = save_tiny_draft(tmp_path / "draft", rope_is_neox_style="false")
    _refused(lambda: load_draft(path, tiny_target_config(), dtype=torch.float32),
             f"{path / 'config.json'}: rope_is_neox_style: expected true or false, got \"false\"")


@pytest.mark.parametrize("field", sorted(GENERATION_FIELDS))
def test_every_generation_config_field_of_the_wrong_kind_is_named(tmp_path, field):
    kind = GENERATION_FIELDS[field]
    value = "x" if kind.accepts(2.5) else 2.5            # a string for the numbers, 2.5 for the others
    assert not kind.accepts(value)
    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    want = f"{tmp_path / 'generation_config.json'}: {field}: expected {kind.expected}, got {json.dumps(value)}"
    reads = [lambda: generation_defaults(tmp_path), lambda: default_stop_ids(tmp_path, (7,))]
    messages = []
    for read in reads:
        try:
            read()
        except ConfigError as e:
            messages.append(str(e))
    assert any(want in m for m in messages), (want, messages)


# ---------------------------------------------------------------------------------------------
# tokenizer files

def _tokenizer_dir(path: Path) -> Path:
    word_tokenizer().save_pretrained(str(path))
    assert load_tokenizer(path) is not None
    return path


@pytest.mark.parametrize("text", ["{not json", ""])
def test_tokenizer_json_that_is_not_json(tmp_path, text):
    path = _tokenizer_dir(tmp_path / "tok")
    (path / "tokenizer.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path)
    msg = str(e.value)
    assert f"{path / 'tokenizer.json'}: not valid JSON" in msg and "download it again" in msg, msg
    assert isinstance(e.value.__cause__, json.JSONDecodeError)       # transformers' error, kept as the cause


def test_tokenizer_json_that_is_not_a_tokenizer(tmp_path):
    path = _tokenizer_dir(tmp_path / "tok")
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path)
    assert f"{path}: the tokenizer cannot be loaded" in str(e.value), str(e.value)
    assert e.value.__cause__ is not None


def test_damaged_tokenizer_through_the_command_line(ckpt_copy, capsys):
    from lfmspark.tools.cli import main

    _tokenizer_dir(ckpt_copy)
    (ckpt_copy / "tokenizer.json").write_text("{not json")
    assert main(["generate", "--target", str(ckpt_copy), "--prompt", "w1", "--device", "cpu", "--dtype",
                 "float32"]) == 2
    err = capsys.readouterr().err
    assert f"lfmspark generate: error: {ckpt_copy / 'tokenizer.json'}: not valid JSON" in err, err


# ---------------------------------------------------------------------------------------------
# shapes the kernels cannot run: refused at load

def test_draft_with_an_odd_head_dim(tmp_path):
    path = save_tiny_draft(tmp_path / "draft", head_dim=7)
    _refused(lambda: load_draft(path, tiny_target_config(), dtype=torch.float32),
             f"{path / 'config.json'}: draft config field 'head_dim' (7) must be even")


def test_draft_head_dim_the_cuda_kernels_do_not_take(tmp_path):
    """head_dim 8 runs on the CPU references but not in the CUDA attention kernels (a power of two
    of at least 16): refused before any weight is read (so also on a machine without CUDA)."""
    path = save_tiny_draft(tmp_path / "draft", head_dim=8)
    assert load_draft(path, tiny_target_config(), dtype=torch.float32).config.head_dim == 8
    _refused(lambda: load_draft(path, tiny_target_config(), dtype=torch.float32, device="cuda"),
             f"draft checkpoint {path}: config field 'head_dim' is 8", "power of two of at least 16")


@pytest.mark.parametrize("changes, needles", [
    (dict(head_dim=24), ("config field 'head_dim' is 24", "power of two of at least 16")),
    (dict(conv_L_cache=18), ("config field 'conv_L_cache' is 18", "at most 17")),
])
def test_target_shapes_the_cuda_kernels_do_not_take(ckpt_copy, changes, needles):
    edit_config(ckpt_copy, **changes)
    TargetConfig.from_pretrained(ckpt_copy)          # a valid config, which the CPU serves
    _refused(lambda: load_target(ckpt_copy, dtype=torch.float32, device="cuda"), f"target checkpoint {ckpt_copy}",
             *needles)
