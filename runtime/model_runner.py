"""The model runner: everything the engine does on the device.

It owns the target's and the draft's caches, the per-slot state, the step functions
(runtime/steps.py), the step runner that replays them from CUDA graphs (or runs them eagerly), the
prefill runner, the prefix cache and the verify-width policy (runtime/speculation.py). The engine
hands it requests (runtime/requests.py) and prefill plans (runtime/scheduler.py); it hands back
tokens. It never decides who runs: that is the scheduler's, which it does not know.

**Pipelined rounds.** :meth:`ModelRunner.step` launches the next round (a decode step, or a
speculative round at the width the policy picks) and then collects the previous one's tokens, read
back through pinned buffers and an event, so the host waits on the GPU only to hand tokens out. A
request finishing in round ``r`` therefore rides along in round ``r + 1``, whose result for it is
dropped; admission leaves room for that round in the cache.

**Exact mode** (``EngineConfig.exact``, ops/routing.py) is entered here, around every device call,
from the config: the target's products, norms and attention take their batch-invariant routes
while the runner's methods run, and the default routes outside them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..graphs.prefill import PrefillRunner, prefill_buckets
from ..graphs.runner import EagerRunner, StepKind, StepRunner, WarmupReport
from ..models.cache import DraftCache, TargetCache
from ..models.dspark import DSparkDraft, check_draft_fits_target
from ..models.lfm2 import ConvSnapshots, Lfm2ForCausalLM
from ..models.lfm2_moe import impose_routing_locality, quantize_target, routing_locality
from ..ops.routing import exact_scope
from .config import EngineConfig
from .cpu_threads import set_cpu_threads
from .distributions import SamplingMode
from .logprobs import LogprobTensors, TokenLogprobs, token_logprobs
from .prefill_warmup import prefill_variants, prefill_warm_shapes
from .kv_budget import kv_pool_pages, resolve_max_seq_len
from .pages import PagePool, SlotPages
from .prefix_cache import PrefixCache
from .requests import PrefillPlan, Request
from .sampling import sampling_mode
from .speculation import WidthPolicy, default_verify_widths
from .state import NO_DRAFT_LIMIT, SlotState
from .steps import Steps
from .transfer import to_device

log = logging.getLogger("lfmspark")

# at the default prefix-cache budget, cached blocks may take up to one page in this many: a block holds
# a conv snapshot beside its page (80 KiB beside 360 KiB of K/V at the LFM2.5-1.2B shape), so a snapshot
# for every page would cost the pool about a fifth of its pages for the same memory
DEFAULT_CACHED_SHARE = 4


@dataclass
class RoundResult:
    """One row of a collected round: what it committed for ``request``."""

    request: Request
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class FirstToken:
    """A request whose prefill finished: its first token, picked on the device, and its scores."""

    request: Request
    token: torch.Tensor
    scores: torch.Tensor


@dataclass
class _InFlight:
    requests: list[Request]
    slots: np.ndarray             # [n] their slots
    tokens: torch.Tensor          # host copy [n, W] (pinned on CUDA)
    n_new: torch.Tensor           # host copy [n]
    done: torch.cuda.Event | None
    width: int = 1                # the round's verify width (1 for a decode step)
    confidence: torch.Tensor | None = None      # host copy [n, gamma] when the width policy reads it
    logprobs: LogprobTensors | None = None      # host copies, W entries per row that asked (logprob_rows)
    logprob_rows: dict[int, int] | None = None  # row -> its block in ``logprobs``


def _numerics(method: Callable) -> Callable:
    """Run ``method`` in the engine's numerics: exact mode's routes or the default ones (module doc)."""
    @functools.wraps(method)
    def wrapper(self: ModelRunner, *args, **kwargs):
        with self.numerics():
            return method(self, *args, **kwargs)
    return wrapper


class ModelRunner:
    """The device side of one engine (module doc)."""

    def __init__(self, target: Lfm2ForCausalLM, draft: DSparkDraft | None, config: EngineConfig):
        self.target, self.draft, self.options = target, draft, config
        self.device, self.dtype = target.device, target.dtype
        self.exact = config.exact
        if self.device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        self.block_size = draft.config.block_size if draft is not None else 0
        self.verify_width = self.block_size + 1
        if config.routing_locality is not None:
            impose_routing_locality(target, config.routing_locality, config.max_batch)
        if config.quantization == "fp8":   # a target built in memory: quantized in place (loaded ones already are)
            quantize_target(target)
        # inference only: parameters that require grad would make a compiled region traced outside
        # no_grad (e.g. by a user timing a phase) build a backward graph
        target.requires_grad_(False)
        if draft is not None:
            draft.requires_grad_(False)
        self._build_caches(config)
        self.imposed_acceptance = self._imposed(config.imposed_acceptance)
        self.state = SlotState(config.max_batch, target.config.vocab_size, self.device, self.verify_width)
        self.steps = Steps(target, self.tcache, self.state, draft, self.dcache, self.imposed_acceptance,
                           config.markov_walk, config.logprobs_mode)
        self.width_policy = self._width_policy(config.verify_widths)
        self.step_runner = self._make_step_runner(config)
        self.cuda_graphs = not isinstance(self.step_runner, EagerRunner)
        # prefill_graph_tokens > 0 (the default): prompts run at bucket shapes (graphs/prefill.py),
        # replayed from graphs once captured; 0: eager prefill at each chunk's own shape
        self.prefill_runner = PrefillRunner(
            self.steps.prefill_logits, self.device,
            prefill_buckets(config.max_batch, min(config.prefill_chunk, self.max_seq_len),
                            config.prefill_graph_tokens), self.tcache.max_seq_len, self.snapshots)
        self.step_kind = StepKind.ROUND if draft is not None else StepKind.DECODE
        self.in_flight: _InFlight | None = None
        self._host_buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._flip = 0
        # called for every request row of every round that verified drafts, with (request id, drafts
        # verified, drafts accepted, the round's confidences or None): what `lfmspark calibrate` records
        self.round_observer: Callable[[str, int, int, list[float] | None], None] | None = None

    # -- construction --------------------------------------------------------------------------
    def _build_caches(self, config: EngineConfig) -> None:
        cfg = self.target.config
        if self.draft is not None:
            check_draft_fits_target(self.draft.config, cfg)
            self.draft.attach_target(self.target.model.embed_tokens, self.target.lm_head)
        size = config.page_size
        # at the prefix cache's default budget one page in DEFAULT_CACHED_SHARE may become a cached block,
        # so each page is budgeted with that share of a conv snapshot (runtime/prefix_cache.py "Memory")
        snapshot = self.snapshot_nbytes() // DEFAULT_CACHED_SHARE if config.prefix_cache_tokens is None else 0
        n_pages = kv_pool_pages(config, self.page_nbytes(size) + snapshot, self.device, cfg.max_position_embeddings,
                                cfg.vocab_size, self.verify_width)
        # a request's prompt and output fit max_seq_len; past its last token a round's window and the
        # draft's block are scratch, so a slot maps max_seq_len + verify_width positions
        self.max_seq_len = resolve_max_seq_len(config, cfg.max_position_embeddings, n_pages * size,
                                               self.verify_width)
        positions = self.max_seq_len + self.verify_width
        self.tcache = TargetCache.allocate(cfg, config.max_batch, positions, self.verify_width, self.dtype,
                                           self.device, page_size=size, n_pages=n_pages)
        self.dcache = None
        if self.draft is not None:
            self.dcache = DraftCache.allocate(self.draft.config, config.max_batch, positions, self.dtype,
                                              self.device, page_size=size, n_pages=n_pages,
                                              page_table=self.tcache.page_table)
        self.pages = SlotPages(PagePool(n_pages), config.max_batch, self.tcache.page_table.shape[1], size,
                               trash=n_pages)
        log.info("KV cache: %d pages of %d tokens (%d tokens, %.2f GiB), max_seq_len %d", n_pages, size,
                 n_pages * size, n_pages * self.page_nbytes(size) / 2**30, self.max_seq_len)
        blocks = self._prefix_blocks(config, n_pages)
        self.prefix_cache = PrefixCache(self.tcache, self.pages, blocks) if blocks else None
        self.snapshots: ConvSnapshots | None = None
        if self.prefix_cache is not None:
            # the widest prefill forward is a chunk (or bucket) of at most prefill_chunk tokens
            widest = min(config.prefill_chunk, self.max_seq_len)
            index = torch.full((config.max_batch, -(-widest // size)), self.prefix_cache.scratch, dtype=torch.int64,
                               device=self.device)
            self.snapshots = ConvSnapshots(self.prefix_cache.conv, index, size)
            log.info("prefix cache: %d blocks of %d tokens, conv snapshots %.2f MiB", blocks, size,
                     self.prefix_cache.conv.numel() * self.prefix_cache.conv.element_size() / 2**20)
        if config.prefix_cache_outputs and self.prefix_cache is None:
            raise ValueError("prefix_cache_outputs=True needs the prefix cache: leave prefix_cache_tokens at None "
                             "or give it a budget of at least one KV page")

    def page_nbytes(self, page_size: int) -> int:
        """Bytes of one KV page: every attention layer's K and V of the target and the draft."""
        t = self.target.config
        n = len(t.attention_layers) * t.num_key_value_heads * t.head_dim
        if self.draft is not None:
            d = self.draft.config
            n += d.num_hidden_layers * d.num_key_value_heads * d.head_dim
        return 2 * n * page_size * self.dtype.itemsize

    def snapshot_nbytes(self) -> int:
        """Bytes of one prefix-cache block's conv snapshot: every ShortConv layer's last ``K - 1``
        gated inputs (runtime/prefix_cache.py "Memory")."""
        t = self.target.config
        return len(t.conv_layers) * (t.conv_L_cache - 1) * t.hidden_size * self.dtype.itemsize

    def _prefix_blocks(self, config: EngineConfig, n_pages: int) -> int:
        """The prefix cache's capacity in blocks of one page (0: none): its budget of tokens, by
        default one block per ``DEFAULT_CACHED_SHARE`` pages of the pool (cached blocks live in the
        pool's pages; each holds a conv snapshot of its own)."""
        tokens = config.prefix_cache_tokens
        if tokens is None:
            tokens = n_pages // DEFAULT_CACHED_SHARE * config.page_size
        if config.page_size >= self.max_seq_len:
            return 0           # no prompt can fill a page and leave a token to run
        return tokens // config.page_size

    def _imposed(self, rates: Sequence[float] | None) -> torch.Tensor | None:
        """Imposed per-position rates as the tensor the rounds read: one rate applies to every draft slot."""
        if rates is None:
            return None
        if self.draft is None:
            raise ValueError("imposed_acceptance needs a draft: target-only decoding has nothing to accept")
        rates = list(rates)
        if len(rates) == 1:
            rates = rates * self.block_size
        if len(rates) != self.block_size or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"imposed_acceptance must give {self.block_size} per-position rates in [0, 1] "
                             f"(one per draft slot), got {rates}")
        return torch.tensor(rates, dtype=torch.float32, device=self.device)

    def set_imposed_acceptance(self, rates: Sequence[float]) -> None:
        """Change the imposed per-position rates (copied into the tensor the captured graphs read, so
        nothing recompiles)."""
        if self.imposed_acceptance is None:
            raise ValueError("this engine was built without imposed_acceptance: pass it to Engine(...) first")
        self.imposed_acceptance.copy_(self._imposed(rates))

    def _width_policy(self, widths: Sequence[int] | None) -> WidthPolicy | None:
        if self.draft is None:
            if widths is not None:
                raise ValueError("verify_widths needs a draft: target-only decoding verifies nothing")
            return None
        full = self.block_size + 1
        if widths is None:
            widths = default_verify_widths(self.block_size)
        elif not widths or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= full for w in widths):
            raise ValueError(f"verify_widths must be a non-empty list of integers in [1, {full}] (a window of the "
                             f"anchor and up to {self.block_size} drafts), got {list(widths)!r}")
        widths = tuple(sorted(set(widths)))
        confidences = self.draft.confidence_head is not None or self.imposed_acceptance is not None
        # rounds compute confidences only where a choice reads them
        self.steps.want_confidence = len(widths) > 1 and confidences
        return WidthPolicy(widths, self.block_size, confidences, self.state.n_slots)

    def _make_step_runner(self, config: EngineConfig) -> StepRunner:
        on_cuda = self.device.type == "cuda"
        cuda_graphs = on_cuda if config.cuda_graphs is None else config.cuda_graphs
        if cuda_graphs:
            if not on_cuda:
                raise ValueError("cuda_graphs=True needs a CUDA device")
            from ..graphs.capture import CudaGraphRunner

            return CudaGraphRunner(self.steps, self.device, config.max_batch, config.batch_sizes,
                                   compile=True if config.compile is None else config.compile,
                                   widths=self.verify_widths)
        return EagerRunner(self.steps, self.device, compile=bool(config.compile), max_batch=config.max_batch,
                           widths=self.verify_widths)

    # -- what it runs --------------------------------------------------------------------------
    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths rounds are captured at (``(0,)`` for a target-only engine: no rounds)."""
        return self.width_policy.widths if self.width_policy is not None else (0,)

    @property
    def routing_locality(self) -> int | None:
        """The experts per slot and MoE layer the routing-locality benchmark mode allows (None: off)."""
        return routing_locality(self.target)

    def numerics(self) -> contextlib.AbstractContextManager:
        """The routes this engine's target runs (exact mode's or the default): for code that calls
        the steps directly, such as the benchmark's phase timings."""
        return exact_scope(self.exact)

    # -- warm-up -------------------------------------------------------------------------------
    @_numerics
    def warmup(self, progress: bool = True, modes: Sequence[SamplingMode] = tuple(SamplingMode)) -> WarmupReport:
        """Compile and capture everything the engine replays: first the prefill (the eager path at the
        shapes that compile every prefill kernel variant, then a graph for every bucket shape), then
        the step (decode or round) for every captured batch size in each of ``modes``. Prefill comes
        first because bucket graphs captured after the step graphs slowed every later decode step
        (docs/decisions.md), captured before them they cost nothing."""
        t0 = time.perf_counter()
        self.prefill_runner.set_snapshot_rows(None)   # warm-up's forwards store no snapshot
        # the bucket graphs are captured with the snapshot copies in them (graphs/prefill.py)
        with self.target.conv_snapshots(self.snapshots):
            self._warm_prefill(modes)
            prefill_entries = self.prefill_runner.warmup(
                progress, capture=self.cuda_graphs, capture_stream=getattr(self.step_runner, "capture_stream", None))
        prefill_s = time.perf_counter() - t0
        if progress:
            log.info("prefill warm-up %.2fs (%d bucket graphs)", prefill_s, len(self.prefill_runner.captured))
        report = self.step_runner.warmup([self.step_kind], progress=progress, modes=modes)
        report.entries += prefill_entries
        report.prefill_s = prefill_s
        return report

    def prefill_warm_shapes(self) -> list[tuple[int, int]]:
        """The ``(rows, length)`` prefills :meth:`warmup` runs. Off CUDA nothing is compiled, so one
        short prefill exercises the path."""
        max_seq_len = self.max_seq_len
        if self.device.type != "cuda":
            return [(1, min(16, max_seq_len))]
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        variants = prefill_variants(self.target.config, self.tcache.max_seq_len, self.dtype.itemsize, sms)
        return prefill_warm_shapes(self.options.max_batch, min(self.options.prefill_chunk, max_seq_len), variants)

    def _warm_prefill(self, modes: Sequence[SamplingMode]) -> None:
        """Run :meth:`prefill_warm_shapes` on free slots (greedy, and the first shape in each of
        ``modes`` too). Admission prefills a slot from position 0, which resets the conv state and
        overwrites the K/V this leaves behind (positions past a row's length are never attended)."""
        for i, (rows, length) in enumerate(self.prefill_warm_shapes()):
            ids = torch.zeros(rows, length, dtype=torch.int64, device=self.device)
            slots = torch.arange(rows, device=self.device)
            for mode in {SamplingMode.GREEDY, *modes} if i == 0 else (SamplingMode.GREEDY,):
                self.steps.prefill(ids, slots, torch.zeros_like(slots), torch.full_like(slots, length), mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, group: list[Request]) -> None:
        """Set up the slots of a prompt's requests (sampling state, draft cap, width estimates) and
        start its leader's prefill after the longest cached prefix of its prompt, copied into its slot
        (a request asking for prompt logprobs computes every position)."""
        for req in group:
            self.state.sampling.set(req.slot, req.params, req.seed, req.prompt_ids, req.stop_ids)
            if req.output:        # resuming after a preemption: its output so far is in its history
                self.state.sampling.record(to_device([req.slot], self.device),
                                           to_device([req.output], self.device))
            cap = req.params.max_speculative_tokens
            self.state.draft_limit[req.slot] = NO_DRAFT_LIMIT if cap is None else cap
            if self.width_policy is not None:
                self.width_policy.admit(req.slot, self.block_size if cap is None else min(cap, self.block_size))
        lead, cache = group[0], self.prefix_cache
        if cache is None or lead.params.prompt_logprobs is not None:
            return
        context = lead.context_ids
        cache.stats.queries += len(context)
        lead.prefilled = lead.cached_tokens = cache.load(cache.match(context), lead.slot)
        cache.stats.hits += lead.cached_tokens

    def load_cached_prefix(self, job: Request) -> None:
        """Start a cache job (a finished turn's tokens) after the longest cached prefix of them; a
        prefix that cannot be loaded makes the job a no-op (only the cache misses out)."""
        cache = self.prefix_cache
        try:
            job.prefilled = cache.load(cache.match(job.prompt_ids), job.slot)
        except Exception:
            log.warning("could not load the cached prefix of %s", job.request_id, exc_info=True)
            job.prefilled = len(job.prompt_ids)

    # -- prefill -------------------------------------------------------------------------------
    @_numerics
    def prefill(self, plan: PrefillPlan) -> torch.Tensor:
        """Run one prefill forward (the plan's chunks, each row from where its prompt stands) and store
        the prefix-cache blocks it completes; the logits ``[rows, V]`` of each chunk's last token.
        Rows that ask for prompt logprobs run eagerly with every position's logits (they are rare, and
        no graph holds logits of every position), the others from the prefill runner's buckets."""
        rows = plan.rows
        self.pages.flush(self.tcache.page_table)
        # the blocks this forward completes go into the prefix cache before it runs; the forward
        # writes their conv snapshots (runtime/prefix_cache.py "Snapshots")
        stored = None
        if self.prefix_cache is not None:
            stored = self.prefix_cache.insert(
                [(r.context_ids, r.slot, s, e) for r, s, e in zip(rows, plan.starts, plan.ends)],
                self.snapshots.index.shape[1])
        try:
            with self.target.conv_snapshots(self.snapshots):
                return self._prefill_forwards(plan, stored.rows if stored is not None else None)
        except BaseException:
            if stored is not None:
                self.prefix_cache.drop(stored)
            raise

    def _prefill_forwards(self, plan: PrefillPlan, snapshot_rows: list[list[int]] | None) -> torch.Tensor:
        """The forwards of :meth:`prefill`; ``snapshot_rows[i]``: where row ``i``'s conv snapshots go
        (None: nowhere)."""
        rows = plan.rows
        pick = lambda idx: [snapshot_rows[i] for i in idx] if snapshot_rows is not None else None  # noqa: E731
        # a request resuming after a preemption has its prompt logprobs already
        plain = [i for i, r in enumerate(rows) if r.params.prompt_logprobs is None or r.output]
        if len(plain) == len(rows):
            self.prefill_runner.set_snapshot_rows(snapshot_rows)
            return self.prefill_runner.run(plan.chunks, [r.slot for r in rows], plan.starts)
        out: list[torch.Tensor | None] = [None] * len(rows)
        if plain:
            self.prefill_runner.set_snapshot_rows(pick(plain))
            part = self.prefill_runner.run([plan.chunks[i] for i in plain], [rows[i].slot for i in plain],
                                           [plan.starts[i] for i in plain])
            for j, i in enumerate(plain):
                out[i] = part[j]
        for i, req in enumerate(rows):
            if out[i] is None:
                mine = snapshot_rows[i] if snapshot_rows is not None else None
                out[i] = self._prefill_with_prompt_logprobs(req, plan.chunks[i], plan.starts[i], mine)
        return torch.stack(out)

    def _prefill_with_prompt_logprobs(self, req: Request, chunk: list[int], start: int,
                                      snapshot_rows: list[int] | None = None) -> torch.Tensor:
        """One chunk of ``req``'s prompt with the logits of every position: appends the raw logprobs of
        the prompt tokens they predict to ``req.prompt_logprobs`` (the first prompt token has none:
        ``None``); returns the chunk's last logits ``[V]``. Prompt logprobs are always of the raw
        logits: the logit transforms depend on an output history the prompt does not have."""
        ids = torch.tensor([chunk], dtype=torch.int64, device=self.device)
        one = lambda v: torch.tensor([v], dtype=torch.int64, device=self.device)  # noqa: E731
        self.prefill_runner.set_snapshot_rows([snapshot_rows] if snapshot_rows else None)
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

    @_numerics
    def first_tokens(self, plan: PrefillPlan, logits: torch.Tensor, done: list[tuple[Request, list[Request]]]
                     ) -> list[FirstToken]:
        """The first token of each request whose prompt the plan's forward completed (``done``: each
        with the other samples of its prompt, which get its prefilled caches and pick their own first
        token from the same logits), picked on the device: nothing waits for it here."""
        if not done:
            return []
        index = [plan.rows.index(lead) for lead, _ in done]
        requests = [r for lead, others in done for r in (lead, *others)]
        mode = sampling_mode((r.params for r in requests), self.target.config.vocab_size)
        t = lambda v: to_device(v, self.device)  # noqa: E731
        with self._constraints(requests, [[]] * len(requests)):
            picked, scores = self.steps.prefill_pick(logits.index_select(0, t(index)),
                                                     t([lead.slot for lead, _ in done]),
                                                     t([len(lead.context_ids) for lead, _ in done]), mode)
            out = []
            for j, (lead, others) in enumerate(done):
                out.append(FirstToken(lead, picked[j], scores[j]))
                for first in self._share_prefill(lead, others, logits[index[j]], mode):
                    first.request.prompt_logprobs = lead.prompt_logprobs
                    out.append(first)
        return out

    def _share_prefill(self, lead: Request, others: list[Request], logits: torch.Tensor, mode: SamplingMode
                       ) -> list[FirstToken]:
        """Give ``others`` (samples of ``lead``'s prompt) its prefilled caches, then pick each one's
        first token from ``logits [V]`` (the prompt's last) with its own sampling state."""
        if not others:
            return []
        n = len(lead.context_ids)
        dst = [r.slot for r in others]
        self._share_pages(lead.slot, dst, n)
        slots = to_device(dst, self.device)
        picked, scores = self.steps.prefill_pick(logits[None].expand(len(dst), -1), slots, torch.full_like(slots, n),
                                                 mode)
        return [FirstToken(req, picked[j], scores[j]) for j, req in enumerate(others)]

    def _share_pages(self, src: int, dst: list[int], length: int) -> None:
        """Give slots ``dst`` the state slot ``src`` has after ``length`` tokens: its full pages by
        reference, a copy of its last partial page (the samples write their own tokens there) and
        the conv state."""
        size = self.pages.page_size
        full, partial = divmod(length, size)
        shared = self.pages.pages[src][:full]
        copies = []
        for slot in dst:
            self.pages.share(slot, shared)
            if partial:
                self.pages.ensure(slot, length)
                copies.append(self.pages.pages[slot][full])
        if copies:
            index = to_device(copies, self.device)
            source = to_device([self.pages.pages[src][full]] * len(copies), self.device)
            for cache in (self.tcache, self.dcache):
                if cache is not None:
                    cache.copy_pages(source, index)
        idx = to_device(dst, self.device)
        self.tcache.conv_state[:, idx] = self.tcache.conv_state[:, src:src + 1]

    def read_first_tokens(self, started: list[FirstToken]) -> list[RoundResult]:
        """The first tokens on the host (one sync for them all) with the logprobs of those that ask."""
        if not started:
            return []
        want = [(i, f) for i, f in enumerate(started) if f.request.params.logprobs is not None]
        lp = None
        if want:
            lp = token_logprobs(torch.stack([f.scores for _, f in want]), torch.stack([f.token for _, f in want]),
                                max(f.request.params.logprobs for _, f in want)).to_host()
        # one host sync, after which the logprobs' host copies (queued before it) are complete too
        tokens = torch.stack([f.token for f in started]).tolist()
        records = {i: lp.records([tokens[i]], j, 1, f.request.params.logprobs) for j, (i, f) in enumerate(want)}
        for f, token in zip(started, tokens):
            if f.request.matcher is not None:
                f.request.matcher.consume([token])
        return [RoundResult(f.request, [tokens[i]], records.get(i)) for i, f in enumerate(started)]

    # -- rounds --------------------------------------------------------------------------------
    @_numerics
    def step(self, rows: list[Request]) -> list[RoundResult]:
        """Launch the next round for ``rows`` (the decoding requests), then collect the previous
        round's tokens (module doc: pipelined). A batch with a structured-output request runs its
        round at once instead (:meth:`_constrained_round`). On a failure no round is left in flight."""
        rows = [r for r in rows if not r.finished]
        self.pages.flush(self.tcache.page_table)
        try:
            if any(r.matcher is not None for r in rows):
                return self._constrained_round(rows)
            launched = self._launch(rows)
            results = self._collect(self.in_flight) if self.in_flight is not None else []
        except BaseException:
            self.in_flight = None
            raise
        self.in_flight = launched
        return results

    def _constrained_round(self, rows: list[Request]) -> list[RoundResult]:
        """A round of a batch holding structured-output requests: the masks of a verify window come
        from each request's matcher advanced through the window's drafts, so the drafts go to the
        host between the draft and the verify, and the next round's masks need this round's
        committed tokens: the round runs its phases one after the other, uncaptured, and is
        collected at once (no pipelining while such a request runs; the others in the batch pay
        that too). The round in flight, launched before, is collected first."""
        results = self._collect(self.in_flight) if self.in_flight is not None else []
        self.in_flight = None
        mode = sampling_mode((r.params for r in rows), self.target.config.vocab_size)
        slots_np = np.array([r.slot for r in rows], dtype=np.int64)
        width = self._choose_width(slots_np, mode)
        slots = to_device(slots_np.tolist(), self.device)
        with torch.no_grad():
            if width is None:                                   # a target-only decode step
                with self._constraints(rows, [[]] * len(rows)):
                    out = self.steps.decode(slots, mode)
            else:
                inputs = self.steps.round_inputs(slots, mode, width)
                drafted = self.steps.round_draft(inputs)
                drafts = drafted.tokens.tolist() if width > 1 else [[]] * len(rows)
                with self._constraints(rows, drafts):
                    out = self.steps.round_commit(inputs, drafted, self.steps.round_verify(inputs, drafted.window))
        return results + self._collect(self._to_host(rows, slots_np, out, width or 1))

    @contextlib.contextmanager
    def _constraints(self, rows: list[Request], drafts: list[list[int]]) -> Iterator[None]:
        """Inside: the target's transforms read the structured-output masks, which hold, for each row
        with a constraint, the tokens its matcher allows at each column of the window (after the
        row's ``drafts`` before it). Without a constrained row, nothing changes."""
        constrained = [(r, d) for r, d in zip(rows, drafts) if r.matcher is not None]
        if not constrained:
            yield
            return
        grammar = self.state.sampling.grammar
        masks = np.full((len(constrained), grammar.shape[1], grammar.shape[2]), -1, dtype=np.int32)
        for i, (req, d) in enumerate(constrained):
            rows_i = req.matcher.masks(d)
            masks[i, :len(rows_i)] = rows_i
        grammar.index_copy_(0, to_device([r.slot for r, _ in constrained], self.device),
                            torch.from_numpy(masks).to(self.device))
        self.state.sampling.constrain = True
        try:
            yield
        finally:
            self.state.sampling.constrain = False

    def drop_in_flight(self) -> None:
        """Nothing decodes any more: wait for the round in flight and drop its results."""
        if self.in_flight is not None:
            if self.in_flight.done is not None:
                self.in_flight.done.synchronize()
            self.in_flight = None

    def _launch(self, rows: list[Request]) -> _InFlight | None:
        if not rows:
            return None
        mode = sampling_mode((r.params for r in rows), self.target.config.vocab_size)
        slots = [r.slot for r in rows]
        slots_np = np.array(slots, dtype=np.int64)
        width = self._choose_width(slots_np, mode)
        out = self.step_runner.run(self.step_kind, slots, mode, width)
        return self._to_host(rows, slots_np, out, width or 1)

    def _to_host(self, rows: list[Request], slots_np: np.ndarray, out, width: int) -> _InFlight:
        """Queue the host copies of a launched round's outputs (``out``: a ``StepOutput``)."""
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
        return _InFlight(rows, slots_np, tokens_host, n_new_host, done, width=width, confidence=confidence,
                         logprobs=logprobs, logprob_rows=logprob_rows)

    def _choose_width(self, slots: np.ndarray, mode: SamplingMode) -> int | None:
        """The next round's verify width (None for a decode step): from what earlier rounds returned
        only, never from this round's drafts (runtime/speculation.py says why that keeps it lossless)."""
        if self.width_policy is None:
            return None
        width = self.width_policy.choose(slots, self.step_runner.padded_size(len(slots)), mode,
                                         self.step_runner.costs)
        self.width_policy.count_round(width)
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
            n = self.state.n_slots
            self._host_buffers = [
                (torch.zeros(n * self.verify_width, dtype=torch.int64, pin_memory=pin),
                 torch.zeros(n, dtype=torch.int64, pin_memory=pin),
                 torch.zeros(n, self.block_size, dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        self._flip ^= 1
        return self._host_buffers[self._flip]

    def _collect(self, inflight: _InFlight) -> list[RoundResult]:
        """The round's tokens for its rows still running (the others' results are dropped), booked
        with the width policy and the round observer."""
        if inflight.done is not None:
            inflight.done.synchronize()
        tokens, n_new = inflight.tokens.tolist(), inflight.n_new.tolist()
        width = inflight.tokens.shape[1]
        # rows of requests that finished, or were preempted (their slot taken back), are dropped
        live = [i for i, req in enumerate(inflight.requests) if not req.finished and req.slot == inflight.slots[i]]
        verified = self._observe_round(inflight, live) if self.width_policy is not None else None
        results = []
        for j, i in enumerate(live):
            req = inflight.requests[i]
            if verified is not None:
                req.accept_lengths.append(n_new[i])
                req.drafts_verified.append(verified[j])
            new = tokens[i][:n_new[i]]
            if req.matcher is not None:
                req.matcher.consume(new)
            logprobs = None
            if inflight.logprob_rows is not None and i in inflight.logprob_rows:
                logprobs = inflight.logprobs.records(new, inflight.logprob_rows[i] * width, len(new),
                                                     req.params.logprobs)
            results.append(RoundResult(req, new, logprobs))
        return results

    def _observe_round(self, inflight: _InFlight, live: list[int]) -> list[int]:
        """Book a round's rows ``live`` (indices into ``inflight``) with the width policy (its statistics
        and estimates, from the round's confidences where it computed them) and the round observer;
        returns the drafts each was offered."""
        committed = inflight.n_new.numpy()[live]
        confidence = inflight.confidence.numpy()[live] if inflight.confidence is not None else None
        verified = self.width_policy.observe(inflight.slots[live], inflight.width, committed, confidence).tolist()
        if self.round_observer is not None:
            for j, i in enumerate(live):
                if verified[j]:
                    row = None if confidence is None or np.isnan(confidence[j]).any() else confidence[j].tolist()
                    self.round_observer(inflight.requests[i].request_id, verified[j], int(committed[j]) - 1, row)
        return verified

    # -- the prefix cache ----------------------------------------------------------------------
    def prefix_cache_stats(self) -> dict:
        """The prefix cache's counters (prompt tokens queried and found cached, blocks stored and
        evicted, blocks held, its capacity, tokens per block: a KV page) and the prefill chunks'
        alignment (``prefix_block``); empty without a prefix cache."""
        pc = self.prefix_cache
        if pc is None:
            return {}
        return {**pc.stats.as_dict(), "cached_blocks": pc.cached_blocks, "capacity_blocks": pc.capacity,
                "block": pc.block, "chunk_alignment": self.options.prefix_block}

    def speculation_stats(self) -> dict:
        """Engine-wide speculation counters (runtime/speculation.py ``SpeculationStats``); empty for a
        target-only engine."""
        return self.width_policy.stats.as_dict() if self.width_policy is not None else {}
