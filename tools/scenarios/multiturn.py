"""``lfmspark bench multiturn``: what the prefix cache does for a chat's time to first token.

A chat's every turn resends the conversation so far: the system prompt, the earlier messages and
replies, then the new message. With the prefix cache (runtime/prefix_cache.py) the blocks of that
prefix prefilled by an earlier turn are copied in, not computed again. This scenario runs
``chats`` chats sharing one system prompt (``system_len`` random tokens) for ``turns`` turns; each
turn appends a user message (``turn_len`` tokens) to each chat and generates ``output_len`` reply
tokens. The chats of a turn run together, turn after turn, on one engine with the prefix cache and
one without it (same weights, same trace), and per turn it reports the TTFT p50 of each, their
ratio, the prompt tokens the cache supplied and the decode TPOT p50 of each (the cache must not
slow decoding).

Between turns the engine finishes its background work (with ``--prefix-cache-outputs``, the jobs
that cache finished replies, which wait for a step where nothing decodes) before the next messages
arrive, as it would while users read the replies; that time is reported apart
(``between_turns_ms``), not counted in any TTFT. The cache's budget defaults to the whole trace, so
that the figure measures reuse, not eviction (``--prefix-cache-tokens`` sets a smaller one). The
engine's ``--prefix-block`` and ``--prefix-cache-outputs`` apply to the cached engine.

The report (``--json``): ``scenario``, ``environment`` (as the latency benchmark's: date, command,
versions, device, commit), ``config`` (as given), ``engine_config`` (as fitted), ``models``,
``engine``, ``imposed_acceptance``, ``prefix_cache_tokens`` (the cached engine's budget) and
``turns``: for ``cache`` and ``no_cache`` one row per turn with ``prompt_tokens``, ``cached_tokens``
(p50 over the chats), ``ttft_ms_p50``, ``tpot_ms_p50`` and ``between_turns_ms``.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import dataclass

from ...runtime.config import positive_int
from ...runtime.engine import Engine
from ...runtime.loader import load_models
from ...runtime.sampling import SamplingParams
from .common import ScenarioConfig, free_device_memory, imposed_rates, labelled, new_report, write_report

log = logging.getLogger("lfmspark")

NAME = "multiturn"
SUMMARY = "multi-turn chat TTFT with the prefix cache on and off"
SHARED = {"output_len": 64, "json": None}          # output_len: each reply's tokens


@dataclass
class MultiturnConfig(ScenarioConfig):
    chats: int = 8
    turns: int = 8
    system_len: int = 1000
    turn_len: int = 200
    output_len: int = SHARED["output_len"]

    def __post_init__(self) -> None:
        for name in ("chats", "turns", "system_len", "turn_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"multiturn scenario: {name} must be >= 1, got {getattr(self, name)}")
        if self.engine.prefix_cache_tokens == 0:
            raise ValueError("multiturn scenario: it compares the prefix cache on and off; --prefix-cache-tokens 0 "
                             "turns it off in both: leave it unset (the whole trace) or give a budget")

    def trace_tokens(self) -> int:
        """Every token of the trace: the shared system prompt once, each chat's messages and replies."""
        return self.system_len + self.chats * self.turns * (self.turn_len + self.output_len)

    def chat_tokens(self) -> int:
        """The longest request: a chat's last turn, prompt and reply."""
        return self.system_len + self.turns * (self.turn_len + self.output_len)


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The scenario's own flags; returns their destinations."""
    d = MultiturnConfig
    g = parser.add_argument_group("multiturn scenario (lfmspark bench multiturn; --output-len: each reply's tokens)")
    return [g.add_argument("--chats", type=positive_int, default=None, help=f"chats run together (default: "
                           f"{d.chats})").dest,
            g.add_argument("--turns", type=positive_int, default=None, help=f"turns per chat (default: {d.turns})").dest,
            g.add_argument("--system-len", type=positive_int, default=None, help="tokens of the system prompt every "
                           f"chat shares (default: {d.system_len})").dest,
            g.add_argument("--turn-len", type=positive_int, default=None, help="tokens of each user message (default: "
                           f"{d.turn_len})").dest]


