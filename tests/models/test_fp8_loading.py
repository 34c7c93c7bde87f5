"""Loading FP8 targets (models/loading.py): bf16 checkpoints quantized at load (``quantization="fp8"``),
and fp8 exports read as fp8, in each format lfmspark reads: ``quant_method "fp8"`` with block scales
(``weight_scale_inv``) or per-tensor scales (``weight_scale``, with activation scales beside them),
and ``compressed-tensors`` with per-channel, block and group scales. Each export is written here from
a tiny HF checkpoint by quantizing its linear weights as the exporters do; the oracle is the float
checkpoint of the same dequantized weights, which must serve the same logits. Other quantizations
are refused, naming their ``quant_method``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lfm_testing import copy_checkpoint, read_safetensors, write_safetensors
from lfmspark.models.cache import TargetCache
from lfmspark.models.config import ConfigError
from lfmspark.models.layers import Fp8Linear, Linear
from lfmspark.models.lfm2_moe import Fp8MoeExperts, target_projections
from lfmspark.models.loading import CheckpointError, checkpoint_quantization, load_draft, load_target
from lfmspark.models.quant import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

TOKENS = [3, 17, 45, 2, 99, 8, 8, 61, 120, 5, 33, 77]
# the HF names of linear weights that exporters quantize: every nn.Linear but the LM head
LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", "in_proj.weight", "w1.weight",
          "w2.weight", "w3.weight", "gate.weight")


def _block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and the ``[ceil(N / bn), ceil(K / bk)]`` scales of ``w`` per ``bn x bk`` block."""
    N, K = w.shape
    scale = torch.zeros(-(-N // bn), -(-K // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fp8 values, stored scale, the dequantized weight)`` of one linear weight in ``scheme``."""
    N, K = w.shape
    if scheme in ("fp8-block", "ct-block"):
        q, scale = _block_quantize(w, 16, 16)
        deq = q.float() * scale.repeat_interleave(16, 0)[:N].repeat_interleave(16, 1)[:, :K]
    elif scheme == "ct-group":
        q, scale = _block_quantize(w, 1, 16)
        deq = q.float() * scale.repeat_interleave(16, 1)[:, :K]
    elif scheme == "fp8-tensor":
        scale = w.abs().amax() / FP8_MAX
        q = (w / scale).to(FP8_DTYPE)
        deq = q.float() * scale
    else:   # ct-channel: scales [N, 1], stored in bf16 as llm-compressor does
        scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
        q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        deq = q.float() * scale.float()
    return q, scale, deq


QUANTIZATION_CONFIGS = {
    "fp8-block": dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[16, 16]),
    "fp8-tensor": dict(quant_method="fp8", activation_scheme="static"),
    **{f"ct-{strategy}": dict(
        quant_method="compressed-tensors", format="float-quantized", quantization_status="compressed", ignore=["lm_head"],
        config_groups={"group_0": dict(targets=["Linear"], weights=dict(
            num_bits=8, type="float", symmetric=True, dynamic=False, strategy=strategy, **extra),
            input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True))})
       for strategy, extra in [("channel", {}), ("block", dict(block_structure=[16, 16])),
                               ("group", dict(group_size=16))]},
}
SCHEMES = tuple(QUANTIZATION_CONFIGS)


