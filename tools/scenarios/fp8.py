"""``lfmspark bench fp8``: what FP8 weights cost in quality and save in memory.

The target in the model dtype against the same weights quantized as ``quantization="fp8"`` serves
them (models/quant.py: the projections and MoE experts in e4m3 with per-channel scales), both
teacher-forced over ``num_prompts`` random prompts of ``prompt_len`` tokens. At every position: the
KL divergence of the fp8 target's next-token distribution from the model dtype's (mean, p99, max),
whether the greedy tokens agree, and the logits' relative error (Frobenius, over all positions).
Per quantized weight, the relative error of its dequantized fp8 values against the original: the
relative error of its products on isotropic inputs. And the weight bytes of both targets. Where
the model dtype is fp32 (a CPU run), the same drift of the target with its projections rounded to
bf16 is the control: how much this network amplifies a weight rounding of known size.

On a random-weight preset these are a random network's distributions: they show what the rounding
does to a network of the model's shape, not a checkpoint's quality on text, which is the model
vendor's number to quote for their fp8 export.

The report (``--json``): ``scenario``, ``environment``, ``config``, ``models``, ``positions``,
``weight_bytes`` (``model_dtype``, ``fp8``; ``projections_model_dtype``, ``projections_fp8``: the
quantized modules alone), ``reference`` (the model dtype's distributions: ``entropy_mean``,
``entropy_max`` (uniform), ``top1_prob_mean``), ``logits`` (the fp8 target's drift: ``rel_err``,
``kl_mean``, ``kl_p99``, ``kl_max``, ``greedy_agreement``), ``bf16_control`` (the same for bf16
projections, or null), ``modules``: one row per quantized weight with ``name`` and ``weight_rel_err``
(the MoE experts: one per stack).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...models.cache import TargetCache
from ...models.lfm2_moe import Lfm2MoeExperts, quantize_target, target_projections
from ...models.quant import relative_error
from ...runtime.loader import load_models
from ..bench import module_bytes
from .common import ScenarioConfig, new_report, random_prompts, write_report

log = logging.getLogger("lfmspark")

NAME = "fp8"
SUMMARY = "quality (KL, greedy agreement, weight errors) and weight memory of the fp8 target against the model dtype"
SHARED = {"prompt_len": 1024, "num_prompts": 4, "json": None}


@dataclass
class Fp8Config(ScenarioConfig):
    prompt_len: int = SHARED["prompt_len"]
    num_prompts: int = SHARED["num_prompts"]


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The scenario has no flags of its own."""
    return []


def config(args: argparse.Namespace, **common) -> Fp8Config:
    return Fp8Config(prompt_len=args.prompt_len, num_prompts=args.num_prompts, json_path=args.json, **common)


