"""Load Hugging Face safetensors checkpoints from a local directory into the lfmspark modules.

A checkpoint is one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Every tensor is checked against the shapes the config implies before anything is assembled:
a missing, misshapen or unexpected tensor raises :class:`CheckpointError` naming the tensor, the
expected and the found shape. Weights are converted to the requested dtype except LFM2-MoE's
``expert_bias``, which stays fp32 (reference/lfm2.md §4.4). The on-disk names are HF's; a few are
fused on load (q/k/v → ``qkv_proj``, w1/w3 → ``w13``, per-expert MoE tensors → stacked ``w13``/``w2``,
``conv.conv.weight [H, 1, K]`` → ``conv_weight [H, K]``).

FP8 (models/quant.py): ``load_target(..., quantization="fp8")`` stores the target's projections in
float8 with per-output-channel scales, quantized from the checkpoint's weights. A checkpoint
exported in fp8 is read as such whatever ``quantization`` says (as vLLM does), from the formats of
its ``config.json`` ``quantization_config`` (:func:`checkpoint_quantization`):

- ``quant_method: "fp8"`` (transformers' FineGrainedFP8, vLLM's fp8): ``<name>.weight`` in
  float8_e4m3fn beside ``<name>.weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]`` per block of
  ``weight_block_size`` ``[bn, bk]``, or ``<name>.weight_scale`` per tensor (``[]``, ``[1]``) or
  per output channel (``[N]``, ``[N, 1]``);
- ``quant_method: "compressed-tensors"`` whose weights are 8-bit ``float`` (llm-compressor's FP8,
  FP8_DYNAMIC and FP8_BLOCK schemes): ``<name>.weight_scale`` per tensor, channel, ``block``
  (``block_structure``) or ``group`` (``group_size``).

Every scale is the multiplier that dequantizes (``W = weight * scale``; ``weight_scale_inv`` is
named for the inverse of the quantizing scale). Per-tensor and per-channel scales become
per-channel ones exactly; block and group scales are kept per output channel and K group
(models/quant.py), never requantized. Activation scales (``input_scale``) and KV-cache scales
(``k_scale``, ``v_scale``) are not read: activations and the KV cache stay in the model dtype. The
MoE router, the embeddings, the LM head and any other weight lfmspark keeps in the model dtype
are dequantized to it if the checkpoint stores them in fp8. Any other ``quant_method`` is refused
by name. DSpark drafts are read in the model dtype only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .config import ConfigError, DraftConfig, TargetConfig, read_json_object
from .quant import FP8_DTYPE, QUANTIZATIONS, Fp8Weight, as_fp8, cat_fp8, stack_fp8

log = logging.getLogger("lfmspark")

Shape = tuple[int, ...]


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config; the message names the tensor."""


# ---------------------------------------------------------------------------------------------
# reading files

@contextlib.contextmanager
def _open_safetensors(file: Path, device: str = "cpu") -> Iterator:
    """``safe_open`` with a damaged file (truncated, not safetensors) raised as :class:`CheckpointError`
    naming it."""
    try:
        handle = safe_open(file, framework="pt", device=device)
    except Exception as e:   # safetensors raises its own SafetensorError, or OSError
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e}); the download is "
                              "damaged or incomplete: fetch it again") from None
    with handle as f:
        yield f


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file for a model directory (single file or sharded)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files")
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"shards listed in {index} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def read_shapes(files: dict[str, Path]) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {}
    for file in sorted(set(files.values())):
        with _open_safetensors(file) as f:
            held = set(f.keys())
            for name in held:
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        misplaced = sorted(n for n, where in files.items() if where == file and n not in held)
        if misplaced:
            raise CheckpointError(f"the index maps {misplaced[:3]} to {file.name}, which does not hold them: the index "
                                  "and the shards are from different downloads")
    return shapes