def export(src: Path, dst: Path, scheme: str) -> Path:
    """An fp8 export of the checkpoint at ``src`` in ``scheme``, and beside it (``dst`` + "-deq") the
    float checkpoint of its dequantized weights, the oracle."""
    tensors = read_safetensors(src / "model.safetensors")
    out, deq = {}, {}
    for name, t in tensors.items():
        if not name.endswith(LINEAR):
            out[name] = deq[name] = t
            continue
        q, scale, d = _quantize(t, scheme)
        out[name], deq[name] = q, d
        out[name + ("_scale_inv" if scheme == "fp8-block" else "_scale")] = scale
        if scheme == "fp8-tensor":   # static activation scales: not read
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
    for path, weights in ((dst, out), (Path(str(dst) + "-deq"), deq)):
        copy_checkpoint(src, path)
        write_safetensors(weights, path / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS[scheme]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def logits(model, tokens: list[int] = TOKENS) -> torch.Tensor:
    cache = TargetCache.allocate(model.config, 1, 64, 1, model.dtype, "cpu")
    with torch.no_grad():
        return model(torch.tensor([tokens]), cache, torch.tensor([0]), torch.tensor([0])).logits[0].float()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_fp8_export_serves_the_logits_of_its_dequantized_weights(ckpt, tmp_path, scheme):
    """Read as fp8 whatever ``quantization`` says: every projection holds the export's values and
    scales (per channel, or per channel and K group for block and group scales: never requantized),
    the router is dequantized to the model dtype, and the logits are those of the float checkpoint
    of the dequantized weights."""
    path = export(ckpt.path, tmp_path / scheme, scheme)
    model = load_target(path, dtype=torch.float32)
    oracle = load_target(Path(str(path) + "-deq"), dtype=torch.float32)
    grouped = scheme in ("fp8-block", "ct-block", "ct-group")
    for name, module in target_projections(model).items():
        assert isinstance(module, (Fp8Linear, Fp8MoeExperts)), name
        if isinstance(module, Fp8Linear):
            assert module.weight.dtype == FP8_DTYPE and module.group_size == (16 if grouped else 0)
            want = oracle.get_submodule(name).weight
            assert torch.equal(module.fp8.dequantize(), want), name
        else:
            w13, w2 = module.fp8
            assert torch.equal(w13.dequantize(), oracle.get_submodule(name).w13), name
            assert torch.equal(w2.dequantize(), oracle.get_submodule(name).w2), name
    for name, module in model.named_modules():
        if name.endswith("feed_forward.gate"):
            assert isinstance(module, Linear) and module.weight.dtype == torch.float32
    torch.testing.assert_close(logits(model), logits(oracle), rtol=1e-5, atol=1e-5)


def test_the_declared_layouts(tmp_path):
    def declared(qc):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return checkpoint_quantization(tmp_path)

    assert declared(QUANTIZATION_CONFIGS["fp8-block"]).block == (16, 16)
    assert declared(QUANTIZATION_CONFIGS["fp8-tensor"]).block is None
    assert declared(QUANTIZATION_CONFIGS["ct-group"]).group_size == 16
    assert declared(QUANTIZATION_CONFIGS["ct-channel"]).quant_method == "compressed-tensors"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_quantization(tmp_path) is None


@pytest.mark.parametrize("qc, message", [
    (dict(quant_method="gptq", bits=4), "quant_method 'gptq'"),
    (dict(quant_method="awq", bits=4), "quant_method 'awq'"),
    (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
    ({**QUANTIZATION_CONFIGS["ct-channel"], "config_groups": {"group_0": dict(
        targets=["Linear"], weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128))}},
     "has int 4-bit weights"),
    (dict(quant_method="fp8", weight_block_size=[128]), "weight_block_size"),
])
def test_other_quantizations_are_refused_by_name(dense_ckpt, tmp_path, qc, message):
    path = copy_checkpoint(dense_ckpt.path, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[")):
        load_target(path)


def test_fp8_tensors_without_a_quantization_config_are_refused(dense_ckpt, tmp_path):
    path = export(dense_ckpt.path, tmp_path / "q", "ct-channel")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unexpected tensors"):       # the scales: not declared
        load_target(path)
    tensors = read_safetensors(path / "model.safetensors")
    write_safetensors({k: v for k, v in tensors.items() if not k.endswith("_scale")}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"is torch.float8_e4m3fn .* with no scale"):
        load_target(path)


def test_a_scale_of_the_wrong_shape_is_named(dense_ckpt, tmp_path):
    path = export(dense_ckpt.path, tmp_path / "q", "fp8-block")
    tensors = read_safetensors(path / "model.safetensors")
    name = "model.layers.0.conv.in_proj.weight_scale_inv"
    tensors[name] = tensors[name][:-1]
    write_safetensors(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[11, 4\], expected \[12, 4\]"):
        load_target(path)


def test_a_bf16_checkpoint_is_quantized_at_load(ckpt):
    """``quantization="fp8"``: the projections per output channel (the values of quantize_fp8 on the
    checkpoint's weights); embeddings, norms, conv filters and the router stay in the model dtype."""
    bf16 = load_target(ckpt.path, dtype=torch.bfloat16)
    fp8 = load_target(ckpt.path, dtype=torch.bfloat16, quantization="fp8")
    for name, module in target_projections(fp8).items():
        assert isinstance(module, (Fp8Linear, Fp8MoeExperts)), name
        if isinstance(module, Fp8Linear):
            want = quantize_fp8(bf16.get_submodule(name).weight)
            assert module.group_size == 0 and torch.equal(module.weight_scale, want.scale)
            assert torch.equal(module.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert fp8.model.embed_tokens.weight.dtype == torch.bfloat16 and fp8.lm_head.weight is fp8.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for n, p in fp8.named_parameters() if "norm" in n or "conv_weight" in n)
    a, b = logits(bf16), logits(fp8)
    assert ((a - b).norm() / a.norm()).item() < 0.1


def test_an_unknown_quantization_is_refused(dense_ckpt):
    with pytest.raises(ValueError, match="quantization='int8': use one of fp8"):
        load_target(dense_ckpt.path, quantization="int8")


def test_a_quantized_draft_is_refused(tmp_path):
    from engine_fixtures import save_tiny_draft
    from spec_fixtures import tiny_target_config

    path = save_tiny_draft(tmp_path / "draft")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS["fp8-block"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError, ConfigError), match="quant_method 'fp8'"):
        load_draft(path, tiny_target_config())


def test_block_scales_expand_to_rows_and_k_groups_exactly():
    """What the loader keeps of a block scale (each block row repeated over its rows, per K group)
    dequantizes to the exporter's values."""
    q, scale = _block_quantize(torch.randn(20, 40), 16, 16)
    want = q.float() * scale.repeat_interleave(16, 0)[:20].repeat_interleave(16, 1)[:, :40]
    assert torch.equal(dequantize_fp8(q, scale.repeat_interleave(16, 0)[:20], torch.float32, 16), want)
