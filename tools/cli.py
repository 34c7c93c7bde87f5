"""``lfmspark`` command line: ``bench`` (the latency benchmark), ``bench serve``, the named benchmark
scenarios (``bench sampling|warmup|multiturn|exact``: tools/scenarios/), ``generate``, ``serve`` and
``calibrate``. Every command takes the engine's flags (runtime/config.py ``EngineConfig``) with the
same names and defaults.

    lfmspark bench                                   # built-in preset: tiny on CPU, LFM2.5-1.2B + draft on a GPU
    lfmspark bench --preset lfm2-8b-a1b --batch-sizes 1,4,16 --imposed-acceptance 0.9 --json out.json
    lfmspark bench serve --preset lfm2.5-1.2b --max-batch 64 --num-prompts 200 --request-rate 20
    lfmspark bench sampling --preset lfm2.5-1.2b --imposed-acceptance 0.8 --json out.json
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
from .bench import command_line
from .scenarios import SCENARIOS

# The flags of ``bench`` whose default depends on the mode: the latency benchmark's, the serving
# benchmark's and each scenario's (its SHARED). A scenario reads only the flags named here, the
# engine's and its own group's, and refuses any other flag given; the latency and serving
# benchmarks also read their own groups' flags, and refuse the scenarios'.
MODE_DEFAULTS: dict[str, dict] = {
    "latency": {"batch_sizes": [1], "prompt_len": 128, "output_len": 128, "runs": 3},
    "serve": {"prompt_len": 128, "output_len": 128, "num_prompts": 64},
    **{name: scenario.SHARED for name, scenario in SCENARIOS.items()},
}


def _defaults_help(dest: str) -> str:
    """``(default: 128; sampling, exact: 256; ...)`` from MODE_DEFAULTS."""
    by_value: dict[str, list[str]] = {}
    for mode, defaults in MODE_DEFAULTS.items():
        if defaults.get(dest) is not None:
            value = defaults[dest]
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            by_value.setdefault(text, []).append(mode)
    parts = [f"{', '.join(modes)}: {value}" for value, modes in by_value.items()]
    return f"(default: {'; '.join(parts)})"


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
                       "'bench serve': the open-loop serving benchmark; 'bench SCENARIO': a named scenario "
                       f"({', '.join(SCENARIOS)})", **formatter)
    modes = "; ".join(f"{name}: {scenario.SUMMARY}" for name, scenario in SCENARIOS.items())
    b.add_argument("mode", nargs="?", choices=["latency", "serve", *SCENARIOS], default="latency",
                   help="latency: closed-loop batches; serve: open-loop arrivals through AsyncEngine, "
                        f"target-only and speculative on one trace (as vllm bench serve); {modes}")
    EngineConfig.add_arguments(b, acceptance_profiles=True)
    m = b.add_argument_group("what is measured")
    m.add_argument("--batch-sizes", type=int_list, default=None, help="comma-separated batch sizes measured "
                   + _defaults_help("batch_sizes"))
    m.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens per request "
                   + _defaults_help("prompt_len"))
    m.add_argument("--output-len", type=positive_int, default=None, help="new tokens per request (a reply in "
                   "multiturn) " + _defaults_help("output_len"))
    m.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (latency, serve)")
    m.add_argument("--runs", type=positive_int, default=None, help="timed batches per measurement "
                   + _defaults_help("runs"))
    m.add_argument("--num-prompts", type=positive_int, default=None, help="requests in the serve trace; prompts of "
                   "the exact scenario's identity run " + _defaults_help("num_prompts"))
    m.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    m.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
    m.add_argument("--hf-compile-timeout", type=float, default=600.0, help="seconds the HF compiled baseline "
                   "(a child process) may take per batch size before it is reported as failed")
    m.add_argument("--no-phase-split", action="store_true", help="skip timing draft/verify/commit separately")
    m.add_argument("--json", help="write the full report here")
    m.add_argument("--profile-dir", help="write per-kernel profiles here: of the step replays at the smallest batch "
                   "(latency), of a batch-1 model-card request (sampling)")
    sv = b.add_argument_group("serve mode (lfmspark bench serve)")
    sv.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all "
                    "at once)")
    sv.add_argument("--max-concurrency", type=positive_int, help="requests in flight at most")
    sv.add_argument("--range-ratio", type=float, default=0.0, help="prompt and output lengths drawn in "
                    "[len * (1 - r), len * (1 + r)] (random prompts)")
    sv.add_argument("--dataset", help="JSONL file, one {'prompt': text or token ids, 'output_len': n} per line")
    sv.add_argument("--capacity-fraction", type=float, help="measure each engine's capacity (the trace all at "
                    "once), then serve the trace with Poisson arrivals at this fraction of it (e.g. 0.7)")
    # each scenario's own flags, in a group of its own: their destinations, for _check_mode_flags
    b.set_defaults(scenario_flags={name: scenario.add_arguments(b) for name, scenario in SCENARIOS.items()})

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
    h.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                   "/detokenize (/health, /metrics and /version stay open); default: LFMSPARK_API_KEY, else none")
    h.add_argument("--allowed-origins", type=lambda t: [o.strip() for o in t.split(",") if o.strip()], default=[],
                   metavar="ORIGINS", help="comma-separated origins browsers may call from (CORS; default: none)")
    h.add_argument("--max-request-bytes", type=positive_int, default=None, help="larger request bodies get 413 "
                   "before they are read (default: 16 MiB)")
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


def _bench(args) -> int:
    _check_mode_flags(args)
    for dest, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, dest) is None and value is not None:
            setattr(args, dest, list(value) if isinstance(value, list) else value)
    if args.mode == "serve":
        return _bench_serve(args)
    if args.mode in SCENARIOS:
        return _bench_scenario(args)
    from .bench import BenchConfig, run_bench, table

    derived = [flag for flag, value in (("--max-batch", args.max_batch), ("--max-seq-len", args.max_seq_len),
                                        ("--cuda-graph-sizes", args.cuda_graph_sizes)) if value is not None]
    if derived:
        raise SystemExit(f"lfmspark bench: error: {', '.join(derived)} follow --batch-sizes, --prompt-len and "
                         "--output-len in the latency benchmark: set those instead")
    engine = _engine_config(args, "bench", imposed_acceptance=None)
    cfg = BenchConfig(engine=engine, batch_sizes=args.batch_sizes, prompt_len=args.prompt_len,
                      output_len=args.output_len, temperature=args.temperature,
                      imposed_acceptance=args.imposed_acceptance, runs=args.runs, hf=not args.no_hf,
                      hf_compile=args.hf_compile, hf_compile_timeout_s=args.hf_compile_timeout,
                      phase_split=not args.no_phase_split, json_path=args.json, profile_dir=args.profile_dir,
                      command=args.command_line)
    report = run_bench(cfg)
    print(table(report))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _check_mode_flags(args) -> None:
    """Refuse a flag the mode does not read: another scenario's anywhere, and in a scenario any flag
    besides the engine's, its own and the shared ones it names (MODE_DEFAULTS)."""
    defaults = vars(build_parser().parse_args(["bench", args.mode]))
    given = [dest for dest, value in vars(args).items() if dest in defaults and value != defaults[dest]]
    owner = {dest: name for name, dests in args.scenario_flags.items() for dest in dests}
    if args.mode in SCENARIOS:
        allowed = _engine_dests() | set(MODE_DEFAULTS[args.mode]) | set(args.scenario_flags[args.mode])
        stray = [dest for dest in given if dest not in allowed and dest not in ("mode", "verbose")]
    else:
        stray = [dest for dest in given if dest in owner]
    if stray:
        flags = ", ".join("--" + dest.replace("_", "-") + (f" ({owner[dest]} scenario)" if dest in owner else "")
                          for dest in stray)
        what = f"the {args.mode} scenario" if args.mode in SCENARIOS else f"lfmspark bench {args.mode}"
        raise SystemExit(f"lfmspark bench {args.mode}: error: {flags} {'does' if len(stray) == 1 else 'do'} not "
                         f"apply to {what}")


