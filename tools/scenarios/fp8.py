"""``lfmspark bench fp8``: what FP8 weights cost in quality and save in memory.

The target in the model dtype against the same weights quantized as ``quantization="fp8"`` serves
them (models/quant.py: the projections and MoE experts in e4m3 with per-channel scales), both
teacher-forced over ``num_prompts`` random prompts of ``prompt_len`` tokens. At every position: the
KL divergence of the fp8 target's next-token distribution from the model dtype's (mean, p99, max),
whether the greedy tokens agree, and the logits' relative error (Frobenius, over all positions).
Per quantized module, the relative error of its dequantized fp8 weight against the original: the
relative error of its products on isotropic inputs. And the weight bytes of both targets.

On a random-weight preset these are a random network's distributions: they show what the rounding
does to a network of the model's shape, not a checkpoint's quality on text, which is the model
vendor's number to quote for their fp8 export.

The report (``--json``): ``scenario``, ``environment``, ``config``, ``models``, ``positions``,
``weight_bytes`` (``model_dtype``, ``fp8``; ``projections_model_dtype``, ``projections_fp8``: the
quantized modules alone), ``logits`` (``rel_err``, ``kl_mean``, ``kl_p99``, ``kl_max``,
``greedy_agreement``), ``modules``: one row per quantized module with ``name`` and ``weight_rel_err``
(the MoE experts: over both stacks).
"""

from __future__ import annotations

import argparse
import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...models.cache import TargetCache
from ...models.lfm2_moe import Lfm2MoeExperts, quantize_target, target_projections
from ...runtime.loader import load_models
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


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
        if isinstance(module, Lfm2MoeExperts):
            original = [module.w13.detach().float(), module.w2.detach().float()]
            quantized = list(mods_fp8[name].stacks(torch.float32))
        else:
            original, quantized = [module.weight.detach().float()], [mods_fp8[name].fp8.dequantize(torch.float32)]
        err = sum((q - o).square().sum() for q, o in zip(quantized, original)).sqrt()
        rows.append({"name": name, "weight_rel_err": (err / sum(o.square().sum() for o in original).sqrt()).item()})
    report["modules"] = rows
    report["weight_bytes"] = {
        "model_dtype": _bytes(full.parameters()), "fp8": _bytes(fp8.parameters()),
        "projections_model_dtype": _bytes(p for m in mods_full.values() for p in m.parameters()),
        "projections_fp8": _bytes(p for m in mods_fp8.values() for p in m.parameters())}

    vocab = full.config.vocab_size
    kls, agree, sq_err, sq_ref = [], 0, 0.0, 0.0
    for i, prompt in enumerate(random_prompts(cfg.num_prompts, cfg.prompt_len, vocab, engine_cfg.seed + 7)):
        ids = torch.tensor([prompt], device=device)
        logits = []
        for model in (full, fp8):
            cache = TargetCache.allocate(full.config, 1, cfg.prompt_len, 1, dtype, device)
            with torch.no_grad():
                logits.append(model(ids, cache, torch.zeros(1, dtype=torch.long, device=device),
                                    torch.zeros(1, dtype=torch.long, device=device)).logits[0].float())
        a, b = logits
        kls.append(F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        sq_err += float((a - b).double().square().sum())
        sq_ref += float(a.double().square().sum())
        log.info("fp8 scenario: prompt %d of %d", i + 1, cfg.num_prompts)
    kl = torch.cat(kls).double()
    positions = kl.numel()
    report["positions"] = positions
    report["logits"] = {"rel_err": (sq_err / sq_ref) ** 0.5, "kl_mean": kl.mean().item(),
                        "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
                        "greedy_agreement": agree / positions}
    write_report(report, cfg.json_path)
    return report


def table(report: dict) -> str:
    from tabulate import tabulate

    w, lg = report["weight_bytes"], report["logits"]
    errs = [r["weight_rel_err"] for r in report["modules"]]
    rows = [["weights (GB)", f"{w['model_dtype'] / 1e9:.3f}", f"{w['fp8'] / 1e9:.3f}"],
            ["projections and experts (GB)", f"{w['projections_model_dtype'] / 1e9:.3f}",
             f"{w['projections_fp8'] / 1e9:.3f}"]]
    text = tabulate(rows, headers=["", "model dtype", "fp8"])
    text += (f"\n{report['positions']} positions: logits relative error {lg['rel_err']:.4f}, KL mean "
             f"{lg['kl_mean']:.3g} / p99 {lg['kl_p99']:.3g} / max {lg['kl_max']:.3g}, greedy agreement "
             f"{lg['greedy_agreement']:.4f}")
    text += (f"\n{len(errs)} quantized modules: weight relative error {min(errs):.4f} to {max(errs):.4f} "
             f"(mean {sum(errs) / len(errs):.4f})")
    return text