def read_tensors(files: dict[str, Path], names: Iterable[str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read the named tensors, shard by shard, logging progress."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    shards = sorted(by_file)
    for i, file in enumerate(shards):
        log.info("loading %s (%d/%d)", file.name, i + 1, len(shards))
        with _open_safetensors(file, str(device)) as f:
            for name in by_file[file]:
                out[name] = f.get_tensor(name)
    return out


# ---------------------------------------------------------------------------------------------
# expected tensors

def target_tensor_shapes(cfg: TargetConfig) -> dict[str, Shape]:
    """HF tensor names and shapes of a target checkpoint (per-expert MoE layout)."""
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (V, H), "model.embedding_norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "operator_norm.weight"] = (H,)
        shapes[p + "ffn_norm.weight"] = (H,)
        if i in cfg.attention_layers:
            shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * hd, H)
            shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * hd, H)
            shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * hd, H)
            shapes[p + "self_attn.out_proj.weight"] = (H, cfg.num_attention_heads * hd)
            shapes[p + "self_attn.q_layernorm.weight"] = (hd,)
            shapes[p + "self_attn.k_layernorm.weight"] = (hd,)
        else:
            shapes[p + "conv.in_proj.weight"] = (3 * H, H)
            shapes[p + "conv.conv.weight"] = (H, 1, cfg.conv_L_cache)
            shapes[p + "conv.out_proj.weight"] = (H, H)
        f = p + "feed_forward."
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            shapes[f + "gate.weight"] = (cfg.num_experts, H)
            if cfg.use_expert_bias:
                shapes[f + "expert_bias"] = (cfg.num_experts,)
            for j in range(cfg.num_experts):
                shapes[f + f"experts.{j}.w1.weight"] = (I, H)
                shapes[f + f"experts.{j}.w3.weight"] = (I, H)
                shapes[f + f"experts.{j}.w2.weight"] = (H, I)
        else:
            F_ = cfg.intermediate_size
            shapes[f + "w1.weight"] = (F_, H)
            shapes[f + "w3.weight"] = (F_, H)
            shapes[f + "w2.weight"] = (H, F_)
    return shapes


def _accept_packed_experts(cfg: TargetConfig, expected: dict[str, Shape], found: dict[str, Shape]) -> None:
    """Allow transformers-5's in-memory packed expert layout (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``) in place of the per-expert tensors, layer by layer."""
    if not cfg.is_moe:
        return
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    for i in range(cfg.num_hidden_layers):
        f = f"model.layers.{i}.feed_forward.experts."
        if f + "gate_up_proj" in found or f + "down_proj" in found:
            for j in range(E):
                for w in ("w1", "w3", "w2"):
                    expected.pop(f + f"{j}.{w}.weight", None)
            expected[f + "gate_up_proj"] = (E, 2 * I, H)
            expected[f + "down_proj"] = (E, H, I)


def check_tensors(expected: dict[str, Shape], found: dict[str, Shape], where: str,
                  ignorable: Callable[[str], bool] = lambda name: False) -> None:
    """Raise :class:`CheckpointError` on a wrong shape, a missing tensor or an unexpected one."""
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(found[name])}, expected {list(shape)} "
                                  "from config.json: the checkpoint does not match its config")
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"{where}: {len(missing)} tensors missing from the checkpoint, e.g. "
                              f"{missing[:8]}{more}")
    unexpected = [n for n in found if n not in expected and not ignorable(n)]
    if unexpected:
        more = f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
        raise CheckpointError(f"{where}: {len(unexpected)} unexpected tensors the config does not describe, e.g. "
                              f"{unexpected[:8]}{more}: wrong config.json, or an unsupported variant")


# ---------------------------------------------------------------------------------------------
# pre-quantized (fp8) checkpoints

