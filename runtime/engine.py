"""The Engine people embed: load a target (and optionally a DSpark draft), warm up, generate.

::

    engine = Engine.from_pretrained("LFM2.5-1.2B-Instruct", "LFM2.5-1.2B-Instruct-DSpark")
    engine.warmup()                                   # compile + capture before taking traffic
    out = engine.generate("Why is the sky blue?", SamplingParams(max_new_tokens=64))[0]
    for event in engine.stream(["a", "b"], SamplingParams(temperature=0.7)):
        print(event.index, event.text, end="")

Requests join and leave between rounds: each holds a state slot from admission (prefill) to its
finish, cancellation or error. The loop is pipelined: round ``r + 1`` is launched before round
``r``'s tokens are read back (pinned buffers + an event), so the host waits on the GPU only to
hand tokens to the caller. A request finishing in round ``r`` therefore rides along in round
``r + 1``, whose result for it is dropped; admission leaves room for that round in the cache.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..environment import environment
from ..graphs.prefill import PrefillRunner, prefill_buckets
from ..graphs.runner import EagerRunner, StepKind, WarmupReport
from ..models.cache import DraftCache, TargetCache
from ..models.dspark import DSparkDraft, check_draft_fits_target
from ..models.lfm2 import Lfm2ForCausalLM
from ..models.lfm2_moe import impose_routing_locality, routing_locality
from ..models.loading import load_draft, load_target
from ..models.config import DraftConfig, read_json_object
from ..models.presets import DEFAULT_DRAFT, draft_preset, random_draft, random_target, target_preset
from ..ops.routing import WALKS, exact_scope
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .detokenize import TextStream
from .logprobs import LOGPROBS_MODES, LogprobTensors, TokenLogprobs, token_logprobs
from .prefill_warmup import prefill_variants, prefill_warm_shapes
from .prompts import Prompt, PromptError, default_stop_ids, encode_prompt, generation_defaults, load_tokenizer
from .requests import (EngineDeadError, Request, RequestError, RequestFailedError, describe, is_device_error,
                       pair_prompts)
from .distributions import SamplingMode, sampling_mode
from .sampling import SamplingError, SamplingParams
from .prefix_cache import DEFAULT_BLOCK, PrefixCache
from .speculation import VerifyScheduler, default_verify_widths
from .state import NO_DRAFT_LIMIT, SlotPool, SlotState
from .steps import Steps
from .transfer import to_device

log = logging.getLogger("lfmspark")

# a cache job's prefill reads no sampling setting; _prefill_chunk asks whether it wants prompt logprobs
_CACHE_JOB_PARAMS = SamplingParams()


@dataclass
class _InFlight:
    requests: list[Request]
    slots: np.ndarray             # [n] their slots
    tokens: torch.Tensor          # host copy [n, W] (pinned on CUDA)
    n_new: torch.Tensor           # host copy [n]
    done: torch.cuda.Event | None
    width: int = 1                # the round's verify width (1 for a decode step)
    confidence: torch.Tensor | None = None      # host copy [n, gamma] when the scheduler reads it
    logprobs: LogprobTensors | None = None      # host copies, W entries per row that asked (logprob_rows)
    logprob_rows: dict[int, int] | None = None  # row -> its block in ``logprobs``


class Engine:
    """Serve one target (dense LFM2 or LFM2-MoE) with an optional DSpark draft.

    The engine is inference-only: it turns ``requires_grad`` off on the models' parameters, and the
    draft borrows the target's embedding and LM head (``DSparkDraft.attach_target``).

    ``markov_walk`` picks the kernel of the draft's greedy Markov walk (the tokens are the same):
    ``"jacobi"`` (default; one launch whose cost grows with the fixed-point passes a round needs,
    which ``lfmspark bench`` reports as ``walk_passes``), ``"persistent"`` (the sequential walk in
    one launch: for trained heads whose bias often moves the argmax, i.e. many passes) or
    ``"steps"`` (one launch per block slot).

    ``logprobs_mode`` says which distribution ``SamplingParams.logprobs`` are of: ``"raw"`` (the
    target's logits as the model produced them) or ``"processed"`` (after the request's transforms,
    temperature and filters: what each token was drawn from); runtime/logprobs.py.

    ``prefix_cache_tokens``: the prefix cache's budget in tokens (runtime/prefix_cache.py): a request
    whose prompt starts with ``prefix_block``-token blocks an earlier prompt prefilled (a shared system
    prompt, the earlier turns of a chat) starts its prefill after them, with the same outputs as without the cache. Default
    (None): half the slots' worth, ``max_batch * max_seq_len // 2``; 0 turns it off. An engine whose
    ``max_seq_len`` is shorter than a block keeps none. Prefill chunks end at multiples of
    ``prefix_block`` whether the cache is on or off (that is what makes a hit exact).
    ``prefix_cache_outputs=True`` also keeps each finished request's output (a chat's finished turn,
    which the next turn's prompt repeats): its full blocks are prefilled once more, so the cache holds
    the state a prompt's prefill computes, not the decode steps' (whose roundings differ). That
    prefill (about the output's length in tokens) is a queued job that runs in a free slot at a step
    where no request is decoding, before the requests queued at that time are admitted, so it never
    stalls a stream; under load that never leaves the engine without a decoding request the jobs
    wait, the oldest dropped past ``max_batch`` of them.

    ``verify_widths`` (speculative engines): the verify windows a round may take, in columns (the
    anchor and that many drafts less one); each round the scheduler picks the one with the most
    expected tokens per second from the measured round costs (runtime/speculation.py). Default:
    1 (no draft: target-only speed) and the whole block; widths between may be added;
    ``[block_size + 1]`` verifies the whole block every round.

    ``exact``: exact mode (ops/routing.py): the target's per-token results are the same bits whatever
    the batch a token shares, the batch size it is padded to and its place in a decode step or a
    verify window, so greedy speculative output equals greedy target-only output token for token on
    the GPU too, and a request's output does not depend on its batch (what ops/routing.py lists is
    not covered). It holds where the kernels run (CUDA, or Triton's interpreter with
    ``LFMSPARK_TRITON_ON_CPU=1``); the CPU references in fp32 already give the speculative ==
    target-only equality. Needs a model in one dtype. Slower than the default mode.

    ``routing_locality`` (MoE targets, benchmarks on random weights): each slot's tokens choose among
    this many experts per MoE layer (models/lfm2_moe.py ``impose_routing_locality``), which mimics a
    trained model's correlated routing; like ``imposed_acceptance`` it changes what the engine
    computes, and benchmark output says so. It is set on the target, so engines sharing the target
    share it (:attr:`routing_locality` reads it back).
    """

    def __init__(self, target: Lfm2ForCausalLM, draft: DSparkDraft | None = None, *, tokenizer=None,
                 stop_token_ids: Sequence[int] = (), max_batch: int = 8, max_seq_len: int = 4096,
                 imposed_acceptance: Sequence[float] | None = None, cuda_graphs: bool | None = None,
                 compile: bool | None = None, batch_sizes: Sequence[int] | None = None, prefill_chunk: int = 2048,
                 prefill_budget: int = 256, prefill_graph_tokens: int = 1024, chat: bool = True, markov_walk: str = "jacobi",
                 sampling_defaults: dict | None = None, logprobs_mode: str = "raw",
                 verify_widths: Sequence[int] | None = None, prefix_cache_tokens: int | None = None,
                 prefix_block: int = DEFAULT_BLOCK, prefix_cache_outputs: bool = False,
                 routing_locality: int | None = None, exact: bool = False):
        environment()   # a bad LFMSPARK_* value fails here, naming the variable (lfmspark/environment.py)
        if markov_walk not in WALKS:
            raise ValueError(f"markov_walk={markov_walk!r}: use one of {', '.join(WALKS)}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = logprobs_mode
        cfg = target.config
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk),
                            ("prefill_budget", prefill_budget), ("prefill_graph_tokens", prefill_graph_tokens),
                            ("prefix_block", prefix_block)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1 (prompt tokens prefilled per step while others decode), "
                             f"got {prefill_budget}")
        self.prefill_budget = prefill_budget
        if prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0: no prefill buckets or graphs), "
                             f"got {prefill_graph_tokens}")
        self.target, self.draft, self.tokenizer, self.chat = target, draft, tokenizer, chat
        self.sampling_defaults = dict(sampling_defaults or {})
        SamplingParams(**self.sampling_defaults).validate(cfg.vocab_size)   # a bad default fails here
        self.config = cfg
        self.device, self.dtype = target.device, target.dtype
        self.max_batch, self.max_seq_len, self.prefill_chunk = max_batch, max_seq_len, prefill_chunk
        self.stop_token_ids = tuple(stop_token_ids)
        self.block_size = draft.config.block_size if draft is not None else 0
        self.verify_width = self.block_size + 1
        if max_seq_len < self.verify_width + 2:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for a verify window of {self.verify_width}")

        if not isinstance(exact, bool):
            raise ValueError(f"exact must be True or False, got {exact!r}")
        self.exact = exact
        if routing_locality is not None:
            if isinstance(routing_locality, bool) or not isinstance(routing_locality, int):
                raise ValueError(f"routing_locality must be an integer number of experts, got {routing_locality!r}")
            impose_routing_locality(target, routing_locality, max_batch)

        # inference only: parameters that require grad would make a compiled region traced outside
        # no_grad (e.g. by a user timing a phase) build a backward graph
        target.requires_grad_(False)
        if draft is not None:
            draft.requires_grad_(False)
        prefix_blocks = self._prefix_blocks(prefix_cache_tokens, prefix_block)
        self.tcache = TargetCache.allocate(cfg, max_batch, max_seq_len, self.verify_width, self.dtype, self.device,
                                           block=prefix_block if prefix_blocks else 0)
        self.dcache = None
        if draft is not None:
            check_draft_fits_target(draft.config, cfg)
            draft.attach_target(target.model.embed_tokens, target.lm_head)
            self.dcache = DraftCache.allocate(draft.config, max_batch, max_seq_len, self.dtype, self.device)
        self.prefix_cache = (PrefixCache(self.tcache, self.dcache, prefix_blocks, prefix_block)
                             if prefix_blocks else None)
        self.prefill_alignment = prefix_block      # prefill chunks end at its multiples (_next_chunks)
        if not isinstance(prefix_cache_outputs, bool):
            raise ValueError(f"prefix_cache_outputs must be True or False, got {prefix_cache_outputs!r}")
        if prefix_cache_outputs and self.prefix_cache is None:
            raise ValueError("prefix_cache_outputs=True needs the prefix cache: leave prefix_cache_tokens at None "
                             "or give it a budget of at least one prefix_block")
        self.prefix_cache_outputs = prefix_cache_outputs
        self.imposed_acceptance = self._imposed(imposed_acceptance)
        self.state = SlotState(max_batch, cfg.vocab_size, self.device)
        self.steps = Steps(target, self.tcache, self.state, draft, self.dcache, self.imposed_acceptance, markov_walk,
                           logprobs_mode)
        self.scheduler: VerifyScheduler | None = None
        if draft is not None:
            widths = self._verify_widths(verify_widths)
            confidences = draft.confidence_head is not None or self.imposed_acceptance is not None
            self.scheduler = VerifyScheduler(widths, self.block_size, confidences, max_batch)
            # rounds compute confidences only where a choice reads them
            self.steps.want_confidence = len(widths) > 1 and confidences
        elif verify_widths is not None:
            raise ValueError("verify_widths needs a draft: target-only decoding verifies nothing")
        self.runner = self._make_runner(cuda_graphs, compile, batch_sizes)
        self.cuda_graphs = not isinstance(self.runner, EagerRunner)
        # prefill_graph_tokens > 0 (the default): prompts run at bucket shapes (graphs/prefill.py),
        # replayed from graphs once captured; 0: eager prefill at each chunk's own shape
        self.prefill_runner = PrefillRunner(
            self.steps.prefill_logits, self.device,
            prefill_buckets(max_batch, min(prefill_chunk, max_seq_len), prefill_graph_tokens), max_seq_len)
        self.step_kind = StepKind.ROUND if draft is not None else StepKind.DECODE

        self.pool = SlotPool(max_batch)
        self._queue: deque[Request] = deque()
        self._prefilling: list[Request] = []       # holding slots, prompt partly in the cache (arrival order)
        self._followers: dict[int, list[Request]] = {}   # id(prefilling leader) -> the other samples of its prompt
        self._active: list[Request] = []
        self._live: dict[str, Request] = {}        # queued and active requests by id
        self._cache_jobs: deque[Request] = deque()  # finished turns to prefill into the prefix cache (_queue_cache_job)
        self._ids = itertools.count()
        self._dead: BaseException | None = None    # the device-level failure that ended the engine
        self._inflight: _InFlight | None = None
        self._host_buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._flip = 0
        self._rng = random.Random()
        # called for every request row of every round that verified drafts, with (request id, drafts
        # verified, drafts accepted, the round's confidences or None): what `lfmspark calibrate` records
        self.round_observer: Callable[[str, int, int, list[float] | None], None] | None = None
        # one scheduling step at a time: streams iterated from several threads take turns, each
        # step advancing every active request (their events go to their own streams)
        self._lock = threading.RLock()

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None, *,
                        dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                        max_batch: int = 8, max_seq_len: int = 4096, draft_rope_is_neox_style: bool | None = None,
                        **kw) -> "Engine":
        """Load HF checkpoints from local directories. ``draft_rope_is_neox_style`` supplies the
        draft's RoPE pairing when its config.json lacks ``rope_is_neox_style``."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        target = load_target(target_dir, dtype=dtype, device=device)
        draft = None
        if draft_dir is not None:
            draft_cfg = None
            if draft_rope_is_neox_style is not None:
                raw = read_json_object(Path(draft_dir) / "config.json")
                raw["rope_is_neox_style"] = draft_rope_is_neox_style
                draft_cfg = DraftConfig.from_dict(raw)
            draft = load_draft(draft_dir, target.config, dtype=dtype, device=device, cfg=draft_cfg)
        tokenizer = load_tokenizer(target_dir)
        stops = default_stop_ids(target_dir, target.config.eos_token_ids)
        kw.setdefault("sampling_defaults", generation_defaults(target_dir))
        return cls(target, draft, tokenizer=tokenizer, stop_token_ids=stops, max_batch=max_batch,
                   max_seq_len=max_seq_len, **kw)

    @classmethod
    def from_preset(cls, name: str, draft: str | None = "default", *, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device | None = None, max_batch: int = 8, max_seq_len: int = 4096,
                    seed: int = 0, **kw) -> "Engine":
        """Random weights with the shapes of a real model (benchmarks). ``draft="default"`` takes the
        preset's usual draft, ``None`` serves target-only."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cfg = target_preset(name)
        target = random_target(cfg, dtype, device, seed)
        draft_model = None
        if draft == "default":
            draft = DEFAULT_DRAFT.get(name)
        if draft is not None:
            draft_model = random_draft(draft_preset(draft), cfg.hidden_size, dtype, device, seed + 1)
        return cls(target, draft_model, stop_token_ids=cfg.eos_token_ids, max_batch=max_batch,
                   max_seq_len=max_seq_len, **kw)

    def _imposed(self, rates: Sequence[float] | None) -> torch.Tensor | None:
        if rates is None:
            return None
        if self.draft is None:
            raise ValueError("imposed_acceptance needs a draft: target-only decoding has nothing to accept")
        rates = list(rates)
        if len(rates) != self.block_size or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"imposed_acceptance must give {self.block_size} per-position rates in [0, 1] "
                             f"(one per draft slot), got {rates}")
        return torch.tensor(rates, dtype=torch.float32, device=self.device)

    def set_imposed_acceptance(self, rates: Sequence[float]) -> None:
        """Change the imposed per-position rates of an engine built with ``imposed_acceptance``.
        The rates are copied into the tensor the captured graphs read, so nothing recompiles."""
        if self.imposed_acceptance is None:
            raise ValueError("this engine was built without imposed_acceptance: pass it to Engine(...) first")
        self.imposed_acceptance.copy_(self._imposed(rates))

    def _make_runner(self, cuda_graphs: bool | None, compile: bool | None, batch_sizes):
        on_cuda = self.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_cuda
        if cuda_graphs:
            if not on_cuda:
                raise ValueError("cuda_graphs=True needs a CUDA device")
            from ..graphs.capture import CudaGraphRunner

            return CudaGraphRunner(self.steps, self.device, self.max_batch, batch_sizes,
                                   compile=True if compile is None else compile, widths=self.verify_widths)
        return EagerRunner(self.steps, self.device, compile=bool(compile), max_batch=self.max_batch,
                           widths=self.verify_widths)

    def _prefix_blocks(self, tokens: int | None, block: int) -> int:
        """The prefix cache's capacity in blocks (0: none)."""
        if block < 1:
            raise ValueError(f"prefix_block must be >= 1 (tokens per cached block), got {block}")
        if tokens is None:
            tokens = self.max_batch * self.max_seq_len // 2
        elif isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be None (the default budget), 0 (off) or a number of "
                             f"tokens >= 0, got {tokens!r}")
        if block > self.max_seq_len:
            return 0           # no prompt can fill a block
        return tokens // block

    @property
    def prefix_cache_stats(self) -> dict:
        """The prefix cache's counters (prompt tokens queried and found cached, blocks stored and
        evicted, blocks held, its capacity); empty without a prefix cache."""
        pc = self.prefix_cache
        if pc is None:
            return {}
        return {**pc.stats.as_dict(), "cached_blocks": pc.cached_blocks, "capacity_blocks": pc.capacity,
                "block": pc.block}

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix and the finished turns waiting to be cached (running requests keep
        what they copied); returns the blocks dropped."""
        with self._lock:
            self._cache_jobs.clear()
            return self.prefix_cache.clear() if self.prefix_cache is not None else 0

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths rounds are captured at (``(0,)`` for a target-only engine: no rounds)."""
        return self.scheduler.widths if self.scheduler is not None else (0,)

    def _verify_widths(self, widths: Sequence[int] | None) -> tuple[int, ...]:
        full = self.block_size + 1
        if widths is None:
            return default_verify_widths(self.block_size)
        widths = list(widths)
        if not widths or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= full for w in widths):
            raise ValueError(f"verify_widths must be a non-empty list of integers in [1, {full}] (a window of the "
                             f"anchor and up to {self.block_size} drafts), got {widths!r}")
        return tuple(sorted(set(widths)))

    @property
    def routing_locality(self) -> int | None:
        """The experts per slot and MoE layer the routing-locality benchmark mode allows (None: off)."""
        return routing_locality(self.target)

    @property
    def speculation_stats(self) -> dict:
        """Engine-wide speculation counters (runtime/speculation.py ``SpeculationStats``): rounds per
        verify width, fallback rounds (width 1), probes, draft tokens verified and accepted, the
        acceptance per position; empty for a target-only engine."""
        return self.scheduler.stats.as_dict() if self.scheduler is not None else {}

    # -- public API -------------------------------------------------------------------------
    def warmup(self, progress: bool = True, sampling: bool | Sequence[SamplingMode] = True) -> WarmupReport:
        """Compile and capture everything the engine will replay. First the prefill: the eager path at
        the shapes that compile every prefill kernel variant (:meth:`prefill_warm_shapes`), and a
        graph for every bucket shape (graphs/prefill.py; with ``cuda_graphs``, else each bucket runs
        once eagerly); then its step (decode or speculative round) for every captured batch size in
        each sampling mode (runtime/distributions.py ``SamplingMode``: greedy, top-k, full), or only
        greedy with ``sampling=False`` (a greedy-only service), or the modes ``sampling`` lists.
        Call once before taking traffic; progress goes to the ``lfmspark`` logger.

        Why the prefill comes first: on the H200, bucket graphs captured after the step graphs left
        every later batch-1 decode step ~20 us slower (0.731 -> 0.752 ms), captured before them they
        cost nothing."""
        if not self.idle:
            raise RuntimeError("Engine.warmup() must run before the engine takes requests: it uses free "
                               "state slots as scratch; call it right after constructing the engine")
        if isinstance(sampling, bool):
            modes = tuple(SamplingMode) if sampling else (SamplingMode.GREEDY,)
        else:
            modes = tuple(sampling)
        with exact_scope(self.exact):
            t0 = time.perf_counter()
            self._warm_prefill(modes)
            prefill_entries = self.prefill_runner.warmup(progress, capture=self.cuda_graphs,
                                                         capture_stream=getattr(self.runner, "capture_stream", None))
            prefill_s = time.perf_counter() - t0
            if progress:
                log.info("prefill warm-up %.2fs (%d bucket graphs)", prefill_s, len(self.prefill_runner.captured))
            report = self.runner.warmup([self.step_kind], progress=progress, modes=modes)
        report.entries += prefill_entries
        report.prefill_s = prefill_s
        return report

    def prefill_warm_shapes(self) -> list[tuple[int, int]]:
        """The ``(rows, length)`` prefills :meth:`warmup` runs (:func:`prefill_warm_shapes`). Off CUDA
        nothing is compiled, so one short prefill exercises the path."""
        if self.device.type != "cuda":
            return [(1, min(16, self.max_seq_len))]
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        variants = prefill_variants(self.config, self.tcache.max_seq_len, self.dtype.itemsize, sms)
        return prefill_warm_shapes(self.max_batch, min(self.prefill_chunk, self.max_seq_len), variants)

    def _warm_prefill(self, modes: Sequence[SamplingMode]) -> None:
        """Run :meth:`prefill_warm_shapes` on free slots (greedy, and the first shape in each of
        ``modes`` too). Admission prefills a slot from position 0, which resets
        the conv state and overwrites the K/V this leaves behind (positions past a row's length
        are never attended)."""
        for i, (rows, length) in enumerate(self.prefill_warm_shapes()):
            ids = torch.zeros(rows, length, dtype=torch.int64, device=self.device)
            slots = torch.arange(rows, device=self.device)
            for mode in {SamplingMode.GREEDY, *modes} if i == 0 else (SamplingMode.GREEDY,):
                self.steps.prefill(ids, slots, torch.zeros_like(slots), torch.full_like(slots, length), mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def default_sampling_params(self) -> SamplingParams:
        """What ``params=None`` means: ``SamplingParams()`` with the checkpoint's
        ``generation_config.json`` sampling fields (temperature, top_k, top_p, max_new_tokens;
        ``Engine(sampling_defaults=...)``), as transformers and vLLM apply them. A ``SamplingParams``
        passed explicitly is used as given."""
        return SamplingParams(**self.sampling_defaults)

    # -- the synchronous API ------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Generate for one prompt or a list of prompts; returns one output per prompt, in order
        (``SamplingParams.n`` outputs for a prompt that asks several samples, ``output.sample``
        numbering them).

        A single prompt is a string, a list of token ids or a list of chat messages; anything else
        must be a list of such prompts. Every request is validated before anything runs, so a bad
        one raises :class:`RequestError` and leaves the engine untouched. A request that fails
        while running raises :class:`RequestFailedError` once the others have finished.
        """
        outputs: dict[tuple[int, int], GenerationOutput] = {}
        for event in self.stream(prompts, params):
            if event.finished:
                outputs[event.index, event.sample] = event.output
        return [outputs[key] for key in sorted(outputs)]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` s as prefill and rounds commit tokens (index = prompt position).

        Leaving the iteration early cancels the remaining requests and frees their slots. Several
        streams may be open at once, from one thread or several (their requests share the batch;
        the engine runs one scheduling step at a time): each yields only its own requests' events,
        whichever stream's iteration ran the step that produced them. The parameters are copied at
        submission: changing a ``SamplingParams`` afterwards does not affect the request. A request
        that fails (``finish_reason="error"``) yields its last event like any other; once all have
        finished the stream raises :class:`RequestFailedError` naming the failed ones.
        """
        pairs = pair_prompts(prompts, params if params is not None else self.default_sampling_params())
        mine: deque[StreamEvent] = deque()      # this stream's events (a step also advances other streams')
        with self._lock:
            self._check_alive()
            requests = [r for i, (prompt, p) in enumerate(pairs)
                        for r in self._new_requests(prompt, p, index=i, sink=mine.append, label=f"request {i}: ")]
            self._enqueue(requests)
        try:
            while mine or any(not r.finished for r in requests):
                if not mine:
                    self.step()
                while mine:
                    yield mine.popleft()
            failed = [r for r in requests if r.finish_reason == "error"]
            if failed:
                raise RequestFailedError(f"requests {[r.index for r in failed]} failed: {describe(failed[0].error)}",
                                         [r.request_id for r in failed]) from failed[0].error
        finally:
            with self._lock:
                self._cancel([r for r in requests if not r.finished])

    # -- the request-level API (what AsyncEngine drives) -----------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    on_event: Callable[[StreamEvent], None] | None = None) -> str:
        """Validate and queue one request; returns its id (``request_id``, or a fresh one). The
        request runs as :meth:`step` is called; each of its events is returned by the step that made
        it and passed to ``on_event`` (called in the thread running the step; if it raises, that
        request ends with ``finish_reason="error"``). With ``SamplingParams.n > 1`` its samples run as
        requests ``{id}-0 .. {id}-(n-1)`` (``event.sample``), and aborting the id aborts them all.
        Raises :class:`RequestError` for a bad request, :class:`EngineDeadError` once the engine has
        failed."""
        requests = self.prepare(prompt, params, request_id=request_id, on_event=on_event)
        self.submit(requests)
        return requests[0].group or requests[0].request_id

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                on_event: Callable[[StreamEvent], None] | None = None) -> list[Request]:
        """The validation half of :meth:`add_request`: tokenise and check one request (its
        ``SamplingParams.n`` samples) without taking the engine's lock (a thread that must not wait for
        a running step, such as an event loop, prepares here and hands the requests to the thread that
        steps, which calls :meth:`submit`)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_alive()
        return self._new_requests(prompt, params or self.default_sampling_params(), request_id=request_id,
                                  sink=on_event)

    def submit(self, requests: list[Request]) -> None:
        """Queue the requests :meth:`prepare` made (once)."""
        with self._lock:
            self._check_alive()
            self._enqueue(requests)

    def abort(self, request_id: str) -> bool:
        """End a queued or running request (``finish_reason="cancelled"``, its last event delivered)
        and free its slot, or every sample of a request with ``n > 1``; False if no such request is
        live (finished already, or never was)."""
        with self._lock:
            req = self._live.get(request_id)
            targets = [req] if req is not None else [r for r in self._live.values() if r.group == request_id]
            if not targets:
                return False
            self._cancel(targets)
            return True

    def abort_all(self) -> int:
        """End every queued and running request as :meth:`abort` does; returns how many."""
        with self._lock:
            live = list(self._live.values())
            self._cancel(live)
            return len(live)

    def step(self) -> list[StreamEvent]:
        """One scheduling step: end requests past their deadline, admit queued requests (prefill),
        launch the next round for the active ones, and collect the previous round's tokens.

        A failure is kept to the requests it concerns: a prefill's to the requests being admitted, a
        round's to the rows in it, a text decode's or an event consumer's to its request; each ends
        with ``finish_reason="error"`` and the engine goes on. A device-level failure (a CUDA error)
        fails every request and raises :class:`EngineDeadError`, as does every later step."""
        with self._lock, exact_scope(self.exact):
            return self._step()

    @property
    def idle(self) -> bool:
        return (not self._queue and not self._prefilling and not self._active and self._inflight is None
                and not self._cache_jobs)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Requests holding a slot: prefilling or decoding."""
        return self.pool.in_use

    @property
    def dead(self) -> BaseException | None:
        """The device-level failure that ended the engine, or None while it is healthy."""
        return self._dead

    # -- scheduling --------------------------------------------------------------------------
    def _step(self) -> list[StreamEvent]:
        self._check_alive()
        events: list[StreamEvent] = []
        self._expire(events)
        self._admit(events)
        try:
            launched = self._launch()
            if self._inflight is not None:
                events += self._collect(self._inflight)
            self._inflight = launched
        except BaseException as e:
            self._inflight = None
            self._contain(e, list(self._active), events)
        return events

    def _contain(self, error: BaseException, concerned: list[Request], events: list[StreamEvent]) -> None:
        """Fail the requests a failure concerns. A device error fails every request and kills the
        engine; an interrupt (not an Exception) is re-raised after its requests are failed."""
        if is_device_error(error):
            self._dead = error
            concerned = list(self._live.values())
        for req in concerned:
            if req.cache_only:
                self._release_cache_job(req, error)
            elif not req.finished:
                events.append(self._end(req, "error", error))
        if self._dead is not None:
            log.error("device failure, engine stopped: %s", describe(error))
            raise EngineDeadError(f"the engine failed: {describe(error)}; restart the process") from error
        if not isinstance(error, Exception):
            raise error
        log.error("a step failed; %d requests ended with finish_reason 'error'", len(concerned), exc_info=error)

    def _new_requests(self, prompt: Prompt, params: SamplingParams, *, index: int = 0, request_id: str | None = None,
                      sink: Callable[[StreamEvent], None] | None = None, label: str = "") -> list[Request]:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise RequestError(f"{label}request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self._live or any(r.group == request_id for r in self._live.values()):
            raise RequestError(f"{label}request_id {request_id!r} is already running: ids must be unique")
        try:
            p = params.snapshot()     # the request's own copy: later changes to the caller's object change nothing
            p.validate(self.config.vocab_size)
            ids = encode_prompt(prompt, self.tokenizer, self.config.vocab_size, self.chat)
        except (PromptError, SamplingError) as e:
            raise RequestError(f"{label}{e}") from e
        need = len(ids) + p.max_new_tokens + self.verify_width
        if need > self.max_seq_len:
            raise RequestError(f"{label}prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) + "
                               f"the verify window ({self.verify_width}) = {need} exceeds max_seq_len "
                               f"{self.max_seq_len}: shorten the prompt, lower max_new_tokens, or build the "
                               "engine with a larger max_seq_len")
        # explicit stop ids always stop; ignore_eos drops only the default (EOS) ones
        if p.stop_token_ids is not None:
            stops = frozenset(p.stop_token_ids)
        else:
            stops = frozenset(() if p.ignore_eos else self.stop_token_ids)
        if p.stop and self.tokenizer is None:
            raise RequestError(f"{label}stop strings need a tokenizer, and this engine has none: use stop_token_ids")
        if p.n > self.max_batch:
            raise RequestError(f"{label}n={p.n} samples run at once, one slot each, and the engine has "
                               f"max_batch={self.max_batch}: lower n or raise max_batch")
        now, requests = time.perf_counter(), []
        for j in range(p.n):
            seed = p.seed + j if p.seed is not None else self._rng.getrandbits(32)
            text = TextStream(self.tokenizer, p.stop or (), p.include_stop_str_in_output) if self.tokenizer else None
            rid = request_id if p.n == 1 else f"{request_id}-{j}"
            requests.append(Request(rid, index, ids, p, stops, seed, now, sink=sink, text=text,
                                    group=request_id if p.n > 1 else None, sample=j))
        return requests

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier ({describe(self._dead)}); restart the process")

    def _enqueue(self, requests: list[Request]) -> None:
        ids = [r.request_id for r in requests]
        clash = sorted({i for i in ids if i in self._live or ids.count(i) > 1})
        if clash:
            raise RequestError(f"request ids {clash} are already in use: ids must be unique among live requests")
        for req in requests:
            self._live[req.request_id] = req
            self._queue.append(req)

    def _expire(self, events: list[StreamEvent]) -> None:
        now = time.perf_counter()
        for req in [r for r in self._live.values() if r.expired(now)]:
            if req in self._queue:
                self._queue.remove(req)
            events.append(self._end(req, "timeout"))

    def _admit(self, events: list[StreamEvent]) -> None:
        """Give queued requests free slots (first come, first served; the samples of one prompt
        together, as they share its prefill), then run this step's prefill (:meth:`_prefill_step`).
        At a step where nothing decodes, the finished turns waiting to be cached go first, and the
        queued requests wait for the next step, when their prompts can match those blocks."""
        if self._admit_cache_jobs():
            self._prefill_step(events)
            return
        if self._cache_jobs and not self._active and not self._prefilling and self._inflight is not None:
            # only the finished rows' last round is out: the jobs start once it is collected (this step,
            # _admit_cache_jobs), and the queue waits with them so that they still go first
            return
        while self._queue and self.pool.n_free:
            head = self._queue[0]
            members = [head] if head.group is None else [r for r in self._queue if r.group == head.group]
            if len(members) > self.pool.n_free:
                break                        # wait for enough slots
            for req in members:
                self._queue.remove(req)
                req.slot = self.pool.acquire()
                self.state.sampling.set(req.slot, req.params, req.seed, req.prompt_ids, req.stop_ids)
                cap = req.params.max_speculative_tokens
                self.state.draft_limit[req.slot] = NO_DRAFT_LIMIT if cap is None else cap
                if self.scheduler is not None:
                    self.scheduler.admit(req.slot, self._draft_limit(req))
            self._reuse_prefix(members[0])
            self._prefilling.append(members[0])
            if len(members) > 1:
                self._followers[id(members[0])] = members[1:]
        if self._prefilling:
            self._prefill_step(events)

    def _admit_cache_jobs(self) -> bool:
        """Start the waiting cache jobs (:meth:`_queue_cache_job`) that free slots allow, at a step
        where no request decodes or prefills; whether any is prefilling now."""
        if self._active or self._prefilling or self._inflight is not None:
            return False
        cache = self.prefix_cache
        while self._cache_jobs and self.pool.n_free:
            job = self._cache_jobs.popleft()
            job.slot = self.pool.acquire()
            try:
                job.prefilled = cache.load(cache.match(job.prompt_ids), job.slot)
            except Exception:
                log.warning("could not load the cached prefix of %s", job.request_id, exc_info=True)
                job.prefilled = len(job.prompt_ids)
            if job.prefilled < len(job.prompt_ids):
                self._prefilling.append(job)
            else:                                   # cached meanwhile (or unusable): nothing to run
                self._release_cache_job(job)
        return bool(self._prefilling)

    def _release_cache_job(self, job: Request, error: BaseException | None = None) -> None:
        if error is not None:   # only the cache misses out: the request it came from had succeeded
            log.warning("could not cache the output of %s: %s", job.request_id, describe(error))
        if job in self._prefilling:
            self._prefilling.remove(job)
        if job.slot is not None:
            self.pool.release(job.slot)
            job.slot = None

    def _prefill_step(self, events: list[StreamEvent]) -> None:
        """Prefill what this step may: while requests are decoding, one forward of at most
        ``prefill_budget`` prompt tokens, padding included (the prefilling requests in arrival order,
        each at most ``prefill_chunk`` of its prompt: :meth:`_next_chunks`), so that an arrival delays the decoding streams by one such
        chunk per round, however long its prompt; with nothing decoding, every prompt to its end
        (nobody waits on a round: the chunks run back to back, for the shortest time to first token).
        Requests whose prompt is complete get their first token and decode from the next round on.
        A failure here ends the requests of the failing forward (and their samples) only."""
        finished: list[tuple[Request, torch.Tensor, torch.Tensor]] = []   # (request, first token, its scores [V])
        while self._prefilling:
            budget = self.prefill_budget if self._active else None
            rows, chunks = self._next_chunks(budget)
            if not rows:
                break
            try:
                finished += self._prefill_forward(rows, chunks)
            except BaseException as e:          # the forward wrote only these requests' slots
                concerned = [r for lead in rows for r in (lead, *self._followers.pop(id(lead), []))]
                self._prefilling = [r for r in self._prefilling if r not in rows]
                self._contain(e, concerned, events)
                break
            if budget is not None:
                break                            # one budgeted forward per step
        if finished:
            self._start_decoding(finished, events)

    def _next_chunks(self, budget: int | None) -> tuple[list[Request], list[list[int]]]:
        """The prefilling requests and prompt chunks of the next forward. Unbudgeted: every one, each
        up to ``prefill_chunk``. With a budget, the forward's padded size stays within it: a forward
        runs ``rows x width`` tokens (shorter rows are padded, and the prefill buckets round the rows
        up to a power of two), so the ``n``-th row may take at most ``budget / next_pow2(n)`` tokens,
        and is not added once the rows taken are already wider than that. The first arrival takes the
        whole budget; a second joins only when the first's prompt is nearly in."""
        rows, chunks, width = [], [], 0
        for req in self._prefilling:
            take = self._chunk_len(req.prefilled, len(req.prompt_ids))
            if budget is not None:
                cap = budget // (1 << len(rows).bit_length())     # rows 1, 2, 3-4, 5-8, ...: budget / that
                if width > cap or cap == 0:
                    break
                take = min(take, cap)
            rows.append(req)
            chunks.append(req.prompt_ids[req.prefilled:req.prefilled + take])
            width = max(width, take)
        return rows, chunks

    def _chunk_len(self, done: int, total: int) -> int:
        """The tokens the next prefill chunk of ``total`` takes after ``done``: at most ``prefill_chunk``,
        ending no later than the next multiple of the prefix block, cache on or off, so that a
        prefix-cache hit resumes where a miss cuts a chunk too (runtime/prefix_cache.py "Exactness")."""
        block = self.prefill_alignment
        return min(total - done, self.prefill_chunk, (done // block + 1) * block - done)

    def _reuse_prefix(self, req: Request) -> None:
        """Start ``req``'s prefill after the longest cached prefix of its prompt (runtime/prefix_cache.py),
        copied into its slot. A request asking for prompt logprobs computes every position."""
        if self.prefix_cache is None or req.params.prompt_logprobs is not None:
            return
        self.prefix_cache.stats.queries += len(req.prompt_ids)
        req.prefilled = req.cached_tokens = self.prefix_cache.load(self.prefix_cache.match(req.prompt_ids), req.slot)
        self.prefix_cache.stats.hits += req.cached_tokens

    def _cache_prefilled(self, rows: list[Request]) -> None:
        """After a prefill forward: store the conv state of the rows whose chunk ended on a block
        boundary, then the full blocks of their prompts (runtime/prefix_cache.py)."""
        block = self.prefix_cache.block
        ends = [r for r in rows if r.prefilled % block == 0]
        if ends:
            slots = to_device([r.slot for r in ends], self.device)
            index = to_device([r.prefilled // block - 1 for r in ends], self.device)
            self.tcache.block_state[:, slots, index] = self.tcache.conv_state[:, slots]
        for req in rows:
            if req.prefilled >= block:
                self.prefix_cache.insert(req.prompt_ids, req.slot, req.prefilled)

    def _prefill_forward(self, rows: list[Request], chunks: list[list[int]]
                         ) -> list[tuple[Request, torch.Tensor, torch.Tensor]]:
        """One prefill forward of ``chunks[i]`` for ``rows[i]`` (from where its prompt stands), and the
        first token of each row whose prompt it completes (picked on the device: nothing waits for it
        here). Returns ``(request, token, scores)`` for those rows and the samples sharing their prompt."""
        starts = [r.prefilled for r in rows]
        logits = self._prefill_chunk(rows, chunks, starts)
        for req, chunk in zip(rows, chunks):
            req.prefilled += len(chunk)
        if self.prefix_cache is not None:
            self._cache_prefilled(rows)
        done = [i for i, r in enumerate(rows) if r.prefilled == len(r.prompt_ids)]
        for i in done:
            if rows[i].cache_only:                  # its blocks are in the cache now: nothing to pick
                self._release_cache_job(rows[i])
        done = [i for i in done if not rows[i].cache_only]
        if not done:
            return []
        self._prefilling = [r for r in self._prefilling if r.prefilled < len(r.prompt_ids)]
        mode = sampling_mode((r.params for i in done for r in (rows[i], *self._followers.get(id(rows[i]), []))),
                             self.config.vocab_size)
        t = lambda v: to_device(v, self.device)  # noqa: E731
        index = t(done)
        picked, scores = self.steps.prefill_pick(logits.index_select(0, index), t([rows[i].slot for i in done]),
                                                 t([len(rows[i].prompt_ids) for i in done]), mode)
        out = []
        for j, i in enumerate(done):
            lead = rows[i]
            out.append((lead, picked[j], scores[j]))
            others = self._followers.pop(id(lead), [])
            for req, token, row_scores in self._share_prefill(lead, others, logits[i], mode):
                req.prompt_logprobs = lead.prompt_logprobs
                out.append((req, token, row_scores))
        return out

    def _start_decoding(self, started: list[tuple[Request, torch.Tensor, torch.Tensor]],
                        events: list[StreamEvent]) -> None:
        """``started``: ``(request, first token, its scores)``. Hand each request whose prefill finished its first token (one host sync for them all) and
        its logprobs, and make it active: the next round advances it."""
        want = [(req, tok, sc) for req, tok, sc in started if req.params.logprobs is not None]
        lp = None
        if want:
            lp = token_logprobs(torch.stack([sc for _, _, sc in want]), torch.stack([tok for _, tok, _ in want]),
                                max(req.params.logprobs for req, _, _ in want)).to_host()
        # one host sync, after which the logprobs' host copies (queued before it) are complete too
        tokens = torch.stack([tok for _, tok, _ in started]).tolist()
        first_token = {id(req): token for (req, _, _), token in zip(started, tokens)}
        records = {id(req): lp.records([first_token[id(req)]], j, 1, req.params.logprobs)
                   for j, (req, _, _) in enumerate(want)}
        now = time.perf_counter()
        for req, _, _ in started:
            req.first_token_at = now
            self._active.append(req)
            events.append(self._emit(req, [first_token[id(req)]], records.get(id(req))))

    def _prefill_chunk(self, rows: list[Request], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run one chunk of each row's prompt (row ``i`` from position ``starts[i]``); the logits
        ``[len(rows), V]`` of each chunk's last token. Rows that ask for prompt logprobs run eagerly
        with every position's logits (they are rare, and no graph holds logits of every position),
        the others from the prefill runner's buckets."""
        plain = [i for i, r in enumerate(rows) if r.params.prompt_logprobs is None]
        if len(plain) == len(rows):
            return self.prefill_runner.run(chunks, [r.slot for r in rows], starts)
        out: list[torch.Tensor | None] = [None] * len(rows)
        if plain:
            logits = self.prefill_runner.run([chunks[i] for i in plain], [rows[i].slot for i in plain],
                                             [starts[i] for i in plain])
            for j, i in enumerate(plain):
                out[i] = logits[j]
        for i, req in enumerate(rows):
            if out[i] is None:
                out[i] = self._prefill_with_prompt_logprobs(req, chunks[i], starts[i])
        return torch.stack(out)

    def _prefill_with_prompt_logprobs(self, req: Request, chunk: list[int], start: int) -> torch.Tensor:
        """One chunk of ``req``'s prompt with the logits of every position: appends the raw logprobs of
        the prompt tokens they predict to ``req.prompt_logprobs`` (the first prompt token has none:
        ``None``); returns the chunk's last logits ``[V]``. Prompt logprobs are always of the raw
        logits: the logit transforms depend on an output history the prompt does not have."""
        ids = torch.tensor([chunk], dtype=torch.int64, device=self.device)
        one = lambda v: torch.tensor([v], dtype=torch.int64, device=self.device)  # noqa: E731
        logits = self.steps.prefill_logits(ids, one(req.slot), one(start), one(len(chunk)), every_position=True)[0]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        following = req.prompt_ids[start + 1:start + 1 + len(chunk)]        # the prompt tokens these positions predict
        if following:
            lp = token_logprobs(logits[:len(following)], torch.tensor(following, device=self.device),
                                req.params.prompt_logprobs).to_host()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            req.prompt_logprobs += lp.records(following, 0, len(following), req.params.prompt_logprobs)
        return logits[len(chunk) - 1]

    def _share_prefill(self, lead: Request, others: list[Request], logits: torch.Tensor, mode: SamplingMode
                       ) -> list[tuple[Request, torch.Tensor, torch.Tensor]]:
        """Give ``others`` (samples of ``lead``'s prompt) its prefilled caches, then pick each one's
        first token from ``logits [V]`` (the prompt's last) with its own sampling state; returns
        ``(request, token, scores)`` for each."""
        if not others:
            return []
        n = len(lead.prompt_ids)
        dst = [r.slot for r in others]
        self.tcache.copy_prefix(lead.slot, dst, n)
        if self.dcache is not None:
            self.dcache.copy_prefix(lead.slot, dst, n)
        slots = to_device(dst, self.device)
        picked, scores = self.steps.prefill_pick(logits[None].expand(len(dst), -1), slots, torch.full_like(slots, n),
                                                 mode)
        return [(req, picked[j], scores[j]) for j, req in enumerate(others)]

    # -- rounds -----------------------------------------------------------------------------
    def _launch(self) -> _InFlight | None:
        rows = [r for r in self._active if not r.finished]
        if not rows:
            return None
        mode = sampling_mode((r.params for r in rows), self.config.vocab_size)
        slots = [r.slot for r in rows]
        slots_np = np.array(slots, dtype=np.int64)
        width = self._choose_width(slots_np, mode)
        out = self.runner.run(self.step_kind, slots, mode, width)
        n = len(rows)
        tokens_flat, n_new_host, confidence_host = self._host_buffer()
        # a contiguous [n, W] view: a copy into a strided slice of a wider buffer is not an async memcpy
        # (torch stages it through pageable memory and waits for the round, stalling the pipeline)
        tokens_host = tokens_flat[:n * out.tokens.shape[1]].view(n, out.tokens.shape[1])
        n_new_host = n_new_host[:n]
        tokens_host.copy_(out.tokens[:n], non_blocking=True)
        n_new_host.copy_(out.n_new[:n], non_blocking=True)
        logprobs, logprob_rows = self._round_logprobs(rows, out)
        confidence = None
        if self.steps.want_confidence and width > 1:
            confidence = confidence_host[:n]
            confidence.copy_(out.confidence[:n], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _InFlight(rows, slots_np, tokens_host, n_new_host, done, width=width or 1, confidence=confidence, logprobs=logprobs,
                         logprob_rows=logprob_rows)

    def _choose_width(self, slots: np.ndarray, mode: SamplingMode) -> int | None:
        """The next round's verify width (None for a decode step): from what earlier rounds returned
        only, never from this round's drafts (runtime/speculation.py says why that keeps it lossless)."""
        if self.scheduler is None:
            return None
        width = self.scheduler.choose(slots, self.runner.padded_size(len(slots)), mode, self.runner.costs)
        self.scheduler.count_round(width)
        return width

    @staticmethod
    def _round_logprobs(rows: list[Request], out) -> tuple[LogprobTensors | None, dict[int, int] | None]:
        """The logprobs of every column of the rows that ask for them, from the step's scores, queued
        on the stream right after the step (the next step overwrites a captured step's outputs), their
        host copies on their way; rows that do not ask cost nothing."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return None, None
        index = to_device(want, out.tokens.device)
        scores, tokens = out.scores.index_select(0, index), out.tokens.index_select(0, index)
        lp = token_logprobs(scores.reshape(-1, scores.shape[-1]), tokens.reshape(-1),
                            max(rows[i].params.logprobs for i in want))
        return lp.to_host(), {i: j for j, i in enumerate(want)}

    def _host_buffer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two alternating sets of host buffers (tokens, flat, for a round of any width; committed
        counts; confidences): one is being filled by the launched round while the other is read."""
        if not self._host_buffers:
            pin = self.device.type == "cuda"
            self._host_buffers = [
                (torch.zeros(self.max_batch * self.verify_width, dtype=torch.int64, pin_memory=pin),
                 torch.zeros(self.max_batch, dtype=torch.int64, pin_memory=pin),
                 torch.zeros(self.max_batch, self.block_size, dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        self._flip ^= 1
        return self._host_buffers[self._flip]

    def _collect(self, inflight: _InFlight) -> list[StreamEvent]:
        if inflight.done is not None:
            inflight.done.synchronize()
        events = []
        tokens, n_new = inflight.tokens.tolist(), inflight.n_new.tolist()
        width = inflight.tokens.shape[1]
        live = [i for i, req in enumerate(inflight.requests) if not req.finished]   # the others' results are dropped
        verified = self._observe_round(inflight, live) if self.scheduler is not None else None
        for j, i in enumerate(live):
            req = inflight.requests[i]
            if req.finished:      # ended by an earlier row's consumer in this loop
                continue
            if verified is not None:
                req.accept_lengths.append(n_new[i])
                req.drafts_verified.append(verified[j])
            new = tokens[i][:n_new[i]]
            logprobs = None
            if inflight.logprob_rows is not None and i in inflight.logprob_rows:
                logprobs = inflight.logprobs.records(new, inflight.logprob_rows[i] * width, len(new),
                                                     req.params.logprobs)
            events.append(self._emit(req, new, logprobs))
        return events

    def _draft_limit(self, req: Request) -> int:
        """The most drafts a round may offer ``req`` (its ``max_speculative_tokens``, else the block)."""
        cap = req.params.max_speculative_tokens
        return self.block_size if cap is None else min(cap, self.block_size)

    def _observe_round(self, inflight: _InFlight, live: list[int]) -> list[int]:
        """Book a round's rows ``live`` (indices into ``inflight``) with the scheduler (its statistics
        and estimates, from the round's confidences where it computed them) and the round observer;
        returns the drafts each was offered."""
        committed = inflight.n_new.numpy()[live]
        confidence = inflight.confidence.numpy()[live] if inflight.confidence is not None else None
        verified = self.scheduler.observe(inflight.slots[live], inflight.width, committed, confidence).tolist()
        if self.round_observer is not None:
            for j, i in enumerate(live):
                if verified[j]:
                    row = None if confidence is None or np.isnan(confidence[j]).any() else confidence[j].tolist()
                    self.round_observer(inflight.requests[i].request_id, verified[j], int(committed[j]) - 1, row)
        return verified

    # -- events and finishing ---------------------------------------------------------------
    def _emit(self, req: Request, new_tokens: list[int], logprobs: list[TokenLogprobs] | None = None
              ) -> StreamEvent:
        """Append committed tokens, stopping at a stop token, a stop string or max_new_tokens, and
        deliver the event (its text: what the tokens add, less what is held back; with ``logprobs``,
        one per token, those of the tokens kept)."""
        kept: list[int] = []
        text = req.text
        try:
            for token in new_tokens:
                req.output.append(token)
                kept.append(token)
                if token in req.stop_ids:
                    req.finish_reason, req.stop_reason = "stop", token
                    break
                if text is not None and text.has_stop_strings and text.push(req.output):
                    req.finish_reason, req.stop_reason = "stop", text.stop_string
                    break
                if len(req.output) >= req.params.max_new_tokens:
                    req.finish_reason = "length"
                    break
            delta = None
            if text is not None:
                if not text.has_stop_strings:
                    text.push(req.output)
                if req.finished:
                    text.finish(req.output)
                delta = text.take(final=req.finished)
        except Exception as e:            # a tokenizer that cannot decode this output fails this request only
            req.finish_reason = None
            return self._end(req, "error", e)
        kept_logprobs = None
        if logprobs is not None:
            kept_logprobs = logprobs[:len(kept)]
            req.logprobs += kept_logprobs
        if req.finished:
            output = self._finish(req, req.finish_reason)
            event = StreamEvent(req.index, kept, delta, finished=True, output=output, request_id=req.request_id,
                                sample=req.sample, logprobs=kept_logprobs)
        else:
            event = StreamEvent(req.index, kept, delta, request_id=req.request_id, sample=req.sample,
                                logprobs=kept_logprobs)
        return self._deliver(req, event)

    def _deliver(self, req: Request, event: StreamEvent) -> StreamEvent:
        """Hand an event to the request's consumer and return it; a consumer that raises ends its own
        request, and the event returned is then that request's last."""
        if req.sink is None:
            return event
        try:
            req.sink(event)
        except Exception as e:
            req.sink = None
            if not req.finished:
                return self._end(req, "error", e)
        return event

    def _end(self, req: Request, reason: str, error: BaseException | None = None) -> StreamEvent:
        """Finish a request outside the token flow (cancelled, timeout, error) and deliver its last event."""
        req.error = error
        delta = None
        if req.text is not None and error is None:      # what was held back is final now
            req.text.finish(req.output)
            delta = req.text.take(final=True)
        output = self._finish(req, reason)
        event = StreamEvent(req.index, [], delta, finished=True, output=output, request_id=req.request_id,
                            sample=req.sample)
        return self._deliver(req, event)

    def _finish(self, req: Request, reason: str) -> GenerationOutput:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if self.prefix_cache_outputs and reason in ("stop", "length"):
            self._queue_cache_job(req)
        if req.slot is not None:
            self.pool.release(req.slot)
            req.slot = None
        if req in self._active:
            self._active.remove(req)
        self._leave_prefill(req)
        self._live.pop(req.request_id, None)
        stats = RequestStats(accept_lengths=req.accept_lengths, drafts_verified=req.drafts_verified,
                             block_size=self.block_size,
                             imposed_acceptance=self.imposed_acceptance is not None,
                             prompt_tokens=len(req.prompt_ids), prompt_tokens_cached=req.cached_tokens,
                             ttft_s=(req.first_token_at - req.submitted) if req.first_token_at else 0.0,
                             decode_s=(req.finished_at - req.first_token_at) if req.first_token_at else 0.0)
        text = req.text.text if req.text is not None and reason != "error" else None
        return GenerationOutput(prompt_token_ids=req.prompt_ids, token_ids=list(req.output),
                                finish_reason=reason, text=text, stats=stats, request_id=req.request_id,
                                error=describe(req.error) if req.error is not None else None,
                                stop_reason=req.stop_reason, sample=req.sample,
                                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
                                prompt_logprobs=req.prompt_logprobs)

    def _queue_cache_job(self, req: Request) -> None:
        """Queue the prefill of a finished request's prompt and output, up to its last full block, into
        the prefix cache (``prefix_cache_outputs``). It runs as a prompt's prefill does, in the chunks
        any prefill of these tokens runs (:meth:`_chunk_len`), after the longest cached prefix, so the
        stored state is what a later prompt's prefill would compute (:meth:`_admit_cache_jobs`)."""
        b = self.prefix_cache.block
        tokens = req.prompt_ids + req.output
        n = len(tokens) // b * b
        if n <= len(req.prompt_ids) // b * b:
            return                                  # the output completes no block beyond the prompt's
        if len(self._cache_jobs) >= self.max_batch:
            dropped = self._cache_jobs.popleft()
            log.debug("cache job queue full: %s not cached", dropped.request_id)
        self._cache_jobs.append(Request(f"{req.request_id}:cache", 0, tokens[:n], _CACHE_JOB_PARAMS, frozenset(), 0,
                                        time.perf_counter(), cache_only=True))

    def _leave_prefill(self, req: Request) -> None:
        """Take a finishing request out of the prefill: a leader's first waiting sample takes its place,
        prefilling its own slot from the start."""
        for followers in self._followers.values():
            if req in followers:
                followers.remove(req)
        if req not in self._prefilling:
            return
        i = self._prefilling.index(req)
        others = self._followers.pop(id(req), [])
        if others:
            self._prefilling[i] = others[0]
            if others[1:]:
                self._followers[id(others[0])] = others[1:]
        else:
            del self._prefilling[i]

    def _cancel(self, requests: list[Request], reason: str = "cancelled") -> None:
        for req in requests:
            if req in self._queue:
                self._queue.remove(req)
            if not req.finished:
                self._end(req, reason)
        if not self._active and self._inflight is not None:
            if self._inflight.done is not None:
                self._inflight.done.synchronize()
            self._inflight = None

