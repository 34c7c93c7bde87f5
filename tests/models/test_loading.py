"""Loading HF safetensors checkpoints with ``load_target``.

Round trips start from ``save_pretrained`` of random HF models (single file and sharded, dense
and MoE). The expected weights are the HF model's own in-memory tensors: transformers packs the
per-expert tensors on disk into ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj``
itself, which is the independent reference for our fused ``w13``/``w2``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lfm_testing import TINY_DENSE, build_hf, copy_checkpoint, edit_config, read_safetensors, \
    save_hf, write_safetensors
from lfmspark.models.config import ConfigError
from lfmspark.models.loading import CheckpointError, load_target


def expected_state(hf) -> dict[str, torch.Tensor]:
    """Our module's state dict, written from the HF model's modules (fp32)."""
    cfg = hf.config
    out = {"model.embed_tokens.weight": hf.model.embed_tokens.weight,
           "model.embedding_norm.weight": hf.model.embedding_norm.weight}
    for i, layer in enumerate(hf.model.layers):
        p = f"model.layers.{i}."
        out[p + "operator_norm.weight"] = layer.operator_norm.weight
        out[p + "ffn_norm.weight"] = layer.ffn_norm.weight
        if cfg.layer_types[i] == "full_attention":
            a = layer.self_attn
            out[p + "self_attn.qkv_proj.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            out[p + "self_attn.out_proj.weight"] = a.out_proj.weight
            out[p + "self_attn.q_layernorm.weight"] = a.q_layernorm.weight
            out[p + "self_attn.k_layernorm.weight"] = a.k_layernorm.weight
        else:
            out[p + "conv.in_proj.weight"] = layer.conv.in_proj.weight
            out[p + "conv.out_proj.weight"] = layer.conv.out_proj.weight
            out[p + "conv.conv_weight"] = layer.conv.conv.weight[:, 0, :]
        ff = layer.feed_forward
        if hasattr(ff, "experts"):
            out[p + "feed_forward.gate.weight"] = ff.gate.weight
            out[p + "feed_forward.expert_bias"] = ff.expert_bias
            out[p + "feed_forward.experts.w13"] = ff.experts.gate_up_proj
            out[p + "feed_forward.experts.w2"] = ff.experts.down_proj
        else:
            out[p + "feed_forward.w13.weight"] = torch.cat([ff.w1.weight, ff.w3.weight])
            out[p + "feed_forward.w2.weight"] = ff.w2.weight
    return {k: v.detach() for k, v in out.items()}


def assert_weights(ours, hf, dtype=torch.float32):
    want = expected_state(hf)
    got = dict(ours.named_parameters(remove_duplicate=False)) | dict(ours.named_buffers())
    assert set(got) - {"lm_head.weight"} == set(want)
    for name, w in want.items():
        t = torch.float32 if name.endswith("expert_bias") else dtype
        assert got[name].dtype == t, f"{name}: {got[name].dtype}, expected {t}"
        assert torch.equal(got[name], w.to(t)), name
    # tied LM head: the very same storage as the embedding
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_round_trip(ckpt, tmp_path, sharded, dtype):
    path = ckpt.path
    if sharded:
        path = save_hf(ckpt.model, tmp_path / "sharded", max_shard_size="20KB")
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 5 and all((path / s).is_file() for s in shards)
        assert not (path / "model.safetensors").exists()
    model = load_target(path, dtype=dtype)
    assert_weights(model, ckpt.model, dtype)
    assert not model.training


def test_moe_on_disk_layout_is_per_expert(moe_ckpt):
    names = set(read_safetensors(moe_ckpt.path / "model.safetensors"))
    assert "model.layers.1.feed_forward.experts.3.w2.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    assert "model.layers.0.feed_forward.w1.weight" in names          # the dense first layer


def test_moe_packed_expert_layout(moe_ckpt, tmp_path):
    """A file holding transformers' in-memory packed layout loads to the same weights."""
    path = copy_checkpoint(moe_ckpt.path, tmp_path / "packed")
    tensors = {k: v for k, v in moe_ckpt.model.state_dict().items() if k != "lm_head.weight"}
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in tensors
    write_safetensors(tensors, path / "model.safetensors")
    packed = load_target(path, dtype=torch.float32)
    per_expert = load_target(moe_ckpt.path, dtype=torch.float32)
    a, b = packed.state_dict(), per_expert.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_moe_expert_bias_stays_fp32_from_bf16_file(moe_ckpt, tmp_path):
    """A bf16 checkpoint (as released: everything bf16 except the fp32 expert_bias)."""
    path = copy_checkpoint(moe_ckpt.path, tmp_path / "bf16")
    tensors = read_safetensors(path / "model.safetensors")
    tensors = {k: v if k.endswith("expert_bias") else v.to(torch.bfloat16) for k, v in tensors.items()}
    write_safetensors(tensors, path / "model.safetensors")
    model = load_target(path, dtype=torch.bfloat16)
    bias = model.model.layers[1].feed_forward.expert_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, moe_ckpt.model.model.layers[1].feed_forward.expert_bias)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_untied_lm_head(tmp_path):
    hf = build_hf(dict(TINY_DENSE, tie_word_embeddings=False), seed=3)
    path = save_hf(hf, tmp_path / "untied")
    model = load_target(path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------
# errors

def _edit_tensors(path: Path, fn) -> None:
    tensors = read_safetensors(path / "model.safetensors")
    fn(tensors)
    write_safetensors(tensors, path / "model.safetensors")


def _fails(path: Path, *needles: str, exc=CheckpointError) -> str:
    with pytest.raises(exc) as e:
        load_target(path, dtype=torch.float32)
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"message does not mention {n!r}: {msg}"
    return msg


def test_wrong_shape(dense_ckpt, tmp_path):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    _fails(path, name, "[16, 64]", "[32, 64]")


def test_wrong_shape_moe_expert(moe_ckpt, tmp_path):
    path = copy_checkpoint(moe_ckpt.path, tmp_path / "c")
    name = "model.layers.3.feed_forward.experts.2.w2.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, torch.zeros(64, 48)))
    _fails(path, name, "[64, 48]", "[64, 32]")


def test_missing_tensor(dense_ckpt, tmp_path):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    name = "model.layers.2.conv.out_proj.weight"
    _edit_tensors(path, lambda t: t.pop(name))
    _fails(path, name, "missing")


def test_missing_expert(moe_ckpt, tmp_path):
    path = copy_checkpoint(moe_ckpt.path, tmp_path / "c")
    name = "model.layers.2.feed_forward.experts.3.w3.weight"
    _edit_tensors(path, lambda t: t.pop(name))
    _fails(path, name)


def test_unexpected_tensor(dense_ckpt, tmp_path):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    name = "model.layers.0.conv.conv.bias"
    _edit_tensors(path, lambda t: t.__setitem__(name, torch.zeros(64)))
    _fails(path, name, "unexpected")


def test_missing_shard(dense_ckpt, tmp_path):
    path = save_hf(dense_ckpt.model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    _fails(path, shard)


def test_no_safetensors(dense_ckpt, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    (path / "config.json").write_bytes((dense_ckpt.path / "config.json").read_bytes())
    _fails(path, "model.safetensors", str(path))


def test_no_config(dense_ckpt, tmp_path):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    (path / "config.json").unlink()
    _fails(path, "config.json", exc=ConfigError)


def test_config_inconsistent_kv_heads(dense_ckpt, tmp_path):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    edit_config(path, num_key_value_heads=4)
    msg = _fails(path, "k_proj.weight", "[32, 64]", "[64, 64]")
    assert "config" in msg


def test_config_inconsistent_layer_types(dense_ckpt, tmp_path):
    """Swapped conv/attention layers: the attention tensors of layer 0 are missing."""
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    edit_config(path, layer_types=["full_attention", "conv", "conv", "full_attention"])
    msg = _fails(path, "model.layers.0.self_attn")
    assert re.search(r"missing|unexpected", msg)


def test_config_inconsistent_ffn_width(dense_ckpt, tmp_path):
    """A config whose auto-adjusted FFN width disagrees with the stored w1 (128 rows)."""
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "c")
    edit_config(path, block_auto_adjust_ff_dim=False)        # width would be 150, not 128
    _fails(path, "feed_forward.w1.weight", "[128, 64]", "[150, 64]")


def test_config_inconsistent_moe_experts(moe_ckpt, tmp_path):
    path = copy_checkpoint(moe_ckpt.path, tmp_path / "c")
    edit_config(path, num_experts=8)
    _fails(path, "feed_forward.gate.weight", "[4, 64]", "[8, 64]")