def run(cfg: Fp8Config) -> dict:
    if cfg.num_prompts < 1 or cfg.prompt_len < 2:
        raise ValueError(f"fp8 scenario: --num-prompts must be at least 1 and --prompt-len at least 2, got "
                         f"{cfg.num_prompts} and {cfg.prompt_len}")
    engine_cfg = cfg.engine.replace(quantization=None, draft=None, draft_preset=None)
    models = load_models(engine_cfg)
    full = models.target
    fp8 = copy.deepcopy(full)
    if quantize_target(fp8) == 0:
        raise ValueError("fp8 scenario: the target's projections are stored in fp8 already (an fp8 export); "
                         "compare its model-dtype checkpoint instead")
    device, dtype = engine_cfg.torch_device(), engine_cfg.torch_dtype()
    report = new_report(NAME, cfg, models, engine_cfg)

    mods_full, mods_fp8 = target_projections(full), target_projections(fp8)
    rows = []
    for name, module in mods_full.items():
        quantized = mods_fp8[name].fp8
        pairs = ([(f"{name}.w13", module.w13, quantized[0]), (f"{name}.w2", module.w2, quantized[1])]
                 if isinstance(module, Lfm2MoeExperts) else [(name, module.weight, quantized)])
        rows += [{"name": n, "weight_rel_err": relative_error(w.detach(), q)} for n, w, q in pairs]
    report["modules"] = rows
    report["weight_bytes"] = {
        "model_dtype": module_bytes(full), "fp8": module_bytes(fp8),
        "projections_model_dtype": sum(module_bytes(m) for m in mods_full.values()),
        "projections_fp8": sum(module_bytes(m) for m in mods_fp8.values())}

    # the control: the model dtype's own rounding, where it is fp32 (bf16 projections)
    variants = {"fp8": fp8}
    if dtype == torch.float32:
        variants["bf16"] = copy.deepcopy(full)
        with torch.no_grad():
            for module in target_projections(variants["bf16"]).values():
                for w in module.parameters():
                    w.copy_(w.to(torch.bfloat16))
    drift = {name: _Drift() for name in variants}
    entropy, top1 = [], []
    for i, prompt in enumerate(random_prompts(cfg.num_prompts, cfg.prompt_len, full.config.vocab_size,
                                              engine_cfg.seed + 7)):
        ids = torch.tensor([prompt], device=device)
        a = _logits(full, ids, cfg.prompt_len, dtype)
        p = a.softmax(-1)
        entropy.append(-(p * a.log_softmax(-1)).sum(-1))
        top1.append(p.amax(-1))
        for name, model in variants.items():
            drift[name].add(a, _logits(model, ids, cfg.prompt_len, dtype))
        log.info("fp8 scenario: prompt %d of %d", i + 1, cfg.num_prompts)
    report["positions"] = cfg.num_prompts * cfg.prompt_len
    report["reference"] = {"entropy_mean": torch.cat(entropy).mean().item(),
                           "entropy_max": math.log(full.config.vocab_size),
                           "top1_prob_mean": torch.cat(top1).mean().item()}
    report["logits"] = drift["fp8"].summary()
    report["bf16_control"] = drift["bf16"].summary() if "bf16" in drift else None
    write_report(report, cfg.json_path)
    return report


def _logits(model, ids: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Every position's next-token logits of one prompt ``ids [1, T]``, fp32 ``[T, V]``."""
    cache = TargetCache.allocate(model.config, 1, length, 1, dtype, ids.device)
    zero = torch.zeros(1, dtype=torch.long, device=ids.device)
    with torch.no_grad():
        return model(ids, cache, zero, zero).logits[0].float()


class _Drift:
    """How far a variant's next-token distributions lie from the reference's, accumulated over prompts."""

    def __init__(self) -> None:
        self.kls: list[torch.Tensor] = []
        self.agree = 0
        self.sq_err = self.sq_ref = 0.0

    def add(self, ref: torch.Tensor, other: torch.Tensor) -> None:
        self.kls.append(F.kl_div(other.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1))
        self.agree += int((ref.argmax(-1) == other.argmax(-1)).sum())
        self.sq_err += float((ref - other).double().square().sum())
        self.sq_ref += float(ref.double().square().sum())

    def summary(self) -> dict:
        kl = torch.cat(self.kls).double()
        return {"rel_err": (self.sq_err / self.sq_ref) ** 0.5, "kl_mean": kl.mean().item(),
                "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
                "greedy_agreement": self.agree / kl.numel()}


def table(report: dict) -> str:
    from tabulate import tabulate

    w, lg = report["weight_bytes"], report["logits"]
    errs = [r["weight_rel_err"] for r in report["modules"]]
    rows = [["weights (GB)", f"{w['model_dtype'] / 1e9:.3f}", f"{w['fp8'] / 1e9:.3f}"],
            ["projections and experts (GB)", f"{w['projections_model_dtype'] / 1e9:.3f}",
             f"{w['projections_fp8'] / 1e9:.3f}"]]
    text = tabulate(rows, headers=["", "model dtype", "fp8"])
    ref = report["reference"]
    text += (f"\n{report['positions']} positions, the model dtype's distributions: entropy {ref['entropy_mean']:.2f} "
             f"nats (uniform: {ref['entropy_max']:.2f}), top token {ref['top1_prob_mean']:.3g}")
    for label, d in (("fp8", lg), ("bf16 projections (control)", report["bf16_control"])):
        if d is not None:
            text += (f"\n{label}: logits relative error {d['rel_err']:.4f}, KL mean {d['kl_mean']:.3g} / p99 "
                     f"{d['kl_p99']:.3g} / max {d['kl_max']:.3g}, greedy agreement {d['greedy_agreement']:.4f}")
    text += (f"\n{len(errs)} quantized weights: relative error {min(errs):.4f} to {max(errs):.4f} "
             f"(mean {sum(errs) / len(errs):.4f})")
    return text