def _engine_dests() -> set[str]:
    """The destinations of the engine's flags (EngineConfig.add_arguments)."""
    parser = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_arguments(parser, acceptance_profiles=True)
    return set(vars(parser.parse_args([])))


def _bench_scenario(args) -> int:
    """``lfmspark bench SCENARIO``: the engine's flags, the scenario's own and the shared ones it reads."""
    scenario = SCENARIOS[args.mode]
    if args.imposed_acceptance is not None and len(args.imposed_acceptance) > 1:
        raise SystemExit(f"lfmspark bench {args.mode}: error: --imposed-acceptance takes one profile here")
    engine = _engine_config(args, "bench")
    # the engine sizes the scenario fits to what it measures, unless the command line sets them
    fit = tuple(name for name, flag in (("max_batch", args.max_batch), ("max_seq_len", args.max_seq_len),
                                        ("batch_sizes", args.cuda_graph_sizes)) if flag is None)
    cfg = scenario.config(args, engine=engine, fit=fit, command=args.command_line)
    report = scenario.run(cfg)
    print(scenario.table(report))
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
        from ..serve import PortInUseError, check_port_free, run_server
    except ImportError as e:
        raise SystemExit(f"lfmspark serve: error: {e.name} is missing: install the server extra with "
                         "pip install 'lfmspark[serve]'") from None
    cfg = _engine_config(args, "serve")
    try:
        check_port_free(args.host, args.port)        # before the minutes of loading and warm-up, not after
    except PortInUseError as e:
        raise SystemExit(f"lfmspark serve: error: {e}") from None
    if args.replicas is not None:
        return _serve_replicas(args, cfg)
    engine = Engine.from_config(cfg)
    run_server(engine, _served_name(args), host=args.host, port=args.port, max_waiting=args.max_waiting,
               warmup=not args.no_warmup, log_level="debug" if args.verbose else "info", **_server_options(args))
    return 0


def _server_options(args) -> dict:
    """The app's request checks: the API key, CORS origins and the body limit."""
    options = dict(api_key=args.api_key, allowed_origins=args.allowed_origins)
    if args.max_request_bytes is not None:
        options["max_request_bytes"] = args.max_request_bytes
    return options


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
                          max_waiting=args.max_waiting, server_options=_server_options(args)),
              route_prefix="/", blocking=True)
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
    args.command_line = command_line(argv)      # what the reports record
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return {"bench": _bench, "generate": _generate, "serve": _serve, "calibrate": _calibrate}[args.command](args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"lfmspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
