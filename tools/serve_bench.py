"""``lfmspark bench serve``: an open-loop serving benchmark, target-only and speculative on one trace.

Requests arrive on their own clock (Poisson at ``request_rate`` per second, or all at once with
``inf``; at most ``max_concurrency`` in flight), as in ``vllm bench serve`` and
``sglang.bench_serving``, so a slow step shows as queueing, TTFT and inter-token latency instead of
as a lower closed-loop rate. Each engine is built, warmed up and driven through an
:class:`AsyncEngine` with the same trace (prompts, output lengths, arrival times). Reported per
engine, in vLLM's words and units: successful requests, duration, tokens, request / output / total
token throughput, TTFT, TPOT (per request, excluding the first token) and ITL (the gap between
consecutive streamed events, each event's tokens counted at its arrival) as mean / p50 / p90 / p99,
end-to-end latency, τ, peak GPU memory.

Prompts: random token ids of ``input_len`` (drawn in ``[input_len * (1 - range_ratio), input_len *
(1 + range_ratio)]``, likewise the outputs), or a JSONL file with one ``{"prompt": text or token
ids, "output_len": n}`` per line (text needs a checkpoint with a tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..runtime.async_engine import AsyncEngine
from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from ..runtime.loader import load_models
from ..runtime.sampling import SamplingParams
from .bench import bench_mode

log = logging.getLogger("lfmspark")


@dataclass
class ServeBenchConfig:
    """The trace and its arrivals; the engines' config is ``engine`` (its ``max_seq_len`` is fitted to
    the trace by :func:`fitted_seq_len` unless the command line sets one)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    num_prompts: int = 64
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    dataset: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # set: each engine first serves the trace all at once (its capacity, requests per second at
    # saturation), then again with Poisson arrivals at this fraction of that capacity
    capacity_fraction: float | None = None
    temperature: float = 0.0
    json_path: str | None = None


@dataclass
class _Trace:
    prompts: list[list[int] | str]
    output_lens: list[int]
    arrivals: list[float]            # seconds from the start


@dataclass
class _Result:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    tau: float = 1.0
    cached: int = 0                   # prompt tokens the prefix cache supplied
    error: str | None = None


