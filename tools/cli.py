"""``lfmspark`` command line: ``bench`` (the latency benchmark), ``bench serve``, ``generate``, ``serve``
and ``calibrate``. Every command takes the engine's flags (runtime/config.py ``EngineConfig``) with
the same names and defaults.

    lfmspark bench                                   # built-in preset: tiny on CPU, LFM2.5-1.2B + draft on a GPU
    lfmspark bench --preset lfm2-8b-a1b --batch-sizes 1,4,16 --imposed-acceptance 0.9 --json out.json
    lfmspark bench serve --preset lfm2.5-1.2b --max-batch 64 --num-prompts 200 --request-rate 20
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
from ..runtime.config import EngineConfig, int_list, positive_int


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, unless the help says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lfmspark", description="LFM2 / LFM2-MoE inference with DSpark "
                                     "speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = dict(formatter_class=_HelpFormatter)

    b = sub.add_parser("bench", help="latency benchmark: target-only, HF transformers and DSpark in one run; "
                       "'bench serve': the open-loop serving benchmark", **formatter)
    b.add_argument("mode", nargs="?", choices=["latency", "serve"], default="latency",
                   help="latency: closed-loop batches; serve: open-loop arrivals through AsyncEngine, "
                        "target-only and speculative on one trace (as vllm bench serve)")
    EngineConfig.add_arguments(b, acceptance_profiles=True)
    m = b.add_argument_group("what is measured")
    m.add_argument("--batch-sizes", type=int_list, default=[1], help="comma-separated batch sizes (latency)")
    m.add_argument("--prompt-len", type=positive_int, default=128)
    m.add_argument("--output-len", type=positive_int, default=128)
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--runs", type=positive_int, default=3)
    m.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    m.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
    m.add_argument("--hf-compile-timeout", type=float, default=600.0, help="seconds the HF compiled baseline "
                   "(a child process) may take per batch size before it is reported as failed")
    m.add_argument("--no-phase-split", action="store_true", help="skip timing draft/verify/commit separately")
    m.add_argument("--json", help="write the full report here")
    m.add_argument("--profile-dir", help="write per-kernel profiles of the step replays (smallest batch) here")
    sv = b.add_argument_group("serve mode (lfmspark bench serve)")
    sv.add_argument("--num-prompts", type=positive_int, default=64)
    sv.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all "
                    "at once)")
    sv.add_argument("--max-concurrency", type=positive_int, help="requests in flight at most")
    sv.add_argument("--range-ratio", type=float, default=0.0, help="prompt and output lengths drawn in "
                    "[len * (1 - r), len * (1 + r)] (random prompts)")
    sv.add_argument("--dataset", help="JSONL file, one {'prompt': text or token ids, 'output_len': n} per line")
    sv.add_argument("--capacity-fraction", type=float, help="measure each engine's capacity (the trace all at "
                    "once), then serve the trace with Poisson arrivals at this fraction of it (e.g. 0.7)")

    g = sub.add_parser("generate", help="generate text with a checkpoint or preset, streaming to the terminal",
                       **formatter)
    EngineConfig.add_arguments(g, source_required=True)
    msg = g.add_argument_group("prompt").add_mutually_exclusive_group(required=True)
    msg.add_argument("--prompt", help="user prompt (wrapped in the chat template when the tokenizer has one)")
    msg.add_argument("--messages", help="JSON file with a list of chat messages")
    msg.add_argument("--token-ids", type=int_list, help="comma-separated prompt token ids")
    s = g.add_argument_group("sampling")
    s.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    s.add_argument("--max-new-tokens", type=positive_int, default=256)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--no-stream", action="store_true", help="print the text once at the end")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs: pip install 'lfmspark[serve]')",
                        **formatter)
    EngineConfig.add_arguments(sv, source_required=True)
    h = sv.add_argument_group("server")
    h.add_argument("--served-model-name", help="the model name clients send (default: the target directory's "
                   "name or the preset)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=positive_int, default=8000)
    h.add_argument("--max-waiting", type=positive_int, default=256, help="requests that may wait for a slot; past "
                   "it the server answers 503")
    h.add_argument("--no-warmup", action="store_true", help="serve at once, compiling on first use")
    h.add_argument("--replicas", type=positive_int, help="serve this many engines behind one endpoint on Ray Serve "
                   "(one GPU each; needs: pip install 'lfmspark[ray]'); routing keeps a conversation on the "
                   "replica holding its prefix cache")

    c = sub.add_parser("calibrate", help="fit the draft's confidence temperatures (STS) from recorded rounds",
                       **formatter)
    EngineConfig.add_arguments(c, source_required=True)
    r = c.add_argument_group("calibration")
    r.add_argument("--prompts", help="JSONL file, one {'prompt': text or token ids} per line (default: random "
                   "token ids, which calibrate nothing real)")
    r.add_argument("--num-prompts", type=positive_int, default=64, help="random prompts without --prompts")
    r.add_argument("--max-new-tokens", type=positive_int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="the deployment temperature the confidences are "
                   "calibrated for (reference/dspark.md §4.2)")
    r.add_argument("--out", help="write the fit (temperatures, ECE before and after) as JSON here")
    r.add_argument("--write-config", action="store_true", help="store the temperatures in the draft's "
                   "config.json as 'sts_temperatures' (where the engine reads them)")
    return parser


def _engine_config(args, command: str, **overrides) -> EngineConfig:
    if args.draft and not args.target:
        raise SystemExit(f"lfmspark {command}: error: --draft needs --target (use --draft-preset with --preset)")
    cfg = EngineConfig.from_args(args, **overrides)
    device = cfg.torch_device()
    if device.type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"lfmspark {command}: error: --device cuda but no CUDA device is available")
    return cfg


def _single_thread_on_cpu(cfg: EngineConfig) -> None:
    """Many tiny ops on a CPU: torch's intra-op pool costs more than it gives, beside the engine."""
    if cfg.torch_device().type == "cpu":
        import torch

        torch.set_num_threads(1)


