"""``lfmspark`` command line: ``bench`` (the latency benchmark), ``generate``, ``serve`` and ``calibrate``.

    lfmspark bench                                   # built-in preset: tiny on CPU, LFM2.5-1.2B + draft on a GPU
    lfmspark bench --preset lfm2-8b-a1b --batch-sizes 1,4,16 --imposed-acceptance 0.9 --json out.json
    lfmspark bench serve --preset lfm2.5-1.2b --num-prompts 200 --request-rate 20 --prompt-len 512 --output-len 128
    lfmspark generate --target DIR [--draft DIR] --prompt "Hello" [--temperature 0.7]
    lfmspark serve --target DIR [--draft DIR] [--port 8000]    # OpenAI-compatible server (the serve extra)
    lfmspark calibrate --target DIR --draft DIR --prompts prompts.jsonl --write-config   # the draft's STS temperatures
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from ..models.config import ConfigError
from ..models.loading import CheckpointError
from ..models.presets import DRAFT_PRESETS, TARGET_PRESETS
from ..ops.routing import WALKS


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates in [0, 1], got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"acceptance rates must be in [0, 1], got {text!r}")
    return values


def _int_from(minimum: int, what: str):
    """An argparse type: an integer of at least ``minimum`` (``what`` names the kind in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        return value
    return parse


_positive = _int_from(1, "positive")
_non_negative = _int_from(0, "non-negative")
_EXACT_HELP = ("exact mode (Engine(exact=True)): a token's target results are the same bits in a decode step or "
               "a verify window, alone or batched, so greedy speculative output equals target-only output on "
               "the GPU too (slower; see README)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lfmspark", description="LFM2 / LFM2-MoE inference with DSpark speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="latency benchmark: target-only, HF transformers and DSpark in one run; "
                       "'bench serve': the open-loop serving benchmark")
    b.add_argument("mode", nargs="?", choices=["latency", "serve"], default="latency",
                   help="latency (default): closed-loop batches; serve: open-loop arrivals through AsyncEngine, "
                        "target-only and speculative on one trace (as vllm bench serve)")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(TARGET_PRESETS), help="random weights with a real model's shapes "
                     "(default: tiny on CPU, lfm2.5-1.2b on a GPU)")
    src.add_argument("--target", help="local HF checkpoint directory of the target")
    b.add_argument("--draft", help="local DSpark draft directory (with --target)")
    b.add_argument("--draft-preset", default="default", help=f"draft preset for --preset: 'default', 'none' or one "
                   f"of {sorted(DRAFT_PRESETS)}")
    b.add_argument("--batch-sizes", type=_int_list, default=[1], help="comma-separated batch sizes (default 1)")
    b.add_argument("--prompt-len", type=_positive, default=128)
    b.add_argument("--output-len", type=_positive, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--imposed-acceptance", type=_rates, action="append", help="per-position conditional "
                   "acceptance rates for random-weight drafts (one value = every position); repeat the option "
                   "to measure several profiles on the same captured graphs; outputs are labelled as imposed")
    b.add_argument("--runs", type=_positive, default=3)
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    b.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
    b.add_argument("--hf-compile-timeout", type=float, default=600.0, help="seconds the HF compiled baseline "
                   "(a child process) may take per batch size before it is reported as failed (default 600)")
    b.add_argument("--prefill-graph-tokens", type=_non_negative, default=1024,
                   help="prompts run at bucket shapes of up to this many tokens, replayed from CUDA graphs "
                        "(default 1024; 0: eager prefill at each prompt's own shape; see README)")
    b.add_argument("--markov-walk", choices=WALKS, default="jacobi",
                   help="the draft's greedy Markov walk kernel (default jacobi; see Engine)")
    b.add_argument("--no-phase-split", action="store_true", help="skip timing draft/verify/commit separately")
    b.add_argument("--verify-widths", type=_int_list, help="verify widths the scheduler picks from (default: 1 and "
                   "the whole block; the block size + 1 alone: the whole block every round)")
    b.add_argument("--exact", action="store_true", help=_EXACT_HELP)
    b.add_argument("--routing-locality", type=_positive, help="MoE targets with random weights: each sequence's "
                   "tokens choose among this many experts per layer (mimics a trained model's correlated "
                   "routing; outputs are labelled)")
    b.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    b.add_argument("--dtype", default=None, help="bfloat16 (GPU default), float16 or float32 (CPU default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", help="write the full report here")
    b.add_argument("--profile-dir", help="write per-kernel profiles of the step replays (smallest batch) here")
    sv = b.add_argument_group("serve mode (lfmspark bench serve)")
    sv.add_argument("--num-prompts", type=_positive, default=64)
    sv.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default "
                    "inf: all at once)")
    sv.add_argument("--max-concurrency", type=_positive, help="requests in flight at most")
    sv.add_argument("--range-ratio", type=float, default=0.0, help="prompt and output lengths drawn in "
                    "[len * (1 - r), len * (1 + r)] (random prompts)")
    sv.add_argument("--dataset", help="JSONL file, one {'prompt': text or token ids, 'output_len': n} per line")
    sv.add_argument("--max-batch", type=_positive, default=64, help="engine slots (serve mode)")
    sv.add_argument("--cuda-graph-sizes", type=_int_list, help="batch sizes captured (serve mode; default: the "
                    "engine's, every size to 8 then coarser)")
    sv.add_argument("--capacity-fraction", type=float, help="measure each engine's capacity (the trace all at "
                    "once), then serve the trace with Poisson arrivals at this fraction of it (e.g. 0.7)")
    sv.add_argument("--prefill-budget", type=_positive, default=256, help="prompt tokens prefilled per step while "
                    "requests decode (Engine(prefill_budget=...))")

    g = sub.add_parser("generate", help="generate text with a local checkpoint, streaming to the terminal")
    g.add_argument("--target", required=True, help="local HF checkpoint directory of the target")
    g.add_argument("--draft", help="local DSpark draft directory")
    msg = g.add_mutually_exclusive_group(required=True)
    msg.add_argument("--prompt", help="user prompt (wrapped in the chat template when the tokenizer has one)")
    msg.add_argument("--messages", help="JSON file with a list of chat messages")
    msg.add_argument("--token-ids", type=_int_list, help="comma-separated prompt token ids")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    g.add_argument("--max-new-tokens", type=_positive, default=256)
    g.add_argument("--exact", action="store_true", help=_EXACT_HELP)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-seq-len", type=_positive, default=4096)
    g.add_argument("--device")
    g.add_argument("--dtype", default=None)
    g.add_argument("--no-stream", action="store_true", help="print the text once at the end")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs: pip install 'lfmspark[serve]')")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="local HF checkpoint directory of the target")
    src.add_argument("--preset", choices=sorted(TARGET_PRESETS), help="random weights with a real model's shapes "
                     "(benchmarks: send token ids, there is no tokenizer)")
    s.add_argument("--draft", help="local DSpark draft directory (with --target)")
    s.add_argument("--draft-preset", default="default", help="draft for --preset: 'default', 'none' or a preset")
    s.add_argument("--served-model-name", help="the model name clients send (default: the target directory's "
                   "name or the preset)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_positive, default=8000)
    s.add_argument("--max-batch", type=_positive, default=8, help="requests decoded at once (state slots)")
    s.add_argument("--max-seq-len", type=_positive, default=4096)
    s.add_argument("--cuda-graph-sizes", type=_int_list, help="comma-separated batch sizes to capture (default: "
                   "every size to 8, then coarser steps; larger batches pad to the next captured size)")
    s.add_argument("--max-waiting", type=_positive, default=256, help="requests that may wait for a slot; past "
                   "it the server answers 503")
    s.add_argument("--prefill-budget", type=_positive, default=256, help="prompt tokens prefilled per step while "
                   "requests decode: an arrival delays the decoding streams by one such chunk per round")
    s.add_argument("--imposed-acceptance", type=_rates, help="per-position acceptance rates for a random-weight "
                   "draft (benchmarks)")
    s.add_argument("--no-warmup", action="store_true", help="serve at once, compiling on first use")
    s.add_argument("--verify-widths", type=_int_list, help="verify widths the scheduler picks from (default: 1 and "
                   "the whole block)")
    s.add_argument("--exact", action="store_true", help=_EXACT_HELP)
    s.add_argument("--prefix-cache-outputs", action="store_true", help="also keep each finished request's output "
                   "in the prefix cache (a chat's next turn repeats it): its full blocks are prefilled once more, at "
                   "a step where nothing decodes")
    s.add_argument("--replicas", type=_positive, help="serve this many engines behind one endpoint on Ray Serve "
                   "(one GPU each; needs: pip install 'lfmspark[ray]'); routing keeps a conversation on the "
                   "replica holding its prefix cache")
    s.add_argument("--device")
    s.add_argument("--dtype", default=None)

    c = sub.add_parser("calibrate", help="fit the draft's confidence temperatures (STS) from recorded rounds")
    csrc = c.add_mutually_exclusive_group(required=True)
    csrc.add_argument("--target", help="local HF checkpoint directory of the target")
    csrc.add_argument("--preset", choices=sorted(TARGET_PRESETS), help="random weights (a smoke run of the command)")
    c.add_argument("--draft", help="local DSpark draft directory (with --target)")
    c.add_argument("--prompts", help="JSONL file, one {'prompt': text or token ids} per line (default: random "
                   "token ids, which calibrate nothing real)")
    c.add_argument("--num-prompts", type=_positive, default=64, help="random prompts without --prompts")
    c.add_argument("--max-new-tokens", type=_positive, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="the deployment temperature the confidences are "
                   "calibrated for (reference/dspark.md §4.2)")
    c.add_argument("--max-batch", type=_positive, default=16)
    c.add_argument("--max-seq-len", type=_positive, default=4096)
    c.add_argument("--out", help="write the fit (temperatures, ECE before and after) as JSON here")
    c.add_argument("--write-config", action="store_true", help="store the temperatures in the draft's "
                   "config.json as 'sts_temperatures' (where the engine reads them)")
    c.add_argument("--device")
    c.add_argument("--dtype", default=None)
    return parser


def _bench(args) -> int:
    import torch

    from .bench import BenchConfig, run_bench, table

    if args.mode == "serve":
        return _bench_serve(args)

    if args.draft and not args.target:
        raise SystemExit("lfmspark bench: error: --draft needs --target (use --draft-preset with --preset)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("lfmspark bench: error: --device cuda but no CUDA device is available")
    if device == "cpu":
        torch.set_num_threads(1)   # many tiny ops: the intra-op pool costs more than it gives on CPU
    cfg = BenchConfig(preset=args.preset, target_dir=args.target, draft_dir=args.draft,
                      draft_preset=None if args.draft_preset == "none" else args.draft_preset,
                      batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
                      temperature=args.temperature, imposed_acceptance=args.imposed_acceptance, runs=args.runs,
                      hf=not args.no_hf, hf_compile=args.hf_compile,
                      hf_compile_timeout_s=args.hf_compile_timeout, device=device,
                      dtype=args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"), seed=args.seed,
                      phase_split=not args.no_phase_split, json_path=args.json, profile_dir=args.profile_dir,
                      prefill_graph_tokens=args.prefill_graph_tokens, markov_walk=args.markov_walk,
                      verify_widths=args.verify_widths, routing_locality=args.routing_locality, exact=args.exact)
    report = run_bench(cfg)
    print(table(report))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _bench_serve(args) -> int:
    import torch

    from .serve_bench import ServeBenchConfig, format_report, run_serve_bench

    if args.draft and not args.target:
        raise SystemExit("lfmspark bench: error: --draft needs --target (use --draft-preset with --preset)")
    if not args.request_rate > 0:
        raise SystemExit(f"lfmspark bench: error: --request-rate must be > 0, got {args.request_rate}")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"lfmspark bench: error: --range-ratio must be in [0, 1), got {args.range_ratio}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rates = args.imposed_acceptance[0] if args.imposed_acceptance else None
    draft_preset = None if args.draft_preset == "none" else args.draft_preset
    if rates is not None and len(rates) == 1 and not args.target:
        from ..models.presets import DEFAULT_DRAFT, draft_preset as draft_config

        name = DEFAULT_DRAFT.get(args.preset or "tiny") if draft_preset == "default" else draft_preset
        rates = rates * draft_config(name).block_size if name else rates
    cfg = ServeBenchConfig(preset=args.preset or ("lfm2.5-1.2b" if device.startswith("cuda") else "tiny"),
                           target_dir=args.target, draft_dir=args.draft, draft_preset=draft_preset,
                           num_prompts=args.num_prompts, input_len=args.prompt_len, output_len=args.output_len,
                           range_ratio=args.range_ratio, dataset=args.dataset, request_rate=args.request_rate,
                           max_concurrency=args.max_concurrency, max_batch=args.max_batch,
                           cuda_graph_sizes=args.cuda_graph_sizes, prefill_budget=args.prefill_budget,
                           capacity_fraction=args.capacity_fraction,
                           temperature=args.temperature, imposed_acceptance=rates, device=device,
                           dtype=args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
                           seed=args.seed, json_path=args.json)
    print(format_report(run_serve_bench(cfg)))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _generate(args) -> int:
    import torch

    from .bench import _dtype
    from .engine import Engine
    from .sampling import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    engine = Engine.from_pretrained(args.target, args.draft, dtype=dtype, device=device, max_batch=1,
                                    max_seq_len=args.max_seq_len, chat=not args.raw, exact=args.exact)
    if args.messages:
        with open(args.messages) as f:
            prompt = json.load(f)
    elif args.token_ids:
        prompt = args.token_ids
    else:
        prompt = args.prompt
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    t0 = time.perf_counter()
    output = None
    for event in engine.stream(prompt, params):
        if not args.no_stream:
            sys.stdout.write(event.text if event.text is not None else " ".join(map(str, event.token_ids)) + " ")
            sys.stdout.flush()
        if event.finished:
            output = event.output
    elapsed = time.perf_counter() - t0
    if args.no_stream:
        print(output.text if output.text is not None else " ".join(map(str, output.token_ids)))
    s = output.stats
    print(f"\n[{len(output.token_ids)} tokens in {elapsed:.2f} s ({len(output.token_ids) / elapsed:.1f} tok/s), "
          f"finish: {output.finish_reason}, TTFT {s.ttft_s * 1e3:.1f} ms"
          + (f", tau {s.tau:.2f} over {s.rounds} rounds" if s.rounds else "") + "]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    import torch

    from .bench import _dtype
    from .engine import Engine

    try:
        from ..serve import run_server
    except ImportError as e:
        raise SystemExit(f"lfmspark serve: error: {e.name} is missing: install the server extra with "
                         "pip install 'lfmspark[serve]'") from None
    if args.draft and not args.target:
        raise SystemExit("lfmspark serve: error: --draft needs --target (use --draft-preset with --preset)")
    if args.replicas is not None:
        return _serve_replicas(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    kw = dict(dtype=dtype, device=device, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
              batch_sizes=args.cuda_graph_sizes, prefill_budget=args.prefill_budget,
              verify_widths=args.verify_widths, exact=args.exact, prefix_cache_outputs=args.prefix_cache_outputs)
    if args.imposed_acceptance is not None:
        kw["imposed_acceptance"] = _imposed_rates(args.imposed_acceptance, args)
    if args.target:
        engine = Engine.from_pretrained(args.target, args.draft, **kw)
        name = args.served_model_name or Path(args.target).resolve().name
    else:
        draft = None if args.draft_preset == "none" else args.draft_preset
        engine = Engine.from_preset(args.preset, draft, **kw)
        name = args.served_model_name or args.preset
    run_server(engine, name, host=args.host, port=args.port, max_waiting=args.max_waiting,
               warmup=not args.no_warmup, log_level="debug" if args.verbose else "info")
    return 0


def _serve_replicas(args) -> int:
    """``lfmspark serve --replicas N``: the same server as N engines on Ray Serve (serve/ray_app.py), on
    a local Ray instance (or the cluster ``RAY_ADDRESS`` names), until interrupted."""
    try:
        import ray
        from ray import serve

        from ..serve.ray_app import deployments
    except ImportError as e:
        raise SystemExit(f"lfmspark serve: error: {e.name} is missing: install the Ray extra with "
                         "pip install 'lfmspark[ray]'") from None
    engine_kw = dict(max_batch=args.max_batch, max_seq_len=args.max_seq_len, batch_sizes=args.cuda_graph_sizes,
                     prefill_budget=args.prefill_budget, verify_widths=args.verify_widths, exact=args.exact,
                     prefix_cache_outputs=args.prefix_cache_outputs)
    if args.imposed_acceptance is not None:
        engine_kw["imposed_acceptance"] = _imposed_rates(args.imposed_acceptance, args)
    config = {"engine": engine_kw, "device": args.device, "dtype": args.dtype}
    if args.target:
        config.update(target=args.target, draft=args.draft)
        name = args.served_model_name or Path(args.target).resolve().name
    else:
        config.update(preset=args.preset, draft_preset=None if args.draft_preset == "none" else args.draft_preset)
        name = args.served_model_name or args.preset
    ray.init()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployments(config, name, args.replicas, warmup=not args.no_warmup, max_waiting=args.max_waiting),
              route_prefix="/", blocking=True)
    return 0


def _calibrate(args) -> int:
    import torch

    from .bench import _dtype
    from .calibration import fit_sts, record_rounds
    from .engine import Engine
    from .sampling import SamplingParams

    if args.target and not args.draft:
        raise SystemExit("lfmspark calibrate: error: --target needs --draft (the draft to calibrate)")
    if args.write_config and not args.draft:
        raise SystemExit("lfmspark calibrate: error: --write-config needs --draft (a checkpoint directory)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    kw = dict(dtype=dtype, device=device, max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    if args.target:
        engine = Engine.from_pretrained(args.target, args.draft, **kw, verify_widths=[_block_size(args.draft) + 1])
    else:
        from ..models.presets import DEFAULT_DRAFT, draft_preset

        name = DEFAULT_DRAFT.get(args.preset)
        if name is None:
            raise SystemExit(f"lfmspark calibrate: error: preset {args.preset} has no draft")
        engine = Engine.from_preset(args.preset, **kw, verify_widths=[draft_preset(name).block_size + 1])
    if engine.draft.confidence_head is None:
        raise SystemExit("lfmspark calibrate: error: the draft has no confidence head ('enable_confidence_head')")
    engine.draft.confidence_head.temperatures = None    # record the raw confidences
    engine.steps.want_confidence = True                 # before warm-up: the rounds are traced with it
    if engine.cuda_graphs:
        engine.warmup(sampling=args.temperature > 0)
    prompts = _calibration_prompts(args, engine)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=False)
    z, accepted = record_rounds(engine, prompts, params)
    fit = fit_sts(z, accepted)
    print(json.dumps(fit.as_dict()))
    print(f"{fit.rounds} rounds; ECE per position before: {[round(e, 4) for e in fit.ece_before]}, after: "
          f"{[round(e, 4) for e in fit.ece_after]}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(fit.as_dict(), indent=1) + "\n")
    if args.write_config:
        path = Path(args.draft) / "config.json"
        config = json.loads(path.read_text())
        config["sts_temperatures"] = fit.temperatures
        path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"sts_temperatures written to {path}", file=sys.stderr)
    return 0


def _block_size(draft_dir: str) -> int:
    from ..models.config import DraftConfig, read_json_object

    raw = read_json_object(Path(draft_dir) / "config.json")
    raw.setdefault("rope_is_neox_style", False)        # the pairing does not matter for the block size
    return DraftConfig.from_dict(raw).block_size


def _calibration_prompts(args, engine) -> list:
    if args.prompts:
        prompts = []
        with open(args.prompts) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or "prompt" not in record:
                        raise ValueError(f"{args.prompts} line {i}: expected an object with a 'prompt' field")
                    prompts.append(record["prompt"])
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompts")
        return prompts
    import torch

    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    return torch.randint(0, vocab, (args.num_prompts, 64), generator=gen).tolist()


def _imposed_rates(rates: list[float], args) -> list[float]:
    """One rate means every position; the engine checks the count against the draft's block."""
    if len(rates) > 1:
        return rates
    from ..models.presets import DEFAULT_DRAFT, draft_preset

    if args.draft_preset == "none":
        raise SystemExit("lfmspark serve: error: --imposed-acceptance needs a draft (not --draft-preset none)")
    name = DEFAULT_DRAFT.get(args.preset) if args.draft_preset == "default" else args.draft_preset
    if args.target or name is None:
        raise SystemExit("lfmspark serve: error: --imposed-acceptance with one value needs a preset draft; "
                         "give one rate per draft position")
    return rates * draft_preset(name).block_size


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return {"bench": _bench, "generate": _generate, "serve": _serve, "calibrate": _calibrate}[args.command](args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"lfmspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
