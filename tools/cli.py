"""``lfmspark`` command line: ``bench`` (the latency benchmark), ``bench serve``, the named benchmark
scenarios (``bench sampling|warmup|multiturn|exact|structured``: tools/scenarios/), ``generate``, ``serve`` and
``calibrate``. Every command takes the engine's flags (runtime/config.py ``EngineConfig``) with the
same names and defaults.

    lfmspark bench                                   # built-in preset: tiny on CPU, LFM2.5-1.2B + draft on a GPU
    lfmspark bench --preset lfm2-8b-a1b --batch-sizes 1,4,16 --imposed-acceptance 0.9 --json out.json
    lfmspark bench serve --preset lfm2.5-1.2b --max-batch 64 --num-prompts 200 --request-rate 20
    lfmspark bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20   # any OpenAI server
    lfmspark bench sampling --preset lfm2.5-1.2b --imposed-acceptance 0.8 --json out.json
    lfmspark generate --target DIR [--draft DIR] --prompt "Hello" [--temperature 0.7]
    lfmspark serve --target DIR [--draft DIR] [--port 8000]    # OpenAI-compatible server (the serve extra)
    lfmspark calibrate --target DIR --draft DIR --prompts prompts.jsonl --write-config   # the draft's STS temperatures

``bench`` has one parser per mode (``lfmspark bench MODE --help`` shows that mode's flags and
defaults); a ``bench`` command line without a mode is the latency benchmark's (:func:`with_bench_mode`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from ..models.config import ConfigError
from ..models.loading import CheckpointError
from ..runtime.config import EngineConfig, int_list, positive_int
from .bench import command_line
from .scenarios import SCENARIOS
from .serve_bench import DEFAULT_VOCAB, ENDPOINTS

BENCH_MODES: tuple[str, ...] = ("latency", "serve", *SCENARIOS)

# The flags several bench modes read, each defined once: destination -> (flag, argparse keywords,
# help; a dict holds a mode's own wording, "*" the others'). A mode's parser gets the ones its
# MODE_DEFAULTS entry names, with that entry's default, so its --help shows its own.
_SHARED_FLAGS: dict[str, tuple[str, dict, str | dict[str, str]]] = {
    "batch_sizes": ("--batch-sizes", dict(type=int_list), {
        "*": "comma-separated batch sizes measured",
        "warmup": "comma-separated batch sizes whose TPOT is measured after the warm-up (--cuda-graph-sizes: "
                  "the captured ones)"}),
    "prompt_len": ("--prompt-len", dict(type=positive_int), "prompt tokens per request"),
    "output_len": ("--output-len", dict(type=positive_int), {"*": "new tokens per request",
                                                              "multiturn": "new tokens of each reply"}),
    "temperature": ("--temperature", dict(type=float), "the requests' temperature"),
    "runs": ("--runs", dict(type=positive_int), "timed batches per measurement"),
    "num_prompts": ("--num-prompts", dict(type=positive_int), {"*": "requests in the trace",
                                                               "exact": "prompts of the identity run",
                                                               "fp8": "prompts teacher-forced (positions: this "
                                                                      "times --prompt-len)"}),
    "json": ("--json", dict(metavar="FILE"), "write the full report here"),
    "profile_dir": ("--profile-dir", dict(metavar="DIR"), {
        "*": "write per-kernel profiles here",
        "latency": "write per-kernel profiles of the step replays at the smallest batch here",
        "sampling": "write the speculative engine's per-kernel profiles of a greedy and a model-card batch at "
                    "each batch size here"}),
}

# Each mode's shared flags and their defaults (a scenario's: its SHARED).
MODE_DEFAULTS: dict[str, dict] = {
    "latency": {"batch_sizes": [1], "prompt_len": 128, "output_len": 128, "temperature": 0.0, "runs": 3,
                "json": None, "profile_dir": None},
    "serve": {"prompt_len": 128, "output_len": 128, "temperature": 0.0, "num_prompts": 64, "json": None},
    **{name: scenario.SHARED for name, scenario in SCENARIOS.items()},
}

MODE_SUMMARIES: dict[str, str] = {
    "latency": "closed-loop batches: target-only, HF transformers and DSpark in one run (the default mode)",
    "serve": "open-loop arrivals, target-only and speculative on one trace through AsyncEngine, or any "
             "OpenAI-compatible server over HTTP (--base-url), as vllm bench serve",
    **{name: scenario.SUMMARY for name, scenario in SCENARIOS.items()},
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, unless the help says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _add_shared_flags(parser: argparse.ArgumentParser, mode: str) -> None:
    """The shared flags ``mode`` reads (MODE_DEFAULTS), with its defaults, in one group."""
    group = parser.add_argument_group("what is measured")
    for dest, default in MODE_DEFAULTS[mode].items():
        flag, kwargs, helps = _SHARED_FLAGS[dest]
        text = helps if isinstance(helps, str) else helps.get(mode, helps["*"])
        if default is not None:
            text += f" (default: {_shown(default)})"
        group.add_argument(flag, dest=dest, default=list(default) if isinstance(default, list) else default,
                           help=text, **kwargs)


def _add_bench_mode(parser: argparse.ArgumentParser, mode: str) -> None:
    """Every flag of ``lfmspark bench MODE``: the engine's, the shared ones it reads, its own groups."""
    EngineConfig.add_arguments(parser, acceptance_profiles=True)
    _add_shared_flags(parser, mode)
    if mode == "latency":
        m = parser.add_argument_group("latency benchmark")
        m.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
        m.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
        m.add_argument("--hf-compile-timeout", type=float, default=600.0, help="seconds the HF compiled baseline "
                       "(a child process) may take per batch size before it is reported as failed")
        m.add_argument("--no-phase-split", action="store_true", help="skip timing draft/verify/commit separately")
    elif mode == "serve":
        _add_serve_flags(parser)
    else:
        SCENARIOS[mode].add_arguments(parser)


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``bench serve``'s own groups: the trace's arrivals and prompts, and the server to drive instead
    of in-process engines. ``--model`` names the server's model with ``--base-url`` and is ``--target``
    without it (as everywhere else), so it replaces the engine's alias (the parser resolves conflicts)."""
    sv = parser.add_argument_group("the trace")
    sv.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all "
                    "at once)")
    sv.add_argument("--max-concurrency", type=positive_int, help="requests in flight at most")
    sv.add_argument("--range-ratio", type=float, default=0.0, help="prompt and output lengths drawn in "
                    "[len * (1 - r), len * (1 + r)] (random prompts)")
    sv.add_argument("--dataset", help="JSONL file, one {'prompt': text or token ids, 'output_len': n} per line")
    sv.add_argument("--capacity-fraction", type=float, help="measure each engine's (or the server's) capacity "
                    "(the trace all at once), then serve the trace with Poisson arrivals at this fraction of it "
                    "(e.g. 0.7)")
    h = parser.add_argument_group("an OpenAI-compatible server instead of in-process engines (needs httpx: "
                                  "pip install 'lfmspark[serve]')")
    h.add_argument("--base-url", metavar="URL", help="drive the trace over HTTP, streaming, against the server "
                   "at URL (e.g. http://127.0.0.1:8000; lfmspark serve, vLLM, SGLang); the engine flags that "
                   "build in-process engines are refused with it")
    h.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions", help="/v1/completions, or "
                   "/v1/chat/completions with each prompt as one user message (text prompts only: a --dataset)")
    h.add_argument("--model", metavar="NAME", help="with --base-url: the model name the requests send (default: "
                   "the first id of GET /v1/models); without it: the same as --target")
    h.add_argument("--api-key", help="with --base-url: sent as 'Authorization: Bearer KEY' (default: "
                   "OPENAI_API_KEY, else none)")
    h.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB, help="with --base-url: random "
                   "prompts' token ids are drawn below this, as the in-process trace draws them below the "
                   "target's vocabulary (LFM2's and LFM2.5-1.2B's; LFM2.5-8B-A1B: 128000)")


