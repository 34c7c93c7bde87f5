"""The latency benchmark (``lfmspark bench``): one process, one run, every number side by side.

For each batch size it measures, on the same weights: target-only decoding through the engine
(CUDA graphs on a GPU), Hugging Face ``generate`` (eager; optionally static cache + torch.compile),
and DSpark speculative decoding — with real acceptance for real checkpoints, or an **imposed**
per-position acceptance profile for random-weight presets (labelled as such everywhere). It
reports TTFT and TPOT (p50/p99), tokens/s per user and in total, tau and per-position acceptance,
the round's draft/verify/commit split, achieved GB/s against the copy bandwidth measured in the
same run, warm-up time and peak memory; prints a table and writes JSON with the command line,
versions, GPU name and date (DESIGN §7).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..environment import SECRETS, VARIABLES
from ..models.lfm2_moe import Lfm2MoeBlock, Lfm2MoeExperts
from ..ops._dispatch import use_pdl
from ..ops.markov_walk.jacobi import jacobi_pass_counts
from ..runtime.config import EngineConfig
from ..runtime.distributions import SamplingMode
from ..runtime.engine import Engine
from ..runtime.loader import load_models
from ..runtime.sampling import SamplingParams, sampling_mode
from ..runtime.steps import Drafted, Verified
from .hf_baseline import COMPILE_MODES, BaselineFailed, BaselineShape, run_baseline, time_baseline
from .timeline import launch_lines, timeline_lines, trace_kernel_launches

log = logging.getLogger("lfmspark")

SCHEMA_VERSION = 2     # 2: imposed_acceptance is a list of profiles; speculative rows carry imposed_profile
DEFAULT_IMPOSED_RATE = 0.9     # per-position conditional rate imposed on random-weight drafts


@dataclass
class BenchConfig:
    """The benchmark's own settings; the engines' are ``engine`` (its model source names the weights
    both engines share; ``max_batch``, ``max_seq_len`` and the captured sizes follow the batch sizes
    and lengths measured)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 128
    output_len: int = 128
    temperature: float = 0.0
    imposed_acceptance: list[list[float]] | None = None    # profiles, each one rate or one per position
    runs: int = 3
    hf: bool = True
    hf_compile: bool = False
    hf_compile_timeout_s: float = 600.0   # past it the HF compiled baseline is reported as failed
    phase_split: bool = True
    json_path: str | None = None
    profile_dir: str | None = None     # per-kernel profile of the step replay at the smallest batch
    command: str | None = None         # recorded in the report (None: this process's command line)

    def engine_config(self, block_size: int) -> EngineConfig:
        """The config of the measured engines (``block_size``: the draft's, 0 without one): lengths and
        slots for the batches measured, only the batch sizes measured captured."""
        max_seq_len = self.prompt_len + self.output_len + 64 * (block_size + 1) + 64
        changes = dict(max_batch=max(self.batch_sizes), max_seq_len=max_seq_len)
        if self.engine.torch_device().type == "cuda":
            changes["batch_sizes"] = sorted(set(self.batch_sizes))
        return self.engine.replace(**changes)


# ---------------------------------------------------------------------------------------------
# measurements

def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median_seconds(fn, runs: int, warmup: int = 3) -> float:
    """The median device time of ``fn()`` over ``runs`` calls (CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return percentile(times, 50)


def copy_bandwidth_gbps(device: torch.device, n_bytes: int = 1 << 31) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 20 copies."""
    if device.type != "cuda":
        return None
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), runs=20)
    del src, dst
    return 2 * n_bytes / seconds / 1e9