def _bench(args) -> int:
    if args.mode == "serve":
        return _bench_serve(args)
    from .bench import BenchConfig, run_bench, table

    derived = [flag for flag, value in (("--max-batch", args.max_batch), ("--max-seq-len", args.max_seq_len),
                                        ("--cuda-graph-sizes", args.cuda_graph_sizes)) if value is not None]
    if derived:
        raise SystemExit(f"lfmspark bench: error: {', '.join(derived)} follow --batch-sizes, --prompt-len and "
                         "--output-len in the latency benchmark: set those instead")
    engine = _engine_config(args, "bench", imposed_acceptance=None)
    _single_thread_on_cpu(engine)
    cfg = BenchConfig(engine=engine, batch_sizes=args.batch_sizes, prompt_len=args.prompt_len,
                      output_len=args.output_len, temperature=args.temperature,
                      imposed_acceptance=args.imposed_acceptance, runs=args.runs, hf=not args.no_hf,
                      hf_compile=args.hf_compile, hf_compile_timeout_s=args.hf_compile_timeout,
                      phase_split=not args.no_phase_split, json_path=args.json, profile_dir=args.profile_dir)
    report = run_bench(cfg)
    print(table(report))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _bench_serve(args) -> int:
    from .serve_bench import ServeBenchConfig, fitted_seq_len, format_report, run_serve_bench

    if not args.request_rate > 0:
        raise SystemExit(f"lfmspark bench: error: --request-rate must be > 0, got {args.request_rate}")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"lfmspark bench: error: --range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.imposed_acceptance is not None and len(args.imposed_acceptance) > 1:
        raise SystemExit("lfmspark bench serve: error: --imposed-acceptance takes one profile here")
    cfg = ServeBenchConfig(engine=_engine_config(args, "bench"), num_prompts=args.num_prompts,
                           input_len=args.prompt_len, output_len=args.output_len, range_ratio=args.range_ratio,
                           dataset=args.dataset, request_rate=args.request_rate,
                           max_concurrency=args.max_concurrency, capacity_fraction=args.capacity_fraction,
                           temperature=args.temperature, json_path=args.json)
    if args.max_seq_len is None:
        cfg.engine = cfg.engine.replace(max_seq_len=fitted_seq_len(cfg))
    print(format_report(run_serve_bench(cfg)))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _generate(args) -> int:
    from ..runtime.engine import Engine
    from ..runtime.sampling import SamplingParams

    cfg = _engine_config(args, "generate", **({"chat": False} if args.raw else {}))
    _single_thread_on_cpu(cfg)
    engine = Engine.from_config(cfg)
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