def _mode_parser(mode: str) -> argparse.ArgumentParser:
    """A stand-alone parser of one bench mode: its defaults and flag names."""
    parser = argparse.ArgumentParser(prog=f"lfmspark bench {mode}", add_help=False,
                                     conflict_handler="resolve" if mode == "serve" else "error")
    _add_bench_mode(parser, mode)
    return parser


def _defaults_epilog() -> str:
    """Each mode's defaults of the shared flags, for ``lfmspark bench --help``."""
    lines = ["defaults of the shared flags, by mode:"]
    for mode, defaults in MODE_DEFAULTS.items():
        shown = " ".join(f"{_SHARED_FLAGS[dest][0]} {_shown(v)}" for dest, v in defaults.items() if v is not None)
        lines.append(f"  {mode}: {shown}")
    return "\n".join(lines)


def with_bench_mode(argv: list[str]) -> list[str]:
    """``argv`` with ``latency`` inserted after ``bench`` when no mode follows it, so that every
    ``lfmspark bench [flags]`` command line is still the latency benchmark's while each mode has a
    parser (and a --help) of its own. ``bench --help`` alone keeps the list of modes."""
    for i, word in enumerate(argv):
        if word.startswith("-"):             # lfmspark's own flags (-v) come before the command
            continue
        rest = argv[i + 1:]
        if word == "bench" and not (rest and rest[0] in BENCH_MODES) and rest not in (["-h"], ["--help"]):
            return [*argv[:i + 1], "latency", *rest]
        return list(argv)
    return list(argv)