# tensors of fp8 exports that lfmspark does not read: activation scales (activations stay in the
# model dtype) and KV-cache scales (so does the cache)
UNREAD_SCALES = (".input_scale", ".k_scale", ".v_scale")
READ_FORMATS = "quant_method 'fp8', or 'compressed-tensors' with 8-bit float weights"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How an fp8 export stores its weights' scales (config.json's ``quantization_config``): per
    ``block`` ``(bn, bk)`` of the weight, per output channel and ``group_size`` inputs, or (neither)
    per tensor or output channel."""

    quant_method: str
    block: tuple[int, int] | None = None
    group_size: int = 0


def _positive_ints(value: Any, n: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def _compressed_tensors(qc: dict[str, Any], where: str) -> Fp8Checkpoint:
    """The weight layout of a compressed-tensors ``quantization_config`` with 8-bit float weights."""
    what = f"{where}: quantization_config (quant_method 'compressed-tensors')"
    if qc.get("sparsity_config"):
        raise CheckpointError(f"{what} has a sparsity_config: sparse checkpoints are not read ({READ_FORMATS})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{what} has no config_groups naming its weights' scheme")
    layouts = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise CheckpointError(f"{what}: config group {name!r} quantizes no weights ({READ_FORMATS})")
        kind, bits = weights.get("type"), weights.get("num_bits")
        if kind != "float" or bits != 8:
            raise CheckpointError(f"{what}: config group {name!r} has {kind} {bits}-bit weights: lfmspark reads "
                                  f"8-bit float (fp8) weights only ({READ_FORMATS})")
        if weights.get("symmetric") is False or weights.get("dynamic") is True:
            raise CheckpointError(f"{what}: config group {name!r} has asymmetric or dynamic fp8 weights: lfmspark "
                                  "reads symmetric weights with stored scales")
        strategy = weights.get("strategy")
        if strategy in ("tensor", "channel"):
            layouts.add(Fp8Checkpoint("compressed-tensors"))
        elif strategy == "block" and _positive_ints(weights.get("block_structure"), 2):
            layouts.add(Fp8Checkpoint("compressed-tensors", block=tuple(weights["block_structure"])))
        elif strategy == "group" and _positive_ints([weights.get("group_size")], 1):
            layouts.add(Fp8Checkpoint("compressed-tensors", group_size=weights["group_size"]))
        else:
            raise CheckpointError(f"{what}: config group {name!r} has weight strategy {strategy!r} (with "
                                  f"block_structure {weights.get('block_structure')!r}, group_size "
                                  f"{weights.get('group_size')!r}): lfmspark reads tensor, channel, block and group "
                                  "scales")
    if len(layouts) > 1:
        raise CheckpointError(f"{what}: its config groups scale weights differently ({sorted(map(str, layouts))}); "
                              "lfmspark reads one layout per checkpoint")
    return layouts.pop()


def checkpoint_quantization(path: str | Path, where: str = "checkpoint") -> Fp8Checkpoint | None:
    """The fp8 layout config.json's ``quantization_config`` declares (module doc), None for a checkpoint
    without one; any other quantization is refused, naming its ``quant_method``."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    qc = read_json_object(config).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: config.json's quantization_config is a {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and not _positive_ints(block, 2):
            raise CheckpointError(f"{where}: quantization_config weight_block_size {block!r}: expected two positive "
                                  "integers [rows, columns]")
        return Fp8Checkpoint("fp8", block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise CheckpointError(f"{where}: config.json's quantization_config has quant_method {method!r}: lfmspark reads "
                          f"fp8 exports ({READ_FORMATS}), or quantizes a bf16 checkpoint itself (quantization='fp8')")


def _scale_of(weight: str, found: dict[str, Shape]) -> str | None:
    for suffix in ("_scale_inv", "_scale"):
        if weight + suffix in found:
            return weight + suffix
    return None


def _expect_scales(fmt: Fp8Checkpoint | None, expected: dict[str, Shape], found: dict[str, Shape]) -> dict[str, str]:
    """Add the scales of the fp8 weights in ``found`` to ``expected`` with the shapes ``fmt`` gives
    them; returns weight name -> scale name."""
    if fmt is None:
        return {}
    scales: dict[str, str] = {}
    for name, shape in list(expected.items()):
        scale = _scale_of(name, found) if len(shape) == 2 and name.endswith(".weight") else None
        if scale is None:
            continue
        (N, K), got = shape, found[scale]
        if fmt.block:
            bn, bk = fmt.block
            expected[scale] = (-(-N // bn), -(-K // bk))
        elif fmt.group_size:
            expected[scale] = (N, -(-K // fmt.group_size))
        else:   # per tensor or per output channel
            expected[scale] = got if got in ((), (1,), (N,), (N, 1)) else (N,)
        scales[name] = scale
    return scales


def _fp8_weights(hf: dict[str, torch.Tensor], scales: dict[str, str], fmt: Fp8Checkpoint | None,
                 where: str) -> dict[str, Fp8Weight]:
    """Take each fp8 weight and its scale out of ``hf``, as :class:`Fp8Weight` with scales per output
    channel, or per output channel and K group (block and group scales; exact either way)."""
    out: dict[str, Fp8Weight] = {}
    for name, scale_name in scales.items():
        weight, scale = hf.pop(name), hf.pop(scale_name).float()
        if weight.dtype != FP8_DTYPE:
            raise CheckpointError(f"{where}: tensor '{name}' is {weight.dtype} beside its scale '{scale_name}': lfmspark "
                                  f"reads {FP8_DTYPE} weights")
        N, K = weight.shape
        if fmt.block:
            bn, bk = fmt.block
            rows = scale.repeat_interleave(bn, dim=0)[:N]
            w = Fp8Weight(weight, rows.contiguous(), bk)
        elif fmt.group_size:
            w = Fp8Weight(weight, scale.contiguous(), fmt.group_size)
        else:
            w = Fp8Weight(weight, scale.reshape(-1).expand(N).contiguous() if scale.numel() == 1 else scale.reshape(N))
        if not w.per_channel and w.scale.shape[-1] == 1:   # one group spans the row: per channel
            w = Fp8Weight(weight, w.scale[:, 0].contiguous())
        out[name] = w
    return out


def _plain(t: torch.Tensor | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight lfmspark keeps in the model dtype (dequantized if the checkpoint holds it in fp8)."""
    return t.dequantize(dtype) if isinstance(t, Fp8Weight) else t


def _fused(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Weights fused along their output channels: fp8 if any part is (models/quant.py ``cat_fp8``)."""
    return cat_fp8(parts) if any(isinstance(p, Fp8Weight) for p in parts) else torch.cat(parts)


def _stacked(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    return stack_fp8(parts) if any(isinstance(p, Fp8Weight) for p in parts) else torch.stack(parts)


def _install_fp8(model: nn.Module, state: dict[str, torch.Tensor | Fp8Weight]) -> int:
    """Replace each projection of ``model`` (built on the meta device) whose state is fp8 by its fp8
    module, and put that module's tensors in ``state`` (as :func:`_assign` expects them). Returns
    how many were installed."""
    from .layers import Fp8Linear
    from .lfm2_moe import Fp8MoeExperts, Lfm2MoeExperts, target_projections

    installed = 0
    for name, module in target_projections(model).items():
        keys = (f"{name}.w13", f"{name}.w2") if isinstance(module, Lfm2MoeExperts) else (f"{name}.weight",)
        if not any(isinstance(state.get(k), Fp8Weight) for k in keys):
            continue
        parts = [as_fp8(state.pop(k)) for k in keys]
        fp8 = Fp8MoeExperts(*parts) if isinstance(module, Lfm2MoeExperts) else Fp8Linear(*parts)
        model.set_submodule(name, fp8)
        state.update({f"{name}.{k}": v for k, v in fp8.named_parameters()})
        installed += 1
    return installed


# ---------------------------------------------------------------------------------------------
# HF names -> module state

def _fuse_target(cfg: TargetConfig, hf: dict[str, torch.Tensor | Fp8Weight], dtype: torch.dtype
                 ) -> dict[str, torch.Tensor | Fp8Weight]:
    """Module state dict from HF tensors (already in the target dtype, but for fp8 weights: the
    projections keep them, fused as fp8; any other weight is dequantized to ``dtype``)."""
    state: dict[str, torch.Tensor | Fp8Weight] = {}
    for name in list(hf):
        if name.startswith("model.layers."):
            continue
        state[name] = _plain(hf.pop(name), dtype)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        take = lambda key: hf.pop(p + key)  # noqa: E731
        plain = lambda key: _plain(take(key), dtype)  # noqa: E731
        state[p + "operator_norm.weight"] = plain("operator_norm.weight")
        state[p + "ffn_norm.weight"] = plain("ffn_norm.weight")
        if i in cfg.attention_layers:
            a = "self_attn."
            state[p + a + "qkv_proj.weight"] = _fused(
                [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
            state[p + a + "out_proj.weight"] = take(a + "out_proj.weight")
            for key in ("q_layernorm.weight", "k_layernorm.weight"):
                state[p + a + key] = plain(a + key)
        else:
            state[p + "conv.in_proj.weight"] = take("conv.in_proj.weight")
            state[p + "conv.out_proj.weight"] = take("conv.out_proj.weight")
            state[p + "conv.conv_weight"] = plain("conv.conv.weight").squeeze(1)
        f = "feed_forward."
        if cfg.is_moe_layer(i):
            state[p + f + "gate.weight"] = plain(f + "gate.weight")
            if cfg.use_expert_bias:
                state[p + f + "expert_bias"] = take(f + "expert_bias")
            if p + f + "experts.gate_up_proj" in hf:
                state[p + f + "experts.w13"] = take(f + "experts.gate_up_proj")
                state[p + f + "experts.w2"] = take(f + "experts.down_proj")
            else:
                E = cfg.num_experts
                state[p + f + "experts.w13"] = _stacked([
                    _fused([take(f + f"experts.{j}.w1.weight"), take(f + f"experts.{j}.w3.weight")])
                    for j in range(E)])
                state[p + f + "experts.w2"] = _stacked([take(f + f"experts.{j}.w2.weight") for j in range(E)])
        else:
            state[p + f + "w13.weight"] = _fused([take(f + "w1.weight"), take(f + "w3.weight")])
            state[p + f + "w2.weight"] = take(f + "w2.weight")
    return state


def _convert(tensors: dict[str, torch.Tensor], dtype: torch.dtype, keep_fp32: Callable[[str], bool]) -> None:
    """Cast floating-point weights to the serving dtype. Integer or bool tensors are refused, not
    converted: LFM2 checkpoints hold float weights only, so one is a quantized export lfmspark does
    not read (its values are not weights) or a damaged file, and casting it would serve garbage."""
    bad = [(name, t.dtype) for name, t in tensors.items() if not t.dtype.is_floating_point]
    if bad:
        raise CheckpointError(f"tensor '{bad[0][0]}' is {bad[0][1]} ({len(bad)} non-float tensors): lfmspark serves "
                              "float (bf16 / fp16 / fp32) checkpoints; a quantized export cannot be loaded")
    # 8-bit floats are quantized values: without their scale (read before this, with the
    # quantization_config that declares them) casting them would serve wrong weights
    fp8 = [(name, t.dtype) for name, t in tensors.items() if t.element_size() == 1]
    if fp8:
        raise CheckpointError(f"tensor '{fp8[0][0]}' is {fp8[0][1]} ({len(fp8)} 8-bit float tensors) with no scale "
                              f"read beside it: lfmspark reads fp8 exports whose config.json declares a "
                              f"quantization_config ({READ_FORMATS}), for the target only")
    for name, t in tensors.items():
        target = torch.float32 if keep_fp32(name) else dtype
        if t.dtype != target:
            tensors[name] = t.to(target)


def check_kernel_shapes(cfg: TargetConfig | DraftConfig, device: torch.device | str, where: str) -> None:
    """Refuse, before any weight is read, a model whose shapes the CUDA kernels do not take (on the
    CPU the ops run their PyTorch references, which take any even head_dim): the attention kernels
    (ops/attention) need a head_dim that is a power of two of at least 16, the ShortConv prefill
    kernel (ops/short_conv.py) a conv_L_cache of at most ``MAX_CONV_WIDTH``."""
    if torch.device(device).type != "cuda":
        return
    from ..ops.short_conv import MAX_CONV_WIDTH

    hd = cfg.head_dim
    if hd < 16 or hd & (hd - 1):
        raise ConfigError(f"{where}: config field 'head_dim' is {hd}: the CUDA attention kernels take a power of two "
                          "of at least 16 (16, 32, 64, 128, ...); this model can run on the CPU only")
    if isinstance(cfg, TargetConfig) and cfg.conv_L_cache > MAX_CONV_WIDTH:
        raise ConfigError(f"{where}: config field 'conv_L_cache' is {cfg.conv_L_cache}: the CUDA ShortConv kernel "
                          f"takes at most {MAX_CONV_WIDTH}; this model can run on the CPU only")


def _assign(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into a module built on the meta device (tensors are adopted, not copied)."""
    result = module.load_state_dict(state, strict=False, assign=True)
    # tied lm_head is absent from the state on purpose; anything else missing is a bug here
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"internal name mapping error: missing {missing}, unexpected {result.unexpected_keys}")


def load_target(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                cfg: TargetConfig | None = None, quantization: str | None = None):
    """Build the target module for ``path`` and load its weights (``cfg`` defaults to its config.json).
    ``quantization="fp8"``: the projections in fp8 (module doc); an fp8 export is read as fp8 anyway."""
    from .lfm2_moe import build_target, quantize_target

    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization={quantization!r}: use one of {', '.join(QUANTIZATIONS)}, or None (the "
                         "checkpoint's own weights)")
    cfg = cfg or TargetConfig.from_pretrained(path)
    where = f"target checkpoint {path}"
    check_kernel_shapes(cfg, device, where)
    fmt = checkpoint_quantization(path, where)
    files = checkpoint_files(path)
    found = read_shapes(files)
    expected = target_tensor_shapes(cfg)
    _accept_packed_experts(cfg, expected, found)
    scales = _expect_scales(fmt, expected, found)
    tied_head = lambda name: name == "lm_head.weight" and cfg.tie_word_embeddings  # noqa: E731
    unread = lambda name: fmt is not None and name.endswith(UNREAD_SCALES)  # noqa: E731
    check_tensors(expected, found, where,
                  ignorable=lambda n: tied_head(n) or n.endswith("rotary_emb.inv_freq") or unread(n))
    if "lm_head.weight" in found and cfg.tie_word_embeddings and found["lm_head.weight"] != expected[
            "model.embed_tokens.weight"]:
        raise CheckpointError(f"target checkpoint {path}: 'lm_head.weight' has shape {list(found['lm_head.weight'])}"
                              f", expected {list(expected['model.embed_tokens.weight'])}")

    hf = read_tensors(files, expected, device)
    fp8 = _fp8_weights(hf, scales, fmt, where)
    _convert(hf, dtype, keep_fp32=lambda n: n.endswith("expert_bias"))
    with torch.device("meta"):
        model = build_target(cfg)
    state = _fuse_target(cfg, {**hf, **fp8}, dtype)
    if fp8:
        installed = _install_fp8(model, state)
        log.info("%s: fp8 export (quant_method %r): %d tensors in fp8, %d projections served in fp8", where,
                 fmt.quant_method, len(fp8), installed)
    _assign(model, state)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quantization == "fp8":
        quantize_target(model)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# DSpark drafts

DRAFT_SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")


def draft_tensor_shapes(cfg: DraftConfig, target_hidden: int) -> dict[str, Shape]:
    """Tensor names and shapes of a DSpark draft checkpoint (DeepSpec names, no ``model.`` prefix)."""
    H, hd, r = cfg.hidden_size, cfg.head_dim, cfg.markov_rank
    V = cfg.vocab_size
    shapes: dict[str, Shape] = {
        "fc.weight": (H, cfg.n_taps * target_hidden),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * hd, H)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * hd, H)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * hd, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, cfg.num_attention_heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, H)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, H)
        shapes[p + "mlp.down_proj.weight"] = (H, cfg.intermediate_size)
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (V, r)
        shapes["markov_head.markov_w2.weight"] = (V, r)
        if cfg.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, H + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
        elif cfg.markov_head_type == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + H)
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg.enable_confidence_head:
        width = H + r if cfg.confidence_head_with_markov else H
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def _strip_prefix(found: dict[str, Shape]) -> dict[str, str]:
    """Map stored names to DeepSpec names: drop a leading ``model.`` (some exports add it) and
    ``_orig_mod.`` (torch.compile wrappers saved by accident)."""
    mapping = {}
    for name in found:
        short = name.replace("_orig_mod.", "")
        if short.startswith("model."):
            short = short[len("model."):]
        mapping[short] = name
    return mapping


def load_draft(path: str | Path, target_cfg: TargetConfig, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", cfg: DraftConfig | None = None):
    """Build a DSpark draft for ``target_cfg`` from ``path`` and load its weights.

    The embedding and LM head are the target's (attached by the engine); copies stored in the
    draft checkpoint are checked for shape and skipped.
    """
    from .dspark import DSparkDraft, check_draft_fits_target

    cfg = cfg or DraftConfig.from_pretrained(path)
    config = Path(path) / "config.json"
    qc = read_json_object(config).get("quantization_config") if config.is_file() else None
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(f"draft checkpoint {path}: quantized (quant_method {method!r}): drafts are read in the "
                              "model dtype; use the draft's bf16 export")
    if cfg.vocab_size is None:
        cfg = DraftConfig(**{**cfg.__dict__, "vocab_size": target_cfg.vocab_size})
    check_draft_fits_target(cfg, target_cfg)
    check_kernel_shapes(cfg, device, f"draft checkpoint {path}")
    files = checkpoint_files(path)
    stored = read_shapes(files)
    names = _strip_prefix(stored)
    found = {short: stored[full] for short, full in names.items()}
    expected = draft_tensor_shapes(cfg, target_cfg.hidden_size)
    for short, shape in found.items():
        if short.startswith(("embed_tokens.", "lm_head.")) and shape != (target_cfg.vocab_size,
                                                                         target_cfg.hidden_size):
            raise CheckpointError(f"draft checkpoint {path}: '{names[short]}' has shape {list(shape)}, but the "
                                  f"target's vocabulary is [{target_cfg.vocab_size}, {target_cfg.hidden_size}]: the "
                                  "draft was trained for another target")
    check_tensors(expected, found, f"draft checkpoint {path}",
                  ignorable=lambda n: n.startswith(DRAFT_SHARED_PREFIXES))
    raw = read_tensors(files, [names[n] for n in expected], device)
    hf = {short: raw[names[short]] for short in expected}
    _convert(hf, dtype, keep_fp32=lambda n: False)
    with torch.device("meta"):
        draft = DSparkDraft(cfg, target_hidden=target_cfg.hidden_size)
    _assign_draft(draft, hf)
    return draft.eval()


def _assign_draft(draft: nn.Module, hf: dict[str, torch.Tensor]) -> None:
    L = draft.config.num_hidden_layers
    state = {k: v for k, v in hf.items() if not k.startswith("layers.")}
    state["kv_proj"] = torch.stack([
        torch.cat([hf[f"layers.{i}.self_attn.k_proj.weight"], hf[f"layers.{i}.self_attn.v_proj.weight"]])
        for i in range(L)])
    state["k_norm"] = torch.stack([hf[f"layers.{i}.self_attn.k_norm.weight"] for i in range(L)])
    for i in range(L):
        p = f"layers.{i}."
        for key in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                    "self_attn.o_proj.weight", "self_attn.q_norm.weight"):
            state[p + key] = hf[p + key]
        state[p + "mlp.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        state[p + "mlp.w13.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    result = draft.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"internal draft name mapping error: missing {result.missing_keys}, "
                              f"unexpected {result.unexpected_keys}")


__all__ = ["CheckpointError", "ConfigError", "Fp8Checkpoint", "load_target", "load_draft", "checkpoint_files",
           "checkpoint_quantization", "target_tensor_shapes", "draft_tensor_shapes"]