def _served_name(args) -> str:
    return args.served_model_name or (Path(args.target).resolve().name if args.target else args.preset)


def _serve(args) -> int:
    from ..runtime.engine import Engine

    try:
        from ..serve import run_server
    except ImportError as e:
        raise SystemExit(f"lfmspark serve: error: {e.name} is missing: install the server extra with "
                         "pip install 'lfmspark[serve]'") from None
    cfg = _engine_config(args, "serve")
    if args.replicas is not None:
        return _serve_replicas(args, cfg)
    engine = Engine.from_config(cfg)
    run_server(engine, _served_name(args), host=args.host, port=args.port, max_waiting=args.max_waiting,
               warmup=not args.no_warmup, log_level="debug" if args.verbose else "info")
    return 0


def _serve_replicas(args, cfg: EngineConfig) -> int:
    """``lfmspark serve --replicas N``: the same server as N engines on Ray Serve (serve/ray_app.py), on
    a local Ray instance (or the cluster ``RAY_ADDRESS`` names), until interrupted."""
    try:
        import ray
        from ray import serve

        from ..serve.ray_app import deployments
    except ImportError as e:
        raise SystemExit(f"lfmspark serve: error: {e.name} is missing: install the Ray extra with "
                         "pip install 'lfmspark[ray]'") from None
    ray.init()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployments(cfg, _served_name(args), args.replicas, warmup=not args.no_warmup,
                          max_waiting=args.max_waiting), route_prefix="/", blocking=True)
    return 0


def _calibrate(args) -> int:
    from ..models.config import DraftConfig
    from ..models.presets import draft_preset
    from ..runtime.engine import Engine
    from ..runtime.loader import draft_preset_name
    from ..runtime.sampling import SamplingParams
    from .calibration import fit_sts, record_rounds

    if args.target and not args.draft:
        raise SystemExit("lfmspark calibrate: error: --target needs --draft (the draft to calibrate)")
    if args.write_config and not args.draft:
        raise SystemExit("lfmspark calibrate: error: --write-config needs --draft (a checkpoint directory)")
    cfg = _engine_config(args, "calibrate")
    if args.draft:
        # the pairing does not matter for the block size
        block = DraftConfig.from_pretrained(args.draft, defaults={"rope_is_neox_style": False}).block_size
    else:
        name = draft_preset_name(cfg)
        if name is None:
            raise SystemExit(f"lfmspark calibrate: error: preset {cfg.preset} has no draft")
        block = draft_preset(name).block_size
    engine = Engine.from_config(cfg.replace(verify_widths=[block + 1]))
    if engine.draft.confidence_head is None:
        raise SystemExit("lfmspark calibrate: error: the draft has no confidence head ('enable_confidence_head')")
    engine.draft.confidence_head.temperatures = None    # record the raw confidences
    engine.model_runner.steps.want_confidence = True    # before warm-up: the rounds are traced with it
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
    return torch.randint(0, engine.model_config.vocab_size, (args.num_prompts, 64), generator=gen).tolist()


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