def config(args: argparse.Namespace, **common) -> MultiturnConfig:
    own = {name: getattr(args, name) for name in ("chats", "turns", "system_len", "turn_len")
           if getattr(args, name) is not None}
    return MultiturnConfig(output_len=args.output_len, json_path=args.json, **own, **common)


def run(cfg: MultiturnConfig) -> dict:
    models = load_models(cfg.engine)
    block = models.draft.config.block_size if models.draft is not None else 0
    engine_cfg = cfg.engine_config(max_batch=cfg.chats, max_seq_len=cfg.chat_tokens() + 2 * (block + 1) + 64)
    engine_cfg = engine_cfg.replace(imposed_acceptance=imposed_rates(engine_cfg, models))
    report = new_report(NAME, cfg, models, engine_cfg)
    report["engine"] = "speculative" if models.draft is not None else "target_only"
    report["imposed_acceptance"] = list(engine_cfg.imposed_acceptance) if engine_cfg.imposed_acceptance else None
    cached_tokens = engine_cfg.prefix_cache_tokens or cfg.trace_tokens()
    report["prefix_cache_tokens"] = cached_tokens
    variants = (("cache", engine_cfg.replace(prefix_cache_tokens=cached_tokens)),
                ("no_cache", engine_cfg.replace(prefix_cache_tokens=0, prefix_cache_outputs=False)))
    report["turns"] = {}
    for name, variant in variants:
        log.info("multi-turn chats, %s", name.replace("_", " "))
        engine = Engine.from_config(variant, models)
        if engine.cuda_graphs:
            engine.warmup(progress=False, sampling=False)
        report["turns"][name] = run_chats(engine, cfg)
        write_report(report, cfg.json_path)
        del engine
        free_device_memory(engine_cfg.torch_device())
    return report


def run_chats(engine: Engine, cfg: MultiturnConfig) -> list[dict]:
    """The trace through ``engine``: one row per turn."""
    rng = random.Random(cfg.engine.seed)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(vocab // 10, vocab) for _ in range(cfg.system_len)]
    chats = [list(system) for _ in range(cfg.chats)]
    params = SamplingParams(max_new_tokens=cfg.output_len, ignore_eos=True)
    turns = []
    for _ in range(cfg.turns):
        for chat in chats:
            chat += [rng.randrange(vocab // 10, vocab) for _ in range(cfg.turn_len)]
        prompt_tokens = [len(chat) for chat in chats]
        outs = engine.generate([list(chat) for chat in chats], params)
        for chat, out in zip(chats, outs):
            chat += out.token_ids
        t0 = time.perf_counter()
        while not engine.idle:          # the background work a reader's pause leaves time for
            engine.step()
        turns.append({"prompt_tokens": statistics.median(prompt_tokens),
                      "cached_tokens": statistics.median(o.stats.prompt_tokens_cached for o in outs),
                      "ttft_ms_p50": statistics.median(o.stats.ttft_s for o in outs) * 1e3,
                      "tpot_ms_p50": statistics.median(o.stats.decode_s / max(len(o.token_ids) - 1, 1)
                                                       for o in outs) * 1e3,
                      "between_turns_ms": (time.perf_counter() - t0) * 1e3})
    return turns


def table(report: dict) -> str:
    from tabulate import tabulate

    rows = []
    for t, (on, off) in enumerate(zip(report["turns"]["cache"], report["turns"]["no_cache"]), start=1):
        rows.append([t, f"{on['prompt_tokens']:.0f}", f"{on['cached_tokens']:.0f}", f"{on['ttft_ms_p50']:.2f}",
                     f"{off['ttft_ms_p50']:.2f}", f"{off['ttft_ms_p50'] / on['ttft_ms_p50']:.1f}x",
                     f"{on['tpot_ms_p50']:.3f} / {off['tpot_ms_p50']:.3f}", f"{on['between_turns_ms']:.1f}"])
    text = tabulate(rows, headers=["turn", "prompt tokens", "cached", "TTFT p50 ms cache", "no cache", "ratio",
                                   "TPOT p50 ms cache / no cache", "background ms"])
    text += (f"\n{labelled(report['engine'], report['imposed_acceptance'])}; prefix cache budget "
             f"{report['prefix_cache_tokens']} tokens")
    return text

