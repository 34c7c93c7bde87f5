"""Helpers shared by the model tests: tiny random Hugging Face LFM2 / LFM2-MoE checkpoints.

The oracle for every target test is transformers itself (``Lfm2ForCausalLM`` and
``Lfm2MoeForCausalLM`` with ``experts_implementation="eager"``, default attention, no hub kernels:
the ``kernels`` package is not installed). The HF models are built from a config dict, given
random weights that make every layer matter (norm scales around 1, ``fan_in**-0.5`` matrices,
conv taps with a large std, a unit-variance embedding, a non-zero fp32 expert bias), and written
with ``save_pretrained`` so that our loader reads exactly what transformers writes.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file
from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

CONV, ATTN = "conv", "full_attention"

# hidden 64, heads 4 / kv 2 (head_dim 16), conv and attention layers, a conv layer after an
# attention layer. The FFN width goes through HF's auto-adjust rule: int(2 * 150 / 3) = 100,
# rounded up to a multiple of 32 -> 128 (so the parity tests also check that rule end to end).
TINY_DENSE: dict = dict(
    model_type="lfm2", vocab_size=128, hidden_size=64, intermediate_size=150, block_auto_adjust_ff_dim=True,
    block_multiple_of=32, block_ffn_dim_multiplier=1.0, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, layer_types=[CONV, ATTN, CONV, ATTN], max_position_embeddings=256, norm_eps=1e-5,
    conv_L_cache=3, conv_bias=False, tie_word_embeddings=True, rope_parameters={"rope_theta": 10000.0,
                                                                                "rope_type": "default"},
    bos_token_id=1, eos_token_id=7, pad_token_id=0,
)

# a dense first layer, then MoE layers (4 experts, top-2) on conv and attention layers alike
TINY_MOE: dict = dict(
    model_type="lfm2_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, layer_types=[CONV, ATTN, CONV, ATTN],
    num_dense_layers=1, num_experts=4, num_experts_per_tok=2, use_expert_bias=True, norm_topk_prob=True,
    routed_scaling_factor=1.0, max_position_embeddings=256, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
    tie_word_embeddings=True, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    bos_token_id=1, eos_token_id=7, pad_token_id=0,
)


def hf_config(d: dict):
    d = {k: v for k, v in copy.deepcopy(d).items() if k != "model_type"}
    return Lfm2MoeConfig(**d) if "num_experts" in d else Lfm2Config(**d)


def build_hf(d: dict, seed: int = 0, embed_std: float = 1.0, residual_std: float = 1.0):
    """A randomly initialised HF model (fp32, eval mode) for a config dict."""
    cfg = hf_config(d)
    torch.manual_seed(seed)
    if isinstance(cfg, Lfm2MoeConfig):
        model = Lfm2MoeForCausalLM._from_config(cfg, experts_implementation="eager")
    else:
        model = Lfm2ForCausalLM(cfg)
    randomize_(model, seed, embed_std, residual_std)
    return model.eval()


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, embed_std: float = 1.0, residual_std: float = 1.0) -> None:
    """Weights with which every layer changes the logits (HF's 0.02-std init leaves the conv
    blocks almost inert). ``embed_std`` sets the logit scale (tied LM head); ``residual_std``
    scales the projections that write into the residual stream (``out_proj``, ``w2``, experts'
    ``down_proj``), which keeps deep random models well conditioned."""
    residual_writers = ("out_proj.weight", "feed_forward.w2.weight", "experts.down_proj")
    g = torch.Generator().manual_seed(seed + 1000)

    def normal_(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):               # operator/ffn/embedding norms, q/k layernorms
            normal_(p, 1.0, 0.2)
        elif name.endswith("conv.conv.weight"):
            normal_(p, 0.0, 0.5)
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            normal_(p, 0.0, embed_std)
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            normal_(p, 0.0, p.shape[-1] ** -0.5 * (residual_std if name.endswith(residual_writers) else 1.0))
        elif p.dim() == 2:
            normal_(p, 0.0, p.shape[1] ** -0.5 * (residual_std if name.endswith(residual_writers) else 1.0))
        else:
            raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            normal_(b, 0.0, 0.1)


@dataclass
class HFCheckpoint:
    path: Path
    model: torch.nn.Module      # the HF model (fp32) whose save_pretrained wrote ``path``
    config: dict                # the dict it was built from


def save_hf(model, path: Path, **kw) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **kw)
    return path


def make_checkpoint(tmp_root: Path, name: str, d: dict, seed: int = 0, embed_std: float = 1.0,
                    residual_std: float = 1.0, expert_bias: list[float] | None = None, **save_kw) -> HFCheckpoint:
    model = build_hf(d, seed, embed_std, residual_std)
    if expert_bias is not None:
        with torch.no_grad():
            for name_, buf in model.named_buffers():
                if name_.endswith("expert_bias"):
                    buf.copy_(torch.tensor(expert_bias))
    return HFCheckpoint(save_hf(model, tmp_root / name, **save_kw), model, copy.deepcopy(d))


def hf_reference(ckpt: HFCheckpoint, dtype: torch.dtype):
    """The HF model in ``dtype``: the fp32 model itself, or ``from_pretrained(dtype=...)`` (which
    keeps MoE ``expert_bias`` in fp32, as HF does for real checkpoints)."""
    if dtype == torch.float32:
        return ckpt.model
    cls = Lfm2MoeForCausalLM if "num_experts" in ckpt.config else Lfm2ForCausalLM
    kw = dict(experts_implementation="eager") if cls is Lfm2MoeForCausalLM else {}
    return cls.from_pretrained(ckpt.path, dtype=dtype, **kw).eval()


# ---------------------------------------------------------------------------------------------
# checkpoint surgery helpers

def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------
# driving our model row by row, with HF full-sequence logits as the reference

def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """HF logits ``[len, V]`` (fp32) of one sequence run alone, without padding or cache."""
    with torch.no_grad():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


def hf_hidden(hf, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """HF ``output_hidden_states`` of one sequence: entry 0 = embeddings, entry k+1 = output of layer k."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=False, output_hidden_states=True)
    return tuple(h[0].float() for h in out.hidden_states)


def pad_batch(seqs: list[list[int]], vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Right-padded ``[B, T]`` ids; the padding columns hold random tokens (they must not leak)."""
    T = max(max(len(s) for s in seqs), 1)
    ids = torch.randint(0, vocab, (len(seqs), T), generator=gen)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids


def rand_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()
