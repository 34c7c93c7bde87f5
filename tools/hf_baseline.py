"""Hugging Face transformers baselines on the same weights as an lfmspark target.

The benchmark compares against HF ``generate``: the lfmspark module's weights are mapped back to HF
names (un-fusing qkv / w13, un-squeezing the conv taps; LFM2-MoE experts use transformers 5's packed
``gate_up_proj`` / ``down_proj`` layout, which equals ours) and adopted by an HF model without copying.

Eager ``generate`` runs in the benchmark's process. A static cache with ``torch.compile`` runs in a
child process (``python -m lfmspark.tools.hf_baseline``): under ``mode="reduce-overhead"`` HF's
static-cache ``generate`` on LFM2 segfaults with torch 2.11 / transformers 5.17 (the conv-state
update is a mutated input, CUDA graphs are skipped, then the process dies), which would take the
whole benchmark down with it. In a child, a crash or an over-long compile becomes a failed attempt
with its reason, the benchmark's own numbers survive, and the baseline's compile settings (Dynamo
limits, CUDA-graph trees) cannot leak into the engine's. The child runs with ``faulthandler`` on, so
a native crash still reports the Python frames it happened in. It rebuilds the same target from the
same :class:`EngineConfig` (the same checkpoint, or the same preset from the same seed), and prints
one JSON line (``{"ttft_ms": ..., "tpot_ms": ...}``) as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from ..runtime.config import EngineConfig
from ..runtime.loader import load_models

log = logging.getLogger("lfmspark")

_STDERR_TAIL_LINES = 6
# tried in order by the benchmark: CUDA graphs first (the fast HF configuration), then without them
COMPILE_MODES = ("reduce-overhead", "default")


@dataclass
class BaselineShape:
    """What a baseline times: ``batch`` prompts of ``prompt_len`` random tokens (from ``seed``), up to
    64 new tokens (``output_len`` caps it), the median of ``runs`` (at most 3)."""

    batch: int
    prompt_len: int
    output_len: int
    runs: int
    seed: int


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """HF-named tensors (views of ``model``'s weights) for an lfmspark target module. An fp8 target's
    projections are dequantized to the model dtype (copies): transformers then runs the same weight
    values in the model dtype."""
    from ..models.layers import Fp8Linear
    from ..models.lfm2_moe import Fp8MoeExperts

    cfg = model.config
    hd, n_h, n_kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    ours = dict(model.named_parameters())
    ours.update(dict(model.named_buffers()))
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            del ours[name + ".weight_scale"]
            ours[name + ".weight"] = module.fp8.dequantize(model.dtype)
        elif isinstance(module, Fp8MoeExperts):
            del ours[name + ".w13_scale"], ours[name + ".w2_scale"]
            ours[name + ".w13"], ours[name + ".w2"] = module.stacks(model.dtype)
    out: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".self_attn.qkv_proj." in name:
            q, k, v = t.split([n_h * hd, n_kv * hd, n_kv * hd])
            base = name.replace("qkv_proj.weight", "")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = q, k, v
        elif name.endswith("feed_forward.w13.weight"):
            w1, w3 = t.chunk(2)
            base = name.replace("w13.weight", "")
            out[base + "w1.weight"], out[base + "w3.weight"] = w1, w3
        elif name.endswith("conv.conv_weight"):
            out[name.replace("conv.conv_weight", "conv.conv.weight")] = t[:, None, :]
        elif name.endswith("experts.w13"):
            out[name.replace("experts.w13", "experts.gate_up_proj")] = t
        elif name.endswith("experts.w2"):
            out[name.replace("experts.w2", "experts.down_proj")] = t
        else:
            out[name] = t
    return out


def hf_model_like(model, experts_implementation: str | None = None):
    """An HF ``Lfm2ForCausalLM`` / ``Lfm2MoeForCausalLM`` sharing ``model``'s weights. MoE models use
    transformers' default experts implementation unless one is named (parity tests use "eager",
    the benchmark the fast default)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model.config.to_hf_dict()
    model_type = d.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **d)
    kwargs = {"experts_implementation": experts_implementation} if model.config.is_moe and experts_implementation else {}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=model.dtype, **kwargs)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    missing = [m for m in missing if not m.endswith(("inv_freq", "lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    # rotary tables are non-persistent buffers computed at construction: rebuild them for real
    # (the attribute is rotary_emb or pos_emb depending on the model and transformers version)
    for parent in list(hf.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                with torch.device(model.device):
                    setattr(parent, child_name, type(child)(hf_cfg))
    for name, buf in hf.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"HF buffer {name} was not materialised")
    return hf.eval()


@torch.no_grad()
def time_hf_generate(hf, prompts: torch.Tensor, new_tokens: int, runs: int) -> dict:
    """Median TTFT (1-token generate) and TPOT of HF greedy ``generate`` for a batch of equal-length
    prompts ``[B, P]``."""
    mask = torch.ones_like(prompts)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> float:
        if prompts.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, **kw)
        if prompts.is_cuda:
            torch.cuda.synchronize()
        assert out.shape[1] == prompts.shape[1] + n
        return time.perf_counter() - t0

    # warm-up at the full length: HF's first long generate pays one-time costs (the LFM2.5-1.2B
    # batch-1 TPOT read 57 ms with a 2-token warm-up and 2 runs, 15 ms with 3 runs, i.e. once the slow
    # first call was no longer the median); compilation happens here too
    timed(new_tokens)
    timed(1)
    ttft = sorted(timed(1) for _ in range(runs))[runs // 2]
    full = sorted(timed(new_tokens) for _ in range(runs))[runs // 2]
    if new_tokens > 1 and full <= ttft:
        raise RuntimeError(f"HF generate timing: {new_tokens} tokens took {full * 1e3:.2f} ms, no longer than one token "
                           f"({ttft * 1e3:.2f} ms): the machine's noise exceeds the decode time; use more output "
                           "tokens or runs")
    tpot = (full - ttft) / max(new_tokens - 1, 1)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3}


def time_baseline(target, shape: BaselineShape, device: torch.device, compile_mode: str | None = None) -> dict:
    """HF's timings for ``target`` at ``shape``: eager ``generate``, or with a static cache and
    ``torch.compile(mode=compile_mode)``. Returns :func:`time_hf_generate`'s timings."""
    hf = hf_model_like(target)
    if compile_mode:
        hf.generation_config.cache_implementation = "static"
        hf.forward = torch.compile(hf.forward, mode=compile_mode, fullgraph=True)
    prompts = torch.randint(0, target.config.vocab_size, (shape.batch, shape.prompt_len),
                            generator=torch.Generator().manual_seed(shape.seed)).to(device)
    return time_hf_generate(hf, prompts, min(shape.output_len, 64), runs=max(1, min(shape.runs, 3)))


# -- the child process --------------------------------------------------------------------------

class BaselineTimeout(Exception):
    pass


class BaselineFailed(Exception):
    pass


def child_command(config: EngineConfig, shape: BaselineShape, compile_mode: str | None) -> list[str]:
    cmd = [sys.executable, "-X", "faulthandler", "-m", "lfmspark.tools.hf_baseline",
           "--config", json.dumps(config.as_dict()), "--shape", json.dumps(shape.__dict__)]
    return cmd + (["--compile-mode", compile_mode] if compile_mode else [])


def _crash_report(stderr: str) -> str:
    """The innermost frames of a faulthandler dump when there is one, else the end of stderr."""
    lines = stderr.strip().splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    picked = lines[fatal:fatal + _STDERR_TAIL_LINES] if fatal is not None else lines[-_STDERR_TAIL_LINES:]
    return " | ".join(line.strip() for line in picked)


def run_baseline(config: EngineConfig, shape: BaselineShape, compile_mode: str | None, timeout_s: float) -> dict:
    """Time one HF baseline in a child process (module doc). Returns ``{"ttft_ms", "tpot_ms"}``;
    raises :class:`BaselineTimeout` past ``timeout_s`` and :class:`BaselineFailed` (with the exit
    status and the crash site or the end of the child's stderr) when the child dies or reports no
    result."""
    cmd = child_command(config, shape, compile_mode)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired as e:
        raise BaselineTimeout(f"did not finish within {timeout_s:g} s (--hf-compile-timeout)") from e
    if done.returncode != 0:
        status = f"exit code {done.returncode}"
        if done.returncode < 0:
            status = f"killed by {signal.Signals(-done.returncode).name}"
        raise BaselineFailed(f"child process {status}: {_crash_report(done.stderr)}")
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
        return {"ttft_ms": float(result["ttft_ms"]), "tpot_ms": float(result["tpot_ms"])}
    except (IndexError, ValueError, KeyError, TypeError) as e:
        raise BaselineFailed(f"child printed no result line (stdout ended with {lines[-1:]!r})") from e


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="time one HF baseline (the benchmark's child process)")
    p.add_argument("--config", required=True, help="the target's EngineConfig as JSON")
    p.add_argument("--shape", required=True, help="the BaselineShape as JSON")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, help="static cache + torch.compile in this mode "
                   "(default: eager generate)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = EngineConfig(**json.loads(args.config)).replace(draft=None, draft_preset=None)
    target = load_models(config).target
    timing = time_baseline(target, BaselineShape(**json.loads(args.shape)), config.torch_device(), args.compile_mode)
    print(json.dumps(timing), flush=True)


if __name__ == "__main__":
    main()