def make_trace(cfg: ServeBenchConfig, vocab: int) -> _Trace:
    rng = random.Random(cfg.engine.seed)

    def length(base: int) -> int:
        lo, hi = max(1, int(base * (1 - cfg.range_ratio))), max(1, int(base * (1 + cfg.range_ratio)))
        return rng.randint(lo, hi)

    if cfg.dataset:
        prompts, output_lens = [], []
        with open(cfg.dataset) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    prompts.append(row["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{cfg.dataset}:{n}: each line must be a JSON object with a 'prompt' "
                                     f"({type(e).__name__}: {e})") from None
                output_lens.append(int(row.get("output_len", cfg.output_len)))
                if len(prompts) == cfg.num_prompts:
                    break
        if not prompts:
            raise ValueError(f"{cfg.dataset} holds no prompts")
    else:
        prompts = [[rng.randrange(1, vocab) for _ in range(length(cfg.input_len))] for _ in range(cfg.num_prompts)]
        output_lens = [length(cfg.output_len) for _ in prompts]
    return _Trace(prompts, output_lens, poisson_arrivals(len(prompts), cfg.request_rate, rng))


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests at ``rate`` per second (inf: all at 0)."""
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return arrivals


async def _drive(engine: AsyncEngine, trace: _Trace, cfg: ServeBenchConfig) -> tuple[list[_Result], float]:
    gate = asyncio.Semaphore(cfg.max_concurrency or len(trace.prompts))
    start = time.perf_counter()

    async def one(i: int) -> _Result:
        await asyncio.sleep(max(0.0, start + trace.arrivals[i] - time.perf_counter()))
        async with gate:
            params = SamplingParams(max_new_tokens=trace.output_lens[i], temperature=cfg.temperature,
                                    seed=cfg.engine.seed + i, ignore_eos=True)
            t0 = last = time.perf_counter()
            res = _Result(ok=False)
            try:
                async for ev in engine.generate(trace.prompts[i], params, request_id=f"bench-{i}"):
                    now = time.perf_counter()
                    if ev.token_ids:
                        if res.ttft == 0.0:
                            res.ttft = now - t0
                        else:
                            res.itls.append(now - last)
                        last = now
                    if ev.finished:
                        out = ev.output
                        res.ok, res.output_len, res.prompt_len = True, len(out.token_ids), len(out.prompt_token_ids)
                        res.e2e, res.tau = now - t0, out.stats.tau
                        res.cached = out.stats.prompt_tokens_cached
            except Exception as e:        # a failed request is counted, not fatal to the benchmark
                res.error = f"{type(e).__name__}: {e}"
            return res

    results = await asyncio.gather(*(one(i) for i in range(len(trace.prompts))))
    return list(results), time.perf_counter() - start


async def _serve_trace(engine: Engine, trace: _Trace, cfg: ServeBenchConfig) -> tuple[list[_Result], float]:
    ae = AsyncEngine(engine, max_waiting=len(trace.prompts) + 1)
    try:
        return await _drive(ae, trace, cfg)
    finally:
        await ae.shutdown()


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return {"mean": statistics.fmean(s), "p50": statistics.median(s), "p90": pct(0.90), "p99": pct(0.99)}


def _summarise(results: list[_Result], duration: float, peak_bytes: int | None, warmup_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in _stats(xs).items()}  # noqa: E731
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": ms([x for r in ok for x in r.itls]),
        "e2el_ms": ms([r.e2e for r in ok]),
        "tau_mean": statistics.fmean(r.tau for r in ok) if ok else float("nan"),
        "cached_input_tokens": sum(r.cached for r in ok),
        "peak_memory_gb": None if peak_bytes is None else peak_bytes / 1e9,
        "warmup_s": warmup_s,
    }


def fitted_seq_len(cfg: ServeBenchConfig) -> int:
    """A ``max_seq_len`` that holds the trace's longest request and its verify window."""
    longest = int(cfg.input_len * (1 + cfg.range_ratio)) + int(cfg.output_len * (1 + cfg.range_ratio))
    if cfg.dataset:
        longest = max(longest, 4096)
    return 1 << max(7, math.ceil(math.log2(longest + 64)))


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Both engines on one trace; the report (also written to ``cfg.json_path``)."""
    if cfg.capacity_fraction is not None and not 0 < cfg.capacity_fraction <= 1:
        raise ValueError(f"capacity_fraction must be in (0, 1], got {cfg.capacity_fraction}")
    models = load_models(cfg.engine)       # one set of weights for both engines
    kinds = ["target_only"] + (["speculative"] if models.draft is not None else [])
    report: dict = {"schema": 1, "config": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                                             for k, v in asdict(cfg).items()},
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "results": {}}
    trace = make_trace(cfg, models.target.config.vocab_size)
    for kind in kinds:
        if kind == "speculative":
            engine = Engine.from_config(cfg.engine, models)
        else:
            engine = Engine.from_config(cfg.engine.replace(imposed_acceptance=None, verify_widths=None),
                                        models.without_draft())
        t0 = time.perf_counter()
        engine.warmup(progress=False, sampling=[bench_mode(cfg.temperature, engine)])   # the trace's mode only
        warmup_s = time.perf_counter() - t0
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(engine.device)
        log.info("%s: %d requests, rate %s/s", kind, len(trace.prompts), cfg.request_rate)

        served = trace
        if cfg.capacity_fraction is not None:
            at_once = _Trace(trace.prompts, trace.output_lens, [0.0] * len(trace.prompts))
            results, duration = asyncio.run(_serve_trace(engine, at_once, cfg))
            saturation = _summarise(results, duration, None, warmup_s)
            report["results"][f"{kind}_saturation"] = saturation
            rate = cfg.capacity_fraction * saturation["request_throughput"]
            served = _Trace(trace.prompts, trace.output_lens,
                            poisson_arrivals(len(trace.prompts), rate, random.Random(cfg.engine.seed + 1)))
            log.info("%s: capacity %.2f req/s; serving at %.2f req/s", kind, saturation["request_throughput"], rate)
            if engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(engine.device)
        results, duration = asyncio.run(_serve_trace(engine, served, cfg))
        peak = torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None
        report["results"][kind] = _summarise(results, duration, peak, warmup_s)
        if cfg.capacity_fraction is not None:
            report["results"][kind]["request_rate"] = rate
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=1))
    return report


def format_report(report: dict) -> str:
    """vLLM's ``bench serve`` block, once per engine."""
    lines = []
    for kind, r in report["results"].items():
        lines += [f"{' Serving Benchmark Result: ' + kind + ' ':=^60}"]
        if "request_rate" in r:
            lines.append(f"{'Request rate (req/s):':<44}{r['request_rate']:.2f}")
        lines += [f"{'Successful requests:':<44}{r['successful_requests']}",
                  f"{'Failed requests:':<44}{r['failed_requests']}",
                  f"{'Benchmark duration (s):':<44}{r['duration_s']:.2f}",
                  f"{'Total input tokens:':<44}{r['total_input_tokens']}",
                  f"{'Total generated tokens:':<44}{r['total_output_tokens']}",
                  f"{'Request throughput (req/s):':<44}{r['request_throughput']:.2f}",
                  f"{'Output token throughput (tok/s):':<44}{r['output_throughput']:.2f}",
                  f"{'Total Token throughput (tok/s):':<44}{r['total_token_throughput']:.2f}",
                  f"{'Mean tau (tokens per round):':<44}{r['tau_mean']:.2f}",
                  f"{'Prefix-cached input tokens:':<44}{r['cached_input_tokens']}"]
        for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                           ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
            short = key.split("_")[0].upper()
            lines.append(f"{title:-^60}")
            for stat, name in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
                lines.append(f"{f'{name} {short} (ms):':<44}{r[key][stat]:.3f}")
        if r["peak_memory_gb"] is not None:
            lines.append(f"{'Peak GPU memory (GB):':<44}{r['peak_memory_gb']:.2f}")
        lines.append("=" * 60)
    return "\n".join(lines)