def build_parser() -> argparse.ArgumentParser:
    """The parser of :func:`main`, which first puts a bench command line through :func:`with_bench_mode`."""
    parser = argparse.ArgumentParser(prog="lfmspark", description="LFM2 / LFM2-MoE inference with DSpark "
                                     "speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = dict(formatter_class=_HelpFormatter)

    b = sub.add_parser("bench", help="latency benchmark: target-only, HF transformers and DSpark in one run; "
                       "'bench serve': the open-loop serving benchmark; 'bench SCENARIO': a named scenario "
                       f"({', '.join(SCENARIOS)})",
                       description="Benchmarks. Without a mode, the flags are the latency benchmark's; "
                       "'lfmspark bench MODE --help' shows a mode's flags and defaults.",
                       epilog=_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = b.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode in BENCH_MODES:
        m = modes.add_parser(mode, help=MODE_SUMMARIES[mode], description=f"lfmspark bench {mode}: "
                             f"{MODE_SUMMARIES[mode]}.", conflict_handler="resolve" if mode == "serve" else "error",
                             **formatter)
        _add_bench_mode(m, mode)

    g = sub.add_parser("generate", help="generate text with a checkpoint or preset, streaming to the terminal",
                       **formatter)
    EngineConfig.add_arguments(g, source_required=True)
    msg = g.add_argument_group("prompt").add_mutually_exclusive_group(required=True)
    msg.add_argument("--prompt", help="user prompt (wrapped in the chat template when the tokenizer has one)")
    msg.add_argument("--messages", help="JSON file with a list of chat messages")
    msg.add_argument("--token-ids", type=int_list, help="comma-separated prompt token ids")
    s = g.add_argument_group("sampling")
    s.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    s.add_argument("--max-new-tokens", type=positive_int, help="the most tokens to generate (default: the "
                   "checkpoint's generation_config.json, else 256)")
    s.add_argument("--temperature", type=float, help="0 is greedy (default: the checkpoint's, else 0)")
    s.add_argument("--top-k", type=int, help="0 is off (default: the checkpoint's, else 0)")
    s.add_argument("--top-p", type=float, help="1 is off (default: the checkpoint's, else 1)")
    s.add_argument("--no-stream", action="store_true", help="print the text once at the end")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs: pip install 'lfmspark[serve]')",
                        **formatter)
    EngineConfig.add_arguments(sv, source_required=True)
    h = sv.add_argument_group("server")
    h.add_argument("--served-model-name", help="the model name clients send (default: the target directory's "
                   "name or the preset)")
    h.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    h.add_argument("--port", type=positive_int, default=8000, help="the port to listen on")
    h.add_argument("--max-waiting", type=positive_int, default=256, help="requests that may wait for a slot; past "
                   "it the server answers 503")
    h.add_argument("--no-warmup", action="store_true", help="serve at once, compiling on first use")
    h.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                   "/detokenize (/health, /metrics and /version stay open); default: LFMSPARK_API_KEY, else none")
    h.add_argument("--allowed-origins", type=lambda t: [o.strip() for o in t.split(",") if o.strip()], default=[],
                   metavar="ORIGINS", help="comma-separated origins browsers may call from (CORS; default: none)")
    h.add_argument("--max-request-bytes", type=positive_int, default=None, help="larger request bodies get 413 "
                   "before they are read (default: 16 MiB)")
    h.add_argument("--reasoning-parser", choices=("lfm2", "qwen3", "deepseek_r1"), default=None,
                   help="split <think>...</think> reasoning out of chat answers into reasoning_content (vLLM's "
                   "flag; the three names are one parser: docs/api.md); default: off, reasoning stays in content")
    h.add_argument("--tool-call-parser", choices=("lfm2",), default="lfm2", help="how tool calls are read from "
                   "the output (LFM2's format; requests with tools are always parsed)")
    h.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM command lines; tool "
                   "choice 'auto' is always on")
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
    r.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens generated per prompt")
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
    if args.mode == "serve":
        return _bench_serve(args)
    if args.mode in SCENARIOS:
        return _bench_scenario(args)
    from .bench import BenchConfig, run_bench, table

    derived = [flag for flag, value in (("--max-batch", args.max_batch), ("--max-seq-len", args.max_seq_len),
                                        ("--cuda-graph-sizes", args.cuda_graph_sizes)) if value is not None]
    if derived:
        raise SystemExit(f"lfmspark bench: error: {', '.join(derived)}: set by --batch-sizes, --prompt-len and "
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


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Refuse what the command's parser did not take. A bench flag of another mode is named with
    the mode it belongs to, rather than as an unrecognised argument: each mode's parser holds only
    the flags it reads, so a flag another mode reads would otherwise be silently ignored there."""
    options = [word.split("=", 1)[0] for word in unknown if word.startswith("-")]
    if args.command == "bench":
        where = f"lfmspark bench {args.mode}"
        misplaced = [word for word in unknown if word in BENCH_MODES]
        if misplaced:
            raise SystemExit(f"{where}: error: the mode ({misplaced[0]}) goes right after 'bench'")
        owners = _bench_flag_owners()
        if options and all(flag in owners for flag in options):
            stray = sorted(dict.fromkeys(options), key=list(owners).index)
            flags = ", ".join(flag + (f" ({owners[flag]} scenario)" if owners[flag] else "") for flag in stray)
            what = f"the {args.mode} scenario" if args.mode in SCENARIOS else where
            raise SystemExit(f"{where}: error: {flags} {'does' if len(stray) == 1 else 'do'} not apply to {what}")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")


def _bench_flag_owners() -> dict[str, str | None]:
    """Every bench flag, in the order the refusals list them (the shared ones first), with the
    scenario that alone reads it (None: a shared flag, or the latency or serving benchmark's)."""
    owners: dict[str, str | None] = {flag: None for flag, _, _ in _SHARED_FLAGS.values()}
    for mode in BENCH_MODES:
        for action in _mode_parser(mode)._actions:
            for flag in action.option_strings:
                owners.setdefault(flag, mode if mode in SCENARIOS else None)
    return owners


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
    from .serve_bench import ServeBenchConfig, fitted_seq_len, format_report, require_httpx, run_serve_bench

    if not args.request_rate > 0:
        raise SystemExit(f"lfmspark bench serve: error: --request-rate must be > 0, got {args.request_rate}")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"lfmspark bench serve: error: --range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.base_url is not None:
        _refuse_in_process_flags(args)
        if args.endpoint == "chat" and args.dataset is None:
            raise SystemExit("lfmspark bench serve: error: --endpoint chat sends text, and random prompts are token "
                             "ids: give a --dataset of text prompts, or use --endpoint completions")
        try:
            require_httpx()
        except ImportError as e:
            raise SystemExit(f"lfmspark bench serve: error: {e}") from None
        engine = EngineConfig(seed=args.seed)        # the trace's seed; no engine is built
    else:
        server_only = [flag for flag, value in (("--endpoint", args.endpoint != "completions"),
                                                ("--api-key", args.api_key is not None),
                                                ("--vocab-size", args.vocab_size != DEFAULT_VOCAB)) if value]
        if server_only:
            raise SystemExit(f"lfmspark bench serve: error: {', '.join(server_only)} "
                             f"{'goes' if len(server_only) == 1 else 'go'} with --base-url")
        if args.model is not None:                   # --model is --target here, as in every other command
            if args.target is not None or args.preset is not None:
                raise SystemExit("lfmspark bench serve: error: --model (the target, without --base-url) is not "
                                 "allowed with --target or --preset")
            args.target, args.model = args.model, None
        if args.imposed_acceptance is not None and len(args.imposed_acceptance) > 1:
            raise SystemExit("lfmspark bench serve: error: --imposed-acceptance takes one profile here")
        engine = _engine_config(args, "bench serve")
    cfg = ServeBenchConfig(engine=engine, num_prompts=args.num_prompts, input_len=args.prompt_len,
                           output_len=args.output_len, range_ratio=args.range_ratio, dataset=args.dataset,
                           request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                           capacity_fraction=args.capacity_fraction, temperature=args.temperature,
                           json_path=args.json, base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                           api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), vocab_size=args.vocab_size)
    if args.base_url is None and args.max_seq_len is None:
        cfg.engine = cfg.engine.replace(max_seq_len=fitted_seq_len(cfg))
    print(format_report(run_serve_bench(cfg)))
    if args.json:
        print(f"report written to {args.json}")
    return 0


def _refuse_in_process_flags(args: argparse.Namespace) -> None:
    """With --base-url no engine is built: refuse the engine flags given (those off their default),
    naming them, rather than ignore them. --seed stays: it draws the trace."""
    parser = _mode_parser("serve")
    defaults = vars(parser.parse_args([]))
    flag_of = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    given = [flag_of[dest] for dest in sorted(_engine_dests() - {"seed"}, key=list(flag_of).index)
             if getattr(args, dest) != defaults[dest]]
    if given:
        raise SystemExit(f"lfmspark bench serve: error: {', '.join(given)} "
                         f"{'configures' if len(given) == 1 else 'configure'} the in-process engines, which "
                         "--base-url does not build (the server runs its own): drop "
                         f"{'it' if len(given) == 1 else 'them'}")


def _generate(args) -> int:
    from ..runtime.engine import Engine

    cfg = _engine_config(args, "generate", **({"chat": False} if args.raw else {}))
    engine = Engine.from_config(cfg)
    if args.messages:
        with open(args.messages) as f:
            prompt = json.load(f)
    elif args.token_ids:
        prompt = args.token_ids
    else:
        prompt = args.prompt
    # the checkpoint's sampling defaults (generation_config.json), then what the command line says
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
             "max_new_tokens": args.max_new_tokens}
    params = dataclasses.replace(engine.default_sampling_params(), seed=args.seed,
                                 **{k: v for k, v in given.items() if v is not None})
    if args.max_new_tokens is None and "max_new_tokens" not in engine.sampling_defaults:
        params.max_new_tokens = 256
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
    """The app's options: the request checks (the API key, CORS origins, the body limit) and how
    chat outputs are read (the reasoning and tool-call parsers)."""
    options = dict(api_key=args.api_key, allowed_origins=args.allowed_origins,
                   reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(with_bench_mode(argv))
    if unknown:
        _refuse_unknown(parser, args, unknown)
    args.command_line = command_line(argv)      # what the reports record: the command as typed
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return {"bench": _bench, "generate": _generate, "serve": _serve, "calibrate": _calibrate}[args.command](args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"lfmspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