def matmul_tflops(device: torch.device, n: int = 8192) -> float | None:
    """A bf16 ``n x n x n`` product's throughput (TFLOP/s, median of 10): the tensor-core ceiling a
    long prefill is held to, measured like the copy bandwidth rather than taken from a data sheet."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = median_seconds(lambda: a @ b, runs=10)
    del a, b
    return 2 * n ** 3 / seconds / 1e12


def prefill_flops(engine: Engine, rows: int, tokens: int) -> int:
    """The useful FLOPs (a multiply-add is 2) of prefilling ``rows`` prompts of ``tokens`` tokens from
    position 0: every weight matrix of the layers once per token (of an MoE layer's experts, the
    ``k`` of ``E`` a token is routed to), the causal attention's scores and weighted values, and the
    LM head once per row (a prefill computes only the last token's logits)."""
    cfg = engine.model_config
    per_token = 0.0
    for module in engine.target.model.layers.modules():
        weights = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        if isinstance(module, Lfm2MoeExperts):
            weights *= cfg.num_experts_per_tok / cfg.num_experts
        per_token += 2 * weights
    causal_pairs = tokens * (tokens + 1) // 2          # (query, key) pairs of one prompt
    attention = len(cfg.attention_layers) * 4 * cfg.num_attention_heads * cfg.head_dim * causal_pairs
    head = 2 * cfg.vocab_size * cfg.hidden_size
    return int(rows * (tokens * per_token + attention + head))


def module_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def step_bytes(engine: Engine, context: int, batch: int) -> int:
    """Bytes one step must read at least: the target's weights (tied LM head once; for MoE layers
    only the experts the step's tokens are expected to touch: under uniform routing, or under the
    routing-locality mode each row's tokens within its own subset), the KV of ``context`` tokens
    per row, and for a speculative round the draft's own weights, its context KV and a second pass
    over the LM head (the draft projects with the target's)."""
    cfg = engine.model_config
    total = module_bytes(engine.target)
    if cfg.is_moe:
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * engine.dtype.itemsize
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        k, E, width = cfg.num_experts_per_tok, cfg.num_experts, engine.verify_width
        subset = engine.model_runner.routing_locality or E
        per_row = subset * (1 - (1 - k / subset) ** width)            # a row's window within its subset
        touched = E * (1 - (1 - per_row / E) ** batch)                  # the union over rows' random subsets
        total -= int(n_moe * (E - touched) * expert)
    kv_token = 2 * len(cfg.attention_layers) * cfg.num_key_value_heads * cfg.head_dim * engine.dtype.itemsize
    total += batch * context * kv_token
    if engine.draft is not None:
        dc = engine.draft.config
        total += module_bytes(engine.draft) + engine.target.lm_head.weight.numel() * engine.dtype.itemsize
        total += batch * context * 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * engine.dtype.itemsize
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mode(temperature: float, engine: Engine) -> SamplingMode:
    """The sampling mode the benchmark's requests (``temperature``, no other parameter) run in."""
    return sampling_mode([SamplingParams(temperature=temperature)], engine.model_config.vocab_size)


def time_replays(engine: Engine, batch: int, iters: int, mode: SamplingMode) -> float:
    """Median seconds of one step (decode or round) for ``batch`` real rows, graph-replayed on a GPU.
    Runs on the slots the measured requests used (now free); their lengths are restored after."""
    slots = list(range(batch))
    saved = engine.model_runner.state.seq_len.clone(), engine.model_runner.state.anchor.clone()
    times = []
    for _ in range(iters):
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.model_runner.step_runner.run(engine.model_runner.step_kind, slots, mode)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    engine.model_runner.state.seq_len.copy_(saved[0])
    engine.model_runner.state.anchor.copy_(saved[1])
    return percentile(times, 50)


def time_prefill(engine: Engine, batch: int, prompt_len: int, iters: int) -> tuple[float, tuple[int, int] | None]:
    """Median seconds of one prefill of ``batch`` prompts of ``prompt_len`` tokens (a graph replay
    at their bucket when captured, else the eager forward), and the bucket. Every row is a padding
    row (slot ``-1``): the same kernels run, and no state changes."""
    runner = engine.model_runner.prefill_runner
    chunks, slots = [[1] * prompt_len] * batch, [-1] * batch
    times = []
    for _ in range(iters):
        _sync(engine.device)
        t0 = time.perf_counter()
        runner.run(chunks, slots, [0] * batch)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    return percentile(times, 50), runner.bucket(batch, prompt_len, 0)


@torch.no_grad()
def time_round_phases(engine: Engine, batch: int, iters: int) -> dict[str, float]:
    """Milliseconds of the round's phases (draft / verify / accept+commit), each captured as its own
    CUDA graph on a GPU (plain calls elsewhere), for ``batch`` real rows. The phases run the
    engine's compiled regions, so they compile nothing new when the batch size was warmed up."""
    steps = engine.model_runner.steps
    slots = torch.arange(batch, device=engine.device)
    saved = engine.model_runner.state.seq_len.clone(), engine.model_runner.state.anchor.clone()   # each commit advances the rows

    def draft_phase():
        inp = steps.round_inputs(slots, SamplingMode.GREEDY)
        return steps.round_draft(inp).window

    window = draft_phase()

    def verify_phase():
        v = steps.round_verify(steps.round_inputs(slots, SamplingMode.GREEDY), window)
        steps.join_injection()   # the verify forked the draft's context injection: timed here
        return v.hidden, v.delta, v.aux, v.rows, v.injected

    hidden, delta, aux, rows, injected = verify_phase()

    def commit_phase():
        # round_commit: with the injection's fork where the verify did not fork it (injected False)
        out = steps.round_commit(steps.round_inputs(slots, SamplingMode.GREEDY), Drafted(window, None),
                                 Verified(hidden, delta, aux, rows, injected))
        return out.tokens, out.n_new

    result = {}
    for name, fn in (("draft", draft_phase), ("verify", verify_phase), ("commit", commit_phase)):
        call = fn
        if engine.device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                fn()
            call = graph.replay
        times = []
        with torch.no_grad():
            for _ in range(iters):
                _sync(engine.device)
                t0 = time.perf_counter()
                call()
                _sync(engine.device)
                times.append(time.perf_counter() - t0)
        result[name + "_ms"] = percentile(times, 50) * 1e3
    engine.model_runner.state.seq_len.copy_(saved[0])
    engine.model_runner.state.anchor.copy_(saved[1])
    return result


@torch.no_grad()
def distinct_experts_per_verify(engine: Engine, batch: int, rounds: int = 8) -> float:
    """The mean number of distinct experts an MoE layer reads in one verify of the whole block at
    ``batch`` rows (what bounds the verify's bytes: each distinct expert is read once, ops/moe.py):
    ``rounds`` rounds of the rows the measurement left (as :func:`time_round_phases`), run eagerly so
    that each MoE layer's routing can be read, averaged over layers and rounds."""
    steps, width = engine.model_runner.steps, engine.verify_width
    slots = torch.arange(batch, device=engine.device)
    saved = engine.model_runner.state.seq_len.clone(), engine.model_runner.state.anchor.clone()
    counts: list[int] = []
    blocks = [m for m in engine.target.modules() if isinstance(m, Lfm2MoeBlock)]

    def recording(route):
        def wrapped(x, bias=None):
            ids, weights = route(x, bias)
            if ids.shape[0] == batch * width:           # a verify window (the draft has no MoE layers)
                counts.append(int(ids.unique().numel()))
            return ids, weights
        return wrapped

    for block in blocks:
        block.route = recording(block.route)
    try:
        with torch.compiler.set_stance("force_eager"):
            for _ in range(rounds):
                steps.spec_round(slots, SamplingMode.GREEDY, width)
    finally:
        for block in blocks:
            del block.route                              # the class's method again
        engine.model_runner.state.seq_len.copy_(saved[0])
        engine.model_runner.state.anchor.copy_(saved[1])
    return sum(counts) / len(counts)


def profile_replays(engine: Engine, batch: int, path: Path, iters: int = 10) -> None:
    """Write the tables of ``iters`` step replays: per kernel (GPU time and launches per replay), the
    timeline (what each kernel costs the replay under PDL) and per launch (runtime/timeline.py):
    the breakdown behind a step's distance from its bandwidth floor."""
    from torch.profiler import ProfilerActivity, profile

    slots = list(range(batch))
    saved = engine.model_runner.state.seq_len.clone(), engine.model_runner.state.anchor.clone()
    engine.model_runner.step_runner.run(engine.model_runner.step_kind, slots, SamplingMode.GREEDY)
    _sync(engine.device)
    # the device's kernels; on CPU (tests) the host ops, which leave every table empty
    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(iters):
            engine.model_runner.step_runner.run(engine.model_runner.step_kind, slots, SamplingMode.GREEDY)
        _sync(engine.device)
    engine.model_runner.state.seq_len.copy_(saved[0])
    engine.model_runner.state.anchor.copy_(saved[1])
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / iters
    lines = [f"{engine.model_runner.step_kind.value} replay, batch {batch}: {total:.1f} us of kernel time per replay, "
             f"{sum(e.count for e in kernels) / iters:.0f} kernels per replay",
             f"{'us/replay':>10} {'n/replay':>8}  kernel"]
    lines += [f"{e.device_time_total / iters:10.1f} {e.count / iters:8.1f}  {e.key[:150]}" for e in kernels]
    # under PDL the durations above include waiting; the timeline tables say what each kernel costs the replay
    launches = _traced_launches(prof)
    if launches:
        lines += [""] + timeline_lines(launches, iters) + [""] + launch_lines(launches, iters)
    else:
        lines += ["", "(no kernel launches in the trace)"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log.info("kernel profile written to %s (%.1f us of kernels per replay)", path, total)


def _traced_launches(prof) -> list[tuple[str, float, float, str]]:
    """The kernel launches of a finished profiler run, from its Chrome trace (the export that also
    carries each launch's grid and shared memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return trace_kernel_launches(json.loads(trace.read_text()))


def measure_engine(engine: Engine, cfg: BenchConfig, batch: int, copy_gbps: float | None,
                   matmul_peak: float | None = None) -> dict:
    """One row: ``cfg.runs`` batches of requests through ``engine``, then step timings."""
    gen = torch.Generator().manual_seed(cfg.engine.seed + batch)
    vocab = engine.model_config.vocab_size
    ttft, tpot, loop_step, taus, accept = [], [], [], [], []
    per_position: list[list[float]] = []
    imposed = False
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    # one request before the measured runs: the first request of a process pays 0.5-0.8 s of one-time costs
    # in its TTFT; it is reported apart, not mixed into p50/p99
    warm = engine.generate(torch.randint(0, vocab, (1, cfg.prompt_len), generator=gen).tolist(),
                           SamplingParams(temperature=cfg.temperature, max_new_tokens=2, stop_token_ids=[],
                                          seed=cfg.engine.seed))
    first_ttft = warm[0].stats.ttft_s
    passes_before = jacobi_pass_counts()
    widths_before = dict(engine.speculation_stats.get("rounds_by_width", {}))
    for run in range(cfg.runs):
        prompts = torch.randint(0, vocab, (batch, cfg.prompt_len), generator=gen).tolist()
        # one seed per request: imposed acceptance draws are keyed by (seed, position), so shared
        # seeds would make every row accept in lockstep
        params = [SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.output_len, stop_token_ids=[],
                                 seed=cfg.engine.seed + 1000 * run + i) for i in range(batch)]
        outs = engine.generate(prompts, params)
        for o in outs:
            ttft.append(o.stats.ttft_s)
            tpot.append(o.stats.decode_s / max(len(o.token_ids) - 1, 1))
            # the generation loop's time per step (a round, or a decode step): what TPOT is made of, with
            # the next step launched before the previous one's tokens are read (runtime/engine.py)
            steps = o.stats.rounds if o.stats.rounds else len(o.token_ids) - 1
            if steps:
                loop_step.append(o.stats.decode_s / steps)
            if o.stats.rounds:
                taus.append(o.stats.tau)
                accept += o.stats.accept_lengths
                per_position.append(o.stats.acceptance_per_position)
                imposed = o.stats.imposed_acceptance
    passes, walks = (now - before for now, before in zip(jacobi_pass_counts(), passes_before))
    peak = torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None
    step_s = time_replays(engine, batch, iters=20, mode=bench_mode(cfg.temperature, engine))
    with engine.model_runner.numerics():     # an uncaptured bucket runs the layers eagerly here
        prefill_s, bucket = time_prefill(engine, batch, cfg.prompt_len, iters=10)
    context = cfg.prompt_len + cfg.output_len
    n_bytes = step_bytes(engine, context, batch)
    row = {
        "batch": batch,
        "ttft_ms_p50": percentile(ttft, 50) * 1e3, "ttft_ms_p99": percentile(ttft, 99) * 1e3,
        "ttft_ms_warmup_request": first_ttft * 1e3,
        "tpot_ms_p50": percentile(tpot, 50) * 1e3, "tpot_ms_p99": percentile(tpot, 99) * 1e3,
        "tok_s_per_user": 1.0 / percentile(tpot, 50), "tok_s_total": batch / percentile(tpot, 50),
        "step_ms": step_s * 1e3, "step_bytes": n_bytes, "step_gbps": n_bytes / step_s / 1e9,
        "loop_step_ms": percentile(loop_step, 50) * 1e3,
        "peak_memory_bytes": peak,
        "kv_cache": engine.kv_cache_info(),
        "prefill_ms": prefill_s * 1e3, "prefill_bucket": bucket,
        "prefill_tflops": prefill_flops(engine, batch, cfg.prompt_len) / prefill_s / 1e12,
    }
    if matmul_peak:
        row["prefill_over_matmul_peak"] = row["prefill_tflops"] / matmul_peak
    if copy_gbps:
        row["floor_ms"] = n_bytes / (copy_gbps * 1e9) * 1e3
        row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
        # a prefill reads the target's weights at least once (the compute of long prompts aside)
        row["prefill_weights_floor_ms"] = module_bytes(engine.target) / (copy_gbps * 1e9) * 1e3
    if engine.draft is not None:
        row["tau"] = sum(accept) / len(accept) if accept else float("nan")
        row["acceptance_per_position"] = [
            sum(p[k] for p in per_position if not math.isnan(p[k])) / max(1, sum(not math.isnan(p[k]) for p in per_position))
            for k in range(engine.block_size)]
        row["imposed_acceptance"] = imposed
        if walks:  # the Jacobi walk ran (ops/markov_walk/jacobi.py): its w2 passes depend on the Markov weights
            row["walk_passes_mean"] = passes / walks
        # the width policy's choices over the measured runs (runtime/speculation.py): rounds per verify width
        after = engine.speculation_stats["rounds_by_width"]
        row["rounds_by_width"] = {w: n - widths_before.get(w, 0) for w, n in after.items() if n > widths_before.get(w, 0)}
    return row


# ---------------------------------------------------------------------------------------------
# the run

def command_line(argv: list[str] | None = None) -> str:
    """The ``lfmspark`` command a report records: ``argv`` (the arguments after the program name),
    else this process's."""
    return " ".join(["lfmspark", *(sys.argv[1:] if argv is None else argv)])


def environment(device: torch.device, command: str | None = None) -> dict:
    """Where and on what a report was measured: date, ``command`` (default: :func:`command_line`),
    versions, device, commit, GPU name, the ``LFMSPARK_*`` variables set and whether PDL is on."""
    import transformers

    from .. import __version__

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": command_line() if command is None else command, "lfmspark": __version__,
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["commit"] = source_commit()
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    # the LFMSPARK_* variables set (lfmspark/environment.py) and whether the kernels launch with
    # programmatic dependent launch here: they change the timings
    env["variables"] = {name: "(set)" if name in SECRETS else os.environ[name]
                        for name in sorted(VARIABLES) if name in os.environ}
    env["pdl"] = use_pdl(torch.empty(0, device=device))
    return env


def source_commit() -> str | None:
    """The commit of the checkout lfmspark runs from (``+dirty`` with uncommitted changes), or None
    outside a git checkout: every results row names the commit it measured."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def run_bench(cfg: BenchConfig) -> dict:
    device = cfg.engine.torch_device()
    report: dict = {"schema": SCHEMA_VERSION, "environment": environment(device, cfg.command), "config": asdict(cfg)}
    copy_gbps = copy_bandwidth_gbps(device)
    report["copy_gbps"] = copy_gbps
    matmul_peak = matmul_tflops(device)
    report["matmul_tflops"] = matmul_peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)       # the probe's buffers are not the engine's
    # one set of weights for both engines; no stop tokens: every request runs its output_len
    models = replace(load_models(cfg.engine), stop_token_ids=())
    target, draft = models.target, models.draft
    report["models"] = models.source
    report["target_bytes"] = module_bytes(target)
    report["draft_bytes"] = module_bytes(draft) if draft is not None else 0
    engine_cfg = cfg.engine_config(draft.config.block_size if draft is not None else 0)
    engines: dict[str, Engine] = {}

    profiles = cfg.imposed_acceptance
    if profiles is not None and draft is None:
        raise ValueError("--imposed-acceptance needs a draft (it sets the draft's acceptance), and this run has "
                         "none: drop it, or give a draft (--draft-preset, --draft)")
    if draft is not None and cfg.engine.target is None and profiles is None:
        profiles = [[DEFAULT_IMPOSED_RATE]]
        log.info("random-weight draft: imposing a per-position acceptance rate of %.2f (outputs are labelled)",
                 DEFAULT_IMPOSED_RATE)
    if profiles is not None and draft is not None:
        profiles = [p * draft.config.block_size if len(p) == 1 else p for p in profiles]
        bad = [p for p in profiles if len(p) != draft.config.block_size]
        if bad:        # refuse before anything is measured, not after the first profile's rows
            raise ValueError(f"--imposed-acceptance needs one rate or {draft.config.block_size} (one per draft "
                             f"slot), got {bad}")
    report["imposed_acceptance"] = profiles
    imposed = profiles[0] if profiles else None
    results: dict[str, list] = {"target_only": [], "speculative": [], "hf_eager": [], "hf_static_compile": []}
    warmups: dict[str, dict] = {}

    def engine_for(kind: str) -> Engine:
        if kind not in engines:
            if kind == "speculative":
                engines[kind] = Engine.from_config(engine_cfg.replace(imposed_acceptance=imposed), models)
            else:
                engines[kind] = Engine.from_config(engine_cfg.replace(imposed_acceptance=None, verify_widths=None),
                                                   models.without_draft())
            # walk_passes; read when the graphs are traced
            engines[kind].model_runner.steps.count_walk_passes = True
            t0 = time.perf_counter()
            rep = engines[kind].warmup(progress=True, sampling=[bench_mode(cfg.temperature, engines[kind])])
            warmups[kind] = {"seconds": time.perf_counter() - t0, **rep.as_dict()}
        return engines[kind]

    def save() -> None:        # after every batch size, so an interrupted run keeps what it measured
        report["warmup"] = warmups
        report["results"] = results
        report["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if cfg.json_path:
            Path(cfg.json_path).parent.mkdir(parents=True, exist_ok=True)
            with open(cfg.json_path, "w") as f:
                json.dump(report, f, indent=2, default=str)

    # Order: every engine row first, then the phase splits, then the HF baselines, then the profiles.
    # A process's decode steps ran ~20 us slower (rounds up to 50 us) for good once new small allocator
    # segments had been created on a stream or pool with none cached, as the phase split's captures
    # do (docs/decisions.md), so work that allocates runs after every engine timing.
    phase_rows: list[tuple[dict, list[float] | None]] = []
    for batch in cfg.batch_sizes:
        log.info("batch %d: target-only", batch)
        results["target_only"].append(measure_engine(engine_for("target_only"), cfg, batch, copy_gbps, matmul_peak))
        if draft is not None:
            for profile in profiles or [None]:
                log.info("batch %d: speculative%s", batch, f", imposed acceptance {profile}" if profile else "")
                engine = engine_for("speculative")
                if profile is not None:
                    engine.set_imposed_acceptance(profile)
                row = measure_engine(engine, cfg, batch, copy_gbps, matmul_peak)
                row["imposed_profile"] = profile
                results["speculative"].append(row)
                phase_rows.append((row, profile))
        save()
    if cfg.phase_split and phase_rows:
        engine = engines["speculative"]
        for row, profile in phase_rows:
            if profile is not None:
                engine.set_imposed_acceptance(profile)
            with engine.model_runner.numerics():     # the phases call the steps directly
                row.update(time_round_phases(engine, row["batch"], iters=20))
        save()
    if draft is not None and target.config.is_moe:
        engine = engines["speculative"]
        for row, profile in phase_rows:
            if profile is not None:
                engine.set_imposed_acceptance(profile)
            with engine.model_runner.numerics():
                row["distinct_experts_per_verify"] = distinct_experts_per_verify(engine, row["batch"])
            row["routing_locality"] = cfg.engine.routing_locality
        report["num_experts"] = target.config.num_experts
        save()
    if cfg.hf:
        for batch in cfg.batch_sizes:
            results["hf_eager"].append(hf_row(target, cfg, batch, device, compiled=False))
            if cfg.hf_compile:
                results["hf_static_compile"].append(hf_row(target, cfg, batch, device, compiled=True))
            save()
    # Profiles come last, after every timing: a torch.profiler session leaves CUPTI attached to the
    # process, which slows later kernel launches (10.0 us per eager launch before a profile, 14.3 us
    # after), and the HF eager baseline is launch-bound.
    if cfg.profile_dir and device.type == "cuda":
        for engine in engines.values():
            batch = min(cfg.batch_sizes)
            with engine.model_runner.numerics():     # a mode not warmed is captured on first use
                profile_replays(engine, batch, Path(cfg.profile_dir) / f"profile_{engine.model_runner.step_kind.value}_bs{batch}.txt")
    save()
    return report


def hf_row(target, cfg: BenchConfig, batch: int, device: torch.device, compiled: bool) -> dict:
    """One HF baseline row. Eager ``generate`` runs in this process; static cache + compile runs in a child process
    (tools/hf_baseline.py), so its crash or over-long compile becomes a failed row."""
    shape = BaselineShape(batch, cfg.prompt_len, cfg.output_len, cfg.runs, cfg.engine.seed)

    label = "HF static cache + torch.compile" if compiled else "HF eager generate"
    log.info("batch %d: %s%s", batch, label, " (child process)" if compiled else "")
    row: dict = {"batch": batch}
    try:
        if compiled:    # each mode in turn; a crashed attempt is kept in the row, not hidden
            for mode in COMPILE_MODES:
                try:
                    timing = run_baseline(cfg.engine, shape, mode, cfg.hf_compile_timeout_s)
                    row["compile_mode"] = mode
                    break
                except BaselineFailed as e:
                    if mode == COMPILE_MODES[-1]:
                        raise
                    log.warning("%s, mode=%s failed (%s); trying the next mode", label, mode, e)
                    row[f"error_{mode.replace('-', '_')}"] = f"{type(e).__name__}: {e}"[:500]
        else:
            timing = time_baseline(target, shape, device)
        row.update(ttft_ms_p50=timing["ttft_ms"], tpot_ms_p50=timing["tpot_ms"],
                   tok_s_per_user=1e3 / timing["tpot_ms"], tok_s_total=batch * 1e3 / timing["tpot_ms"])
    except Exception as e:       # a baseline that fails is reported as such, not hidden
        log.warning("%s failed: %s", label, e)
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    return row


# ---------------------------------------------------------------------------------------------
# presentation

def table(report: dict) -> str:
    from tabulate import tabulate

    res = report["results"]
    rows = []
    ours = {r["batch"]: r for r in res["target_only"]}
    hf = {r["batch"]: r for r in res["hf_eager"]}
    for name, key in (("lfmspark target-only", "target_only"), ("lfmspark DSpark", "speculative"),
                      ("HF eager generate", "hf_eager"), ("HF static+compile", "hf_static_compile")):
        for r in res[key]:
            if "error" in r:
                rows.append([name, r["batch"]] + ["failed"] + [""] * 8 + [r["error"][:60]])
                continue
            label = name
            note = f"mode={r['compile_mode']}" if "compile_mode" in r else ""
            locality = report.get("config", {}).get("engine", {}).get("routing_locality")
            if locality and key in ("target_only", "speculative"):
                note = (note + " " if note else "") + f"routing locality {locality}"
            if report.get("config", {}).get("engine", {}).get("exact") and key in ("target_only", "speculative"):
                note = (note + " " if note else "") + "exact mode"
            if any(k.startswith("error_") for k in r):
                note += " (" + ", ".join(k[6:] + " failed" for k in r if k.startswith("error_")) + ")"
            if r.get("imposed_acceptance"):
                rates = r["imposed_profile"]
                label += f" (imposed {rates[0]:g})" if len(set(rates)) == 1 else " (imposed profile)"
            base = ours.get(r["batch"])
            hf_r = hf.get(r["batch"])
            rows.append([
                label, r["batch"], f"{r.get('ttft_ms_p50', float('nan')):.2f}", f"{r['tpot_ms_p50']:.3f}",
                f"{r['tpot_ms_p99']:.3f}" if "tpot_ms_p99" in r else "–",  # HF rows: one median, no p99
                f"{r['tok_s_per_user']:.0f}", f"{r['tok_s_total']:.0f}",
                f"{r['tau']:.2f}" if "tau" in r else "",
                f"{r['step_gbps']:.0f}" if "step_gbps" in r else "",
                f"{base['tpot_ms_p50'] / r['tpot_ms_p50']:.2f}x" if base else "",
                f"{hf_r['tpot_ms_p50'] / r['tpot_ms_p50']:.1f}x" if hf_r and "tpot_ms_p50" in hf_r else "", note])
    headers = ["engine", "batch", "TTFT ms", "TPOT p50", "TPOT p99", "tok/s/user", "tok/s", "tau", "GB/s",
               "vs target-only", "vs HF eager", "note"]
    text = tabulate(rows, headers=headers)
    if report.get("copy_gbps"):
        text += f"\nmeasured copy bandwidth: {report['copy_gbps']:.0f} GB/s"
    if report.get("matmul_tflops"):
        text += f"\nmeasured bf16 matmul: {report['matmul_tflops']:.0f} TFLOP/s (8192^3)"
    for r in res["speculative"]:
        if "draft_ms" in r:
            rates = r.get("imposed_profile")
            tag = f" (imposed {rates[0]:g})" if rates and len(set(rates)) == 1 else ""
            text += (f"\nround split at batch {r['batch']}{tag} (whole block): draft {r['draft_ms']:.3f} ms, "
                     f"verify {r['verify_ms']:.3f} ms,"
                     f" accept+commit {r['commit_ms']:.3f} ms (round {r['step_ms']:.3f} ms replayed alone"
                     + (f", {r['loop_step_ms']:.3f} ms in the generation loop)" if "loop_step_ms" in r else ")"))
        if r.get("rounds_by_width"):
            rates = r.get("imposed_profile")
            tag = f" (imposed {rates[0]:g})" if rates and len(set(rates)) == 1 else ""
            counts = r["rounds_by_width"]
            total = sum(counts.values())
            text += (f"\nverify widths at batch {r['batch']}{tag}: "
                     + ", ".join(f"{w}: {100 * n / total:.0f}%" for w, n in sorted(counts.items()))
                     + " of rounds (width 1: no draft)")
        if r.get("distinct_experts_per_verify") is not None:
            rates = r.get("imposed_profile")
            tag = f" (imposed {rates[0]:g})" if rates and len(set(rates)) == 1 else ""
            locality = r.get("routing_locality")
            text += (f"\nMoE routing at batch {r['batch']}{tag}: {r['distinct_experts_per_verify']:.1f} of "
                     f"{report.get('num_experts')} experts per layer per verify of the whole block"
                     + (f" (routing locality imposed: {locality} experts per sequence and layer)" if locality
                        else " (routing as the weights give it)"))
        if "walk_passes_mean" in r:
            text += (f"\nMarkov walk at batch {r['batch']}: {r['walk_passes_mean']:.2f} biased passes over markov_w2 "
                     f"per round (Jacobi walk: 1 when the bias moved no guessed slot, at most the block size)")
    for r in res["target_only"]:
        bucket = r.get("prefill_bucket")
        text += (f"\nprefill at batch {r['batch']}: {r['prefill_ms']:.3f} ms per "
                 + (f"replay (bucket {bucket[0]}x{bucket[1]})" if bucket else "eager forward")
                 + (f", weights floor {r['prefill_weights_floor_ms']:.3f} ms" if "prefill_weights_floor_ms" in r else "")
                 + f", {r['prefill_tflops']:.1f} TFLOP/s"
                 + (f" ({r['prefill_over_matmul_peak']:.0%} of the measured bf16 matmul peak)"
                    if "prefill_over_matmul_peak" in r else ""))
    for kind in ("target_only", "speculative"):
        kv = res[kind][-1]["kv_cache"] if res.get(kind) else None
        if kv is not None:
            text += (f"\nKV cache {kind}: {kv['pages']} pages of {kv['page_size']} tokens ({kv['bytes'] / 2**30:.2f} GiB), "
                     f"at most {kv['pages_in_use_peak']} in use; max_seq_len {kv['max_seq_len']}")
    for kind, w in report.get("warmup", {}).items():
        text += f"\nwarm-up {kind}: {w['seconds']:.1f} s ({w['mode']})"
    return text
