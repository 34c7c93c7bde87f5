"""``EngineConfig``: where the models come from and every engine option, validated once.

One frozen dataclass serves every entry point: ``Engine.from_config`` builds from it, and every
command (``lfmspark generate``, ``serve``, ``calibrate``, ``bench``, ``bench serve``), the HF
baseline's child process and the Ray deployment take the same flags through
:meth:`EngineConfig.add_arguments` / :meth:`EngineConfig.from_args`, with the same defaults::

    cfg = EngineConfig(target="path/to/LFM2.5-1.2B-Instruct", draft="path/to/its-DSpark", max_batch=16)
    engine = Engine.from_config(cfg)

The model source is a local checkpoint directory (``target``, optionally ``draft``) or a preset of
random weights with a real model's shapes (``preset``, with ``draft_preset``). What needs the
models to check (a verify width against the draft's block, ``max_seq_len`` against the verify
window) is checked when the engine is built.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..models.presets import DRAFT_PRESETS, TARGET_PRESETS
from ..models.quant import QUANTIZATIONS
from ..ops.routing import WALKS
from .logprobs import LOGPROBS_MODES
from ..models.cache import DEFAULT_PAGE_SIZE
from .prefix_cache import DEFAULT_BLOCK

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

# the fields that say where the models come from; the others are the engine's options
SOURCE_FIELDS = ("target", "preset", "draft", "draft_preset", "draft_rope_is_neox_style", "revision", "tokenizer",
                 "chat_template", "generation_config", "dtype", "device", "seed")


@dataclass(frozen=True)
class EngineConfig:
    # -- the models ------------------------------------------------------------------------
    target: str | None = None           # local HF checkpoint directory of the target
    preset: str | None = None           # or random weights with a real model's shapes (benchmarks)
    draft: str | None = None            # local DSpark draft directory (with ``target``)
    draft_preset: str | None = "default"  # with ``preset``: "default" (the preset's usual draft), None, or a name
    draft_rope_is_neox_style: bool | None = None   # the draft's RoPE pairing when its config.json lacks it
    revision: str | None = None         # the Hub revision (branch, tag or commit) of Hub ids
    tokenizer: str | None = None        # another tokenizer (directory or Hub id; None: the target's)
    chat_template: str | None = None    # a chat template replacing the tokenizer's (a file, or the template)
    generation_config: str = "auto"     # sampling defaults: "auto" (the target's), "vllm" (none), or a directory
    dtype: str = "auto"                 # "auto": bfloat16 on a GPU, float32 on a CPU
    quantization: str | None = None     # "fp8": the target's projections in float8 (None: the checkpoint's weights)
    device: str | None = None           # None: cuda when available, else cpu
    seed: int = 0                       # random weights' seed (presets)
    # -- the engine ------------------------------------------------------------------------
    max_batch: int = 8                  # requests decoded at once (state slots)
    max_seq_len: int | None = None      # prompt + output per request (None: the model's context length)
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV page (a power of two; prefix_block is a multiple of it)
    kv_cache_memory: int | None = None  # the KV pool's bytes (None: from gpu_memory_utilization; runtime/kv_budget.py)
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory the engine may hold, the KV pool included
    imposed_acceptance: tuple[float, ...] | None = None   # random-weight drafts: per-slot rates (one: every slot)
    cuda_graphs: bool | None = None     # None: on a CUDA device
    compile: bool | None = None         # torch.compile the steps' regions (None: with CUDA graphs)
    batch_sizes: tuple[int, ...] | None = None   # captured batch sizes (None: every size to 8, then coarser)
    prefill_chunk: int = 2048           # the most prompt tokens of one request in one prefill forward
    prefill_budget: int = 256           # prompt tokens prefilled per step while other requests decode
    prefill_graph_tokens: int = 1024    # prompts run at bucket shapes up to this many tokens (0: eager)
    chat: bool = True                   # wrap a text prompt in the chat template as one user turn
    markov_walk: str = "jacobi"         # the draft's greedy Markov walk kernel
    logprobs_mode: str = "raw"          # what SamplingParams.logprobs are of: "raw" or "processed" logits
    verify_widths: tuple[int, ...] | None = None   # verify windows a round may take (None: 1 and the block)
    prefix_cache_tokens: int | None = None   # the most tokens the prefix cache keeps (None: the KV pool's; 0: off)
    prefix_block: int = DEFAULT_BLOCK   # prefill chunks end at its multiples (cache hits there keep today's bits)
    prefix_cache_outputs: bool = False  # also cache each finished request's output (a chat's next turn)
    routing_locality: int | None = None  # MoE benchmarks on random weights: experts per slot and layer
    exact: bool = False                 # exact mode: per-token results independent of the batch (ops/routing.py)
    cpu_threads: int | None = None      # a CPU engine's torch threads (None: 1 unless the user set them)

    def __post_init__(self) -> None:
        for name in ("imposed_acceptance", "batch_sizes", "verify_widths"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, bytes)) and isinstance(value, Sequence):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if self.draft_preset == "none":                 # the command line's word for no draft
            object.__setattr__(self, "draft_preset", None)
        self._validate()

    # -- validation ------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.target is not None and self.preset is not None:
            raise ValueError("give the target as a checkpoint directory (target) or a preset, not both")
        if self.preset is not None and self.preset not in TARGET_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: use one of {', '.join(sorted(TARGET_PRESETS))}")
        if self.draft is not None and self.target is None:
            raise ValueError("draft (a checkpoint directory) needs target (use draft_preset with a preset)")
        if self.draft_preset not in (None, "default") and self.draft_preset not in DRAFT_PRESETS:
            raise ValueError(f"unknown draft preset {self.draft_preset!r}: use 'default', 'none' or one of "
                             f"{', '.join(sorted(DRAFT_PRESETS))}")
        if self.target is None and (self.tokenizer or self.chat_template or self.revision
                                    or self.generation_config != "auto"):
            named = [n for n in ("tokenizer", "chat_template", "revision") if getattr(self, n)]
            named += ["generation_config"] if self.generation_config != "auto" else []
            raise ValueError(f"{', '.join(named)} go with a checkpoint (target), not a preset of random weights")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use auto, bfloat16, float16 or float32")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}: use {', '.join(QUANTIZATIONS)}, or None "
                             "(the checkpoint's own weights)")
        for name in ("max_batch", "max_seq_len", "prefill_chunk", "prefill_budget", "prefill_graph_tokens",
                     "prefix_block", "seed", "page_size"):
            value = getattr(self, name)
            if name == "max_seq_len" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be None (the model's context length) or >= 2 (a prompt token and an "
                             f"output token), got {self.max_seq_len}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1 (prompt tokens prefilled per step while others decode), "
                             f"got {self.prefill_budget}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0: no prefill buckets or graphs), "
                             f"got {self.prefill_graph_tokens}")
        if self.prefix_block < 1:
            raise ValueError(f"prefix_block must be >= 1 (the prefill chunks' alignment in tokens), got {self.prefix_block}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two (tokens per KV page), got {self.page_size}")
        if self.prefix_block % self.page_size:
            raise ValueError(f"prefix_block {self.prefix_block} must be a multiple of page_size {self.page_size} "
                             "(a cached block is whole pages)")
        memory = self.kv_cache_memory
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
            raise ValueError(f"kv_cache_memory must be None or a number of bytes >= 1, got {memory!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
        tokens = self.prefix_cache_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise ValueError(f"prefix_cache_tokens must be None (the default budget), 0 (off) or a number of "
                             f"tokens >= 0, got {tokens!r}")
        if self.markov_walk not in WALKS:
            raise ValueError(f"markov_walk={self.markov_walk!r}: use one of {', '.join(WALKS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: use one of {', '.join(LOGPROBS_MODES)}")
        for name in ("exact", "prefix_cache_outputs", "chat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        threads = self.cpu_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"cpu_threads must be None (one, unless OMP_NUM_THREADS or torch.set_num_threads chose) "
                             f"or an integer >= 1, got {threads!r}")
        locality = self.routing_locality
        if locality is not None and (isinstance(locality, bool) or not isinstance(locality, int)):
            raise ValueError(f"routing_locality must be an integer number of experts, got {locality!r}")
        rates = self.imposed_acceptance
        if rates is not None and (not rates or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates)):
            raise ValueError(f"imposed_acceptance must give per-position rates in [0, 1] (one per draft slot, or "
                             f"one for every slot), got {list(rates)}")
        sizes = self.batch_sizes
        if sizes is not None and (not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                                       for b in sizes)):
            raise ValueError(f"batch_sizes must be a non-empty list of integers >= 1, got {list(sizes)}")

    # -- what the source resolves to ---------------------------------------------------------
    def torch_device(self) -> torch.device:
        """The device: ``device``, else cuda when available."""
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype: ``dtype``, or for "auto" bfloat16 on a GPU and float32 on a CPU."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (validated again); an unknown name is an error naming it."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                            f"EngineConfig has {', '.join(sorted(known))}")
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """The engine options (every field but the model source's)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SOURCE_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (``EngineConfig(**d)`` rebuilds it)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    # -- the command line ------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, *, source_required: bool = False,
                      acceptance_profiles: bool = False) -> None:
        """Add the engine's flags (the model source first) with their defaults in the help.
        ``source_required``: the command needs ``--target`` or ``--preset``; ``acceptance_profiles``:
        ``--imposed-acceptance`` may repeat (the latency benchmark measures each profile)."""
        d = EngineConfig()
        models = parser.add_argument_group("model")
        src = models.add_mutually_exclusive_group(required=source_required)
        src.add_argument("--target", "--model", dest="target", help="the target: a local HF checkpoint directory or a "
                         "Hugging Face Hub id (LiquidAI/LFM2.5-1.2B-Instruct)")
        src.add_argument("--preset", choices=sorted(TARGET_PRESETS), help="random weights with a real model's "
                         "shapes (benchmarks and smoke runs)")
        models.add_argument("--draft", help="the DSpark draft (with --target): a directory or a Hub id")
        models.add_argument("--draft-preset", default="default", help="the draft with --preset: 'default' (the "
                            f"preset's usual draft), 'none' or one of {', '.join(sorted(DRAFT_PRESETS))} "
                            "(default: default)")
        models.add_argument("--draft-rope-is-neox-style", type=_bool, default=None, metavar="{true,false}",
                            help="the draft's RoPE pairing when its config.json lacks rope_is_neox_style")
        models.add_argument("--revision", help="the Hub revision (branch, tag or commit) of Hub ids")
        models.add_argument("--tokenizer", help="another tokenizer: a directory or a Hub id (default: the target's)")
        models.add_argument("--chat-template", help="a chat template replacing the tokenizer's: a file, or the "
                            "template itself")
        models.add_argument("--generation-config", default="auto", help="where the sampling defaults come from: "
                            "auto (the target's generation_config.json), vllm (none), or a directory "
                            "(default: auto)")
        models.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights' dtype (default: "
                            "auto, i.e. bfloat16 on a GPU, float32 on a CPU)")
        models.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                            help="fp8: the target's linear weights in float8 e4m3fn with per-output-channel scales, "
                            "quantized at load (an fp8 export is read as fp8 without it; the draft, embeddings and "
                            "norms keep --dtype) (default: the checkpoint's weights)")
        models.add_argument("--device", help="cuda or cpu (default: cuda when available)")
        models.add_argument("--seed", type=int, default=d.seed, help="random seed: a preset's weights, generate's "
                            f"sampling, bench serve's trace (default: {d.seed})")

        e = parser.add_argument_group("engine")
        e.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=_int_from(1), default=None,
                       help=f"requests decoded at once, one state slot each (default: {d.max_batch})")
        e.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=_int_from(1), default=None,
                       help="tokens per request, prompt and output (default: the model's context length, "
                            "max_position_embeddings, or what the KV cache holds if less)")
        e.add_argument("--page-size", type=_int_from(1), default=d.page_size,
                       help=f"tokens per KV page, a power of two (default: {d.page_size})")
        e.add_argument("--kv-cache-memory", type=_int_from(1), default=None, metavar="BYTES",
                       help="bytes of the KV cache pool (default: from --gpu-memory-utilization on a GPU, at most "
                            "1 GiB on a CPU, and never more than every slot filled to --max-model-len)")
        e.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="the share of the GPU's memory the engine may hold, weights, activations and KV cache "
                            f"(default: {d.gpu_memory_utilization})")
        rates = dict(action="append") if acceptance_profiles else {}
        e.add_argument("--imposed-acceptance", type=rate_list, metavar="RATES", help="random-weight drafts: "
                       "per-position conditional acceptance rates (one value: every position); outputs are labelled"
                       + ("; repeat to measure several profiles on the same captured graphs" if acceptance_profiles
                          else ""), **rates)
        e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: run the steps eagerly "
                       "(default: CUDA graphs on a GPU)")
        e.add_argument("--cuda-graph-sizes", type=int_list, metavar="SIZES",
                       help="comma-separated batch sizes to capture (default: every size to 8, then coarser; larger "
                            "batches pad to the next captured size)")
        e.add_argument("--prefill-chunk", type=_int_from(1), default=d.prefill_chunk,
                       help=f"most prompt tokens of one request in one prefill forward (default: {d.prefill_chunk})")
        e.add_argument("--prefill-budget", type=_int_from(1), default=d.prefill_budget,
                       help="prompt tokens prefilled per step while requests decode: an arrival delays the decoding "
                            f"streams by one such chunk per round (default: {d.prefill_budget})")
        e.add_argument("--prefill-graph-tokens", type=_int_from(0), default=d.prefill_graph_tokens,
                       help="prompts run at bucket shapes of up to this many tokens, replayed from CUDA graphs "
                            f"(0: eager prefill at each prompt's own shape; default: {d.prefill_graph_tokens})")
        e.add_argument("--no-chat", dest="chat", action="store_false", default=True, help="do not wrap text prompts "
                       "in the chat template (default: wrap them)")
        e.add_argument("--markov-walk", choices=WALKS, default=d.markov_walk,
                       help=f"the draft's greedy Markov walk kernel (default: {d.markov_walk})")
        e.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=d.logprobs_mode,
                       help="what logprobs are of: the raw logits or the processed ones each token was drawn from "
                            f"(default: {d.logprobs_mode})")
        e.add_argument("--verify-widths", type=int_list, metavar="WIDTHS", help="verify widths the width "
                       "policy picks from each round (default: 1 and the whole block; the block size + 1 alone: "
                       "the whole block every round)")
        e.add_argument("--prefix-cache-tokens", type=_int_from(0), default=None, help="the most tokens the "
                       "prefix cache keeps; its blocks live in the KV pool's pages (default: as many as the pool "
                       "holds; 0: off)")
        e.add_argument("--prefix-block", type=_int_from(1), default=d.prefix_block,
                       help=f"the prefill chunks' alignment in tokens: chunks end at its multiples, so prefix-cache "
                            f"hits there give the uncached bits (default: {d.prefix_block})")
        e.add_argument("--prefix-cache-outputs", action="store_true", help="also keep each finished request's "
                       "output in the prefix cache (a chat's next turn repeats it): its full blocks are prefilled "
                       "once more, at a step where nothing decodes")
        e.add_argument("--routing-locality", type=_int_from(1), help="MoE targets with random weights: each "
                       "sequence's tokens choose among this many experts per layer (mimics a trained model's "
                       "correlated routing; outputs are labelled)")
        e.add_argument("--cpu-threads", type=_int_from(1), help="a CPU engine's torch intra-op threads (default: 1, "
                       "unless OMP_NUM_THREADS is set)")
        e.add_argument("--exact", action="store_true", help="exact mode: a token's target results are the same "
                       "bits in a decode step or a verify window, alone or batched, so greedy speculative output "
                       "equals target-only output on the GPU too (slower; docs/design.md)")

    @classmethod
    def from_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config the flags of :meth:`add_arguments` give (``overrides`` win)."""
        d = cls()
        rates = ns.imposed_acceptance
        if rates is not None and isinstance(rates[0], list):      # repeatable form: the first profile
            rates = rates[0]
        values = dict(
            target=ns.target, preset=ns.preset, draft=ns.draft,
            draft_preset=None if ns.draft_preset == "none" else ns.draft_preset,
            draft_rope_is_neox_style=ns.draft_rope_is_neox_style, revision=ns.revision, tokenizer=ns.tokenizer,
            chat_template=ns.chat_template, generation_config=ns.generation_config, dtype=ns.dtype, device=ns.device,
            seed=ns.seed, quantization=ns.quantization,
            max_batch=d.max_batch if ns.max_batch is None else ns.max_batch,
            max_seq_len=d.max_seq_len if ns.max_seq_len is None else ns.max_seq_len,
            page_size=ns.page_size, kv_cache_memory=ns.kv_cache_memory, gpu_memory_utilization=ns.gpu_memory_utilization,
            imposed_acceptance=rates, cuda_graphs=False if ns.enforce_eager else None, batch_sizes=ns.cuda_graph_sizes,
            prefill_chunk=ns.prefill_chunk, prefill_budget=ns.prefill_budget,
            prefill_graph_tokens=ns.prefill_graph_tokens, chat=ns.chat, markov_walk=ns.markov_walk,
            logprobs_mode=ns.logprobs_mode, verify_widths=ns.verify_widths,
            prefix_cache_tokens=ns.prefix_cache_tokens, prefix_block=ns.prefix_block,
            prefix_cache_outputs=ns.prefix_cache_outputs, routing_locality=ns.routing_locality, exact=ns.exact,
            cpu_threads=ns.cpu_threads)
        values.update(overrides)
        return cls(**values)


# -- argparse types --------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    """Comma-separated rates in [0, 1]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates in [0, 1], got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"acceptance rates must be in [0, 1], got {text!r}")
    return values


def _int_from(minimum: int):
    """An argparse type: an integer of at least ``minimum``."""
    what = {0: "non-negative", 1: "positive"}.get(minimum, f">= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        return value
    return parse


positive_int = _int_from(1)


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
