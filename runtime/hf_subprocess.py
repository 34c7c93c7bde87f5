"""Run an HF baseline in a child process: ``python -m lfmspark.runtime.hf_subprocess``.

Why a child: HF ``generate`` with a static cache under ``torch.compile(mode="reduce-overhead")``
segfaults on the H200 (torch 2.11, transformers 5.17, LFM2: the conv-state update is a mutated
input, CUDA graphs are skipped, then the process dies), which took the whole benchmark down with
it, leaving no JSON at all. In a child, a crash or an over-long compile becomes a failed attempt
with its reason, the benchmark's own numbers survive, and the baseline's compile settings (Dynamo
limits, CUDA-graph trees) cannot leak into the engine's. The child runs with ``faulthandler`` on,
so a native crash still reports the Python frames it happened in.

The child rebuilds the same target the benchmark measures: the same checkpoint directory, or the
same preset materialised from the same seed (deterministic), so the baseline runs on the same
weights. It prints one JSON line (``{"ttft_ms": ..., "tpot_ms": ...}``) as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, replace

import torch

log = logging.getLogger("lfmspark")

_STDERR_TAIL_LINES = 6
# tried in order by the benchmark: CUDA graphs first (the fast HF configuration), then without them
COMPILE_MODES = ("reduce-overhead", "default")


class BaselineTimeout(Exception):
    pass


class BaselineFailed(Exception):
    pass


def child_command(cfg, batch: int, device: torch.device, compile_mode: str | None) -> list[str]:
    config = json.dumps(asdict(replace(cfg, json_path=None, profile_dir=None)))
    cmd = [sys.executable, "-X", "faulthandler", "-m", "lfmspark.runtime.hf_subprocess", "--config", config,
           "--batch", str(batch), "--device", str(device)]
    return cmd + (["--compile-mode", compile_mode] if compile_mode else [])


def _crash_report(stderr: str) -> str:
    """The innermost frames of a faulthandler dump when there is one, else the end of stderr."""
    lines = stderr.strip().splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    picked = lines[fatal:fatal + _STDERR_TAIL_LINES] if fatal is not None else lines[-_STDERR_TAIL_LINES:]
    return " | ".join(line.strip() for line in picked)


def run_baseline(cfg, batch: int, device: torch.device, compile_mode: str | None) -> dict:
    """Time one HF baseline in a child process: eager ``generate`` (``compile_mode=None``) or a static
    cache with ``torch.compile(mode=compile_mode)``. Returns ``{"ttft_ms", "tpot_ms"}``; raises
    :class:`BaselineTimeout` past ``cfg.hf_compile_timeout_s`` and :class:`BaselineFailed` (with the
    exit status and the crash site or the end of the child's stderr) when the child dies or reports
    no result."""
    cmd = child_command(cfg, batch, device, compile_mode)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.hf_compile_timeout_s,
                              env=os.environ.copy())
    except subprocess.TimeoutExpired as e:
        raise BaselineTimeout(f"did not finish within {cfg.hf_compile_timeout_s:g} s (--hf-compile-timeout)") from e
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


def _child(config: dict, batch: int, device: torch.device, compile_mode: str | None) -> dict:
    from .bench import BenchConfig, build_models
    from .hf_baseline import time_baseline

    cfg = BenchConfig(**{**config, "draft_preset": None, "draft_dir": None})
    target, _, _ = build_models(cfg, device)
    return time_baseline(target, cfg, batch, device, compile_mode)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the benchmark's BenchConfig as JSON")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--compile-mode", choices=COMPILE_MODES, help="static cache + torch.compile in this mode "
                   "(default: eager generate)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    timing = _child(json.loads(args.config), args.batch, torch.device(args.device), args.compile_mode)
    print(json.dumps(timing), flush=True)


if __name__ == "__main__":
    main()
