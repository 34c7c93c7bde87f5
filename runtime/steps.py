"""The device-side step functions: prefill, target-only decode, and the DSpark speculative round.

All of them are plain tensor code over the slot-indexed state, with no host syncs: accepted
lengths, positions, slots and anchors stay on the device, so ``decode`` and ``spec_round`` are
captured whole in a CUDA graph per batch size (DESIGN §5). Their regions are what gets compiled,
with ``fullgraph=True`` (graphs/compile.py), each declared here by :func:`region`: the heads
``decode_head``, ``draft_head`` and ``verify_head`` (the glue before a model's layers, together
with its first layer), the tails ``finish_decode``, ``finish_draft``, ``round_accept_commit``, and
the draft's context injection ``round_inject`` (on a side stream: :meth:`Steps.round_commit`); the
layers after the first are compiled too, one graph per kind.
The only input of a step is ``slots [B]`` (``-1`` = padding row); everything else is read from the
per-slot state. Outputs are the committed new tokens per row.

No tensor computation runs between two regions (tests/runtime/test_step_glue.py counts it): uncompiled,
each op there would be a CUDA-graph node of its own that cannot join the programmatic-dependent-
launch chain of the compiled kernels (ops/_dispatch.py). So each region reads the per-slot state
it needs (committed length, anchor, sampling parameters) from ``slots`` itself, a gather that
Inductor fuses into the region's kernels, and a head computes what its layers share (the window's
lens) as its outputs; the attention layers read their RoPE rows from the table themselves (a
region output is materialised even where no later region reads it). Between regions the step
only slices the caches per layer (views: no kernels). The verify hands its aux taps to the commit
region unjoined, which concatenates them for the draft's context injection.

One speculative round (DESIGN §1) of width ``W``, per row with committed length ``s`` and anchor
``x0``: draft ``g = W - 1`` tokens (the draft's layers over its whole block, its head and walk over
the first ``g`` slots) → verify ``[x0, d_1..d_g]`` at ``s..s+g`` → accept ``a`` drafts →
commit ``a + 1`` tokens (conv state from the tape, draft context K/V from the verify's aux hidden
states) → the correction/bonus token becomes the next anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..models.cache import DraftCache, LayerCache, TargetCache
from ..models.dspark import DSparkDraft
from ..models.layers import Pending
from ..models.lfm2 import ForwardMode, Lfm2ForCausalLM, PartialForward, Rows
from ..ops.argmax_rows import argmax_last
from ..ops.routing import exact_scope
from .distributions import Filtered, SamplingMode
from .randomness import STREAM_ACCEPT, STREAM_DRAFT, STREAM_IMPOSED, STREAM_TOKEN, draw_key, gumbel, sample, uniform
from .sampling import RowSampling, block_history
from .state import SlotState


F = TypeVar("F", bound=Callable)


def region(draft: bool = False, window: dict[str, int] | None = None) -> Callable[[F], F]:
    """Declare a :class:`Steps` method one compiled region (graphs/compile.py ``compile_regions``);
    ``draft``: only when the engine has a draft; ``window``: which of its inputs hold a round's window
    of columns, by path and dimension (graphs/compile.py ``BatchDynamic``), so that one compiled
    graph serves every width of two or more."""
    def mark(fn: F) -> F:
        fn.compiled_region = "draft" if draft else "target"
        fn.window_inputs = window
        return fn
    return mark


def verify_mode(width: int) -> ForwardMode:
    """The target's forward mode in a round of ``width`` columns: a round of width 1 verifies nothing,
    so it runs as the target-only decode step does (the same kernels, so the same cost and bits, the
    conv states updated in place, no tape to commit) and only adds the draft's context injection."""
    return ForwardMode.DECODE if width == 1 else ForwardMode.VERIFY


@dataclass
class RoundInputs:
    """What the round's phases share. Each phase's regions read the rows' state (committed length
    ``s``, anchor ``x0``, sampling parameters) from the slots themselves (see the module doc).

    ``columns``: ``0 .. W - 1`` for the verify window's ``W`` columns, ``x0`` and the first ``W - 1``
    drafts (1: no draft runs, the round is a decode step that feeds the draft its context;
    runtime/speculation.py); a view of one tensor of the steps (:attr:`Steps.columns`). The width
    reaches the regions as this tensor's shape, never as a Python int, so that one compiled graph
    of a region serves every width of two or more (graphs/compile.py marks the width dynamic);
    width 1 is a variant of its own (a decode step's kernels)."""

    slots: torch.Tensor
    mode: SamplingMode
    columns: torch.Tensor

    @property
    def width(self) -> int:
        """The window's columns: a Python int in the glue, a symbolic size inside a compiled region."""
        return self.columns.shape[0]


@dataclass
class RowState:
    """Per-row state of a batch, read from the slots (:meth:`Steps.read_rows`; in a region)."""

    index: torch.Tensor           # [B] gather index (padding rows read slot 0)
    s: torch.Tensor               # [B] committed length (position of the anchor)
    x0: torch.Tensor              # [B] anchor token
    rows: RowSampling | None      # per-row sampling parameters; None for a greedy step


@dataclass
class Drafted:
    """A round's proposals: the first ``g = width - 1`` slots of the draft's block (the slots the round
    verifies; the draft's layers ran the whole block, its head and walk these slots only)."""

    # [B, W] the verify's window x0, d_1..d_g (None: a round of width 1 drafts nothing); the regions
    # after the draft take it whole, so its width is never a size-1 dimension (which Dynamo would
    # specialise: graphs/compile.py)
    window: torch.Tensor | None
    q: Filtered | None            # B * g rows (row b * g + k): the q each was drawn from (sampling rounds)
    # [B, gamma] fp32 c_k (the head's, NaN past slot g; or the imposed rates, all known), if wanted
    confidence: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        """``[B, g]``: the drafts d_1..d_g (a view of :attr:`window`)."""
        return None if self.window is None else self.window[:, 1:]


@dataclass
class Verified:
    hidden: torch.Tensor          # [B, W, H] the target's last-layer output is hidden + delta, left unadded:
    delta: Pending                # the logits, taken at acceptance, fuse the add or the carried norm (models/lfm2.py)
    aux: tuple[torch.Tensor, ...]  # n_taps x [B, W, H] target features for the draft context (joined at commit)
    rows: Rows                    # the window's slots, start (= s) and lens (all W columns), from the verify head
    injected: bool = False        # the verify forked the context injection itself (Steps.round_verify)


@dataclass
class StepOutput:
    tokens: torch.Tensor      # [B, W] int64: new tokens of each row; the first n_new[b] are real
    n_new: torch.Tensor       # [B] int64: tokens committed this step (accept length incl. the bonus)
    # [B, W, V]: what column j's logprobs are taken from (runtime/logprobs.py): the target's logits
    # (raw), or in a sampling step with logprobs_mode "processed" its transformed, filtered logits; a
    # tensor the step holds anyway, so returning it costs nothing
    scores: torch.Tensor
    # [B, gamma] fp32: a round's confidences c_k, for the width policy (runtime/speculation.py) of later rounds;
    # NaN where none were computed (no confidence head, a round of width 1, the slots past a narrower
    # round's drafts); [B, 0] for a decode step
    confidence: torch.Tensor


class Steps:
    """Step functions bound to one engine's models and state."""

    def __init__(self, target: Lfm2ForCausalLM, tcache: TargetCache, state: SlotState,
                 draft: DSparkDraft | None = None, dcache: DraftCache | None = None,
                 imposed_acceptance: torch.Tensor | None = None, markov_walk: str = "jacobi",
                 logprobs_mode: str = "raw"):
        self.target, self.tcache, self.state = target, tcache, state
        self.logprobs_mode = logprobs_mode        # which scores the steps hand out (StepOutput.scores)
        self.draft, self.dcache = draft, dcache
        self.taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
        self.gamma = draft.config.block_size if draft is not None else 0
        # 0 .. gamma: a round's RoundInputs.columns are its first `width` (a view, no kernel)
        self.columns = torch.arange(self.gamma + 1, device=target.device)
        self.imposed = imposed_acceptance    # [gamma] conditional acceptance rates, or None
        # whether rounds compute the draft's confidences (the engine sets it when its width policy reads them)
        self.want_confidence = False
        # the greedy Markov walk's kernel family (Engine(markov_walk=...)), and whether the Jacobi
        # kernel tallies its passes (the benchmark sets it before capturing: read at trace time)
        self.markov_walk = markov_walk
        self.count_walk_passes = False
        # what decode and the round run for the layers after the first (the first runs inside the
        # head regions): the layers, or compiled wrappers of them (graphs.compile.compile_regions);
        # prefill always runs the plain layers (any length)
        self.later_target_layers = list(target.model.layers[1:])
        self.later_draft_layers = list(draft.layers[1:]) if draft is not None else []
        # the stream the draft's context injection forks to (round_verify), one for the engine's life,
        # so the warm-up and every capture use the same one (on CPU, none: program order)
        device = target.device
        self.side_stream = torch.cuda.Stream(device) if draft is not None and device.type == "cuda" else None
        self._injection_pending = False   # forked to the side stream and not yet joined (a capture-time flag)

    def region_names(self) -> list[str]:
        """The methods declared as compiled regions (:func:`region`) that this engine runs."""
        kinds = ("target", "draft") if self.draft is not None else ("target",)
        return [name for name, fn in vars(type(self)).items() if getattr(fn, "compiled_region", None) in kinds]

    def read_rows(self, slots: torch.Tensor, sampling: bool = False, grammar: bool = True) -> RowState:
        """The rows' per-slot state; called inside each region that needs it. ``grammar``: whether the
        target's structured-output masks apply (not to the draft's proposals)."""
        st = self.state
        r = st.gather_index(slots)
        return RowState(r, st.seq_len[r], st.anchor[r], st.sampling.rows(r, grammar) if sampling else None)

    # -- prefill ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, lens: torch.Tensor,
                mode: SamplingMode) -> torch.Tensor:
        """Run a chunk of prompts ``ids [B, T]`` (first ``lens[b]`` real) from position ``start[b]``,
        inject the draft context for it, and pick each row's next token, which becomes the anchor.
        Returns the picked tokens ``[B]`` (meaningful after a row's last chunk)."""
        logits = self.prefill_logits(ids, slots, start, lens)
        return self.prefill_pick(logits, slots, start + lens, mode)[0]

    @torch.no_grad()
    def prefill_logits(self, ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                       lens: torch.Tensor, every_position: bool = False) -> torch.Tensor:
        """The chunk's forward: target caches and conv states written, draft context injected;
        returns the logits ``[B, V]`` of each row's last real token (``every_position``: ``[B, T, V]``,
        for prompt logprobs). Kernels only, no host sync and no per-slot state read: what
        graphs/prefill.py captures per bucket shape (rows with slot ``-1`` write nothing)."""
        out = self.target(ids, self.tcache, slots, start, lens, ForwardMode.PREFILL, aux_layer_ids=self.taps,
                          logits_index=None if every_position else (lens - 1).clamp(min=0))
        if self.draft is not None:
            with exact_scope(False):     # the draft runs the default routes in exact mode too (ops/routing.py)
                self.draft.inject_context(out.aux, self.dcache, slots, start, lens)
        return out.logits

    @torch.no_grad()
    def prefill_pick(self, logits: torch.Tensor, slots: torch.Tensor, end: torch.Tensor,
                     mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick each row's next token from its last prompt logits ``[B, V]`` (``end[b]`` tokens now in
        the cache), store it as the row's anchor and ``end`` as its committed length. Returns the
        tokens ``[B]`` and their scores ``[B, V]`` (as :attr:`StepOutput.scores`)."""
        st = self.state
        w = st.scatter_index(slots)
        scores = logits
        if mode.sampling:                 # the greedy argmax reads the logits as they are (exact in fp32)
            rows = st.sampling.rows(st.gather_index(slots))
            p = rows.filtered(logits.float(), end, None, mode)
            token = p.sample(draw_key(rows.seed, end, STREAM_TOKEN))
            st.sampling.record(w, token[:, None])
            if self.logprobs_mode == "processed":
                scores = p.scores()
        else:
            token = argmax_last(logits)
        st.seq_len[w] = end
        st.anchor[w] = token
        return token, scores

    # -- target-only decode -----------------------------------------------------------------
    @torch.no_grad()
    def decode(self, slots: torch.Tensor, mode: SamplingMode) -> StepOutput:
        caches = self.tcache.layer_caches(self.target.config)
        fwd = self.decode_head(slots, caches[0])
        fwd = self.target.advance(fwd, caches[1:], ForwardMode.DECODE, self.later_target_layers)
        return self.finish_decode(fwd.h, fwd.delta, slots, mode)

    @region()
    def decode_head(self, slots: torch.Tensor, first_cache: LayerCache) -> PartialForward:
        """The step up to its second layer: the rows' anchors and lengths, the embedding, the
        window's lens and the first layer (with its cache slices ``first_cache``)."""
        row = self.read_rows(slots)
        fwd = self.target.begin(row.x0[:, None], self.tcache.rope, slots, row.s, torch.ones_like(row.s))
        return self.target.advance(fwd, [first_cache], ForwardMode.DECODE, self.target.model.layers[:1])

    @region()
    def finish_decode(self, h: torch.Tensor, delta: torch.Tensor, slots: torch.Tensor, mode: SamplingMode
                      ) -> StepOutput:
        """Final norm of ``h + delta`` (the last layer's output, see ``Lfm2ForCausalLM.hidden_states``),
        LM head, pick the next token, advance the rows' state."""
        st, row = self.state, self.read_rows(slots, mode.sampling)
        logits = self.target.compute_logits(h[:, 0], delta[:, 0])
        scores = logits
        w = st.scatter_index(slots)
        if mode.sampling:
            p = row.rows.filtered(logits.float(), row.s + 1, None, mode)
            nxt = p.sample(draw_key(row.rows.seed, row.s + 1, STREAM_TOKEN))
            st.sampling.record(w, nxt[:, None])
            if self.logprobs_mode == "processed":
                scores = p.scores()
        else:
            nxt = argmax_last(logits)
        st.seq_len[w] = row.s + 1
        st.anchor[w] = nxt
        return StepOutput(tokens=nxt[:, None], n_new=torch.ones_like(row.s), scores=scores[:, None],
                          confidence=logits.new_empty(logits.shape[0], 0, dtype=torch.float32))

    # -- speculative round ------------------------------------------------------------------
    @torch.no_grad()
    def spec_round(self, slots: torch.Tensor, mode: SamplingMode, width: int | None = None) -> StepOutput:
        """One round verifying ``width`` columns (default: the whole block, ``gamma + 1``)."""
        inputs = self.round_inputs(slots, mode, width)
        drafted = self.round_draft(inputs)
        verified = self.round_verify(inputs, drafted.window)
        return self.round_commit(inputs, drafted, verified)

    # The round's phases are separate methods so the benchmark can time them one by one.
    def round_inputs(self, slots: torch.Tensor, mode: SamplingMode, width: int | None = None) -> RoundInputs:
        width = self.gamma + 1 if width is None else width
        if not 1 <= width <= self.gamma + 1:
            raise ValueError(f"verify width {width} outside 1..{self.gamma + 1}")
        return RoundInputs(slots, mode, self.columns[:width])

    def round_draft(self, inp: RoundInputs) -> Drafted:
        """``width - 1`` proposals; slot k predicts position s + k + 1. Sampling keeps each slot's
        distribution q, the exact one its token was drawn from (:meth:`finish_draft`). A round of
        width 1 drafts nothing.
        The draft's layers run the whole block at every width (its attention is bidirectional, so a
        slot's state depends on every slot), its head and walk the verified slots only (:meth:`finish_draft`)."""
        if inp.width == 1:
            return Drafted(None, None)
        draft, cache = self.draft, self.dcache
        caches = cache.layer_caches()
        with exact_scope(False):         # the draft: default routes (ops/routing.py)
            x, delta, s, lens = self.draft_head(inp.slots, caches[0])
            x, delta = draft.run_layers(x, delta, caches[1:], cache.rope, inp.slots, s, lens,
                                        self.later_draft_layers, first=1)
            return self.finish_draft(inp, x, delta)

    @region(draft=True)
    def draft_head(self, slots: torch.Tensor, first_cache: LayerCache
                   ) -> tuple[torch.Tensor, Pending, torch.Tensor, torch.Tensor]:
        """The draft up to its second layer: the block's embeddings and lens, and its first layer.
        Returns ``(x, delta, s, lens)``, what the later layers take (each reads its RoPE rows itself:
        on the fused path none does, so nothing gathers them)."""
        row = self.read_rows(slots)
        x, lens = self.draft.block_begin(row.x0, row.s)
        x, delta = self.draft.run_layers(x, None, [first_cache], self.dcache.rope, slots, row.s, lens,
                                         self.draft.layers[:1])
        return x, delta, row.s, lens

    @region(draft=True, window={"inp.columns": 0})
    def finish_draft(self, inp: RoundInputs, x: torch.Tensor, delta: Pending) -> Drafted:
        """Final norm, LM head, the Markov walk and the confidences over the first ``g = width - 1`` of
        the block's hidden states ``x + delta`` (models/dspark.py ``block_prefix``): what the round
        verifies. The walk is left to right, so its first ``g`` tokens are the whole block's first ``g``
        (the sampled walk's draws too: each slot's key is its position's).

        A sampling round's draft draws slot ``k`` from its own tempered distribution
        ``q = softmax(logits / T)`` at the row's temperature (the DSpark reference's q): the Gumbel
        draws ``T * g`` of the slot's key, added to the logits, turn the greedy walk into that
        draw, one fused launch for the block. q is not the request's transformed, filtered
        distribution (that would take a transform, a threshold search and a draw per slot):
        rejection sampling is exact for any q the tokens are drawn from (docs/design.md, "The
        draft's distribution")."""
        g = inp.width - 1
        x, delta = self.draft.block_prefix(x, delta, g)
        row = self.read_rows(inp.slots, inp.mode.sampling, grammar=False)
        rows, s = row.rows, row.s
        noise = None
        if rows is not None:
            keys = draw_key(rows.seed[:, None], s[:, None] + 1 + inp.columns[None, :g], STREAM_DRAFT)   # [B, g]
            noise = rows.temperature[:, None, None] * gumbel(keys, rows.bias.shape[-1])    # greedy rows: T = 0
        proposal = self.draft.head_and_walk(x, delta, row.x0, noise, self.markov_walk, self.count_walk_passes,
                                            self.want_confidence and self.imposed is None, logits=rows is not None)
        q = None
        if rows is not None:
            V = proposal.logits.shape[-1]
            q = Filtered.tempered(proposal.logits.reshape(-1, V), rows.temperature.repeat_interleave(g),
                                  proposal.tokens.reshape(-1))
        confidence = proposal.confidence
        if confidence is not None:       # [B, g]: the slots past g have none
            confidence = torch.nn.functional.pad(confidence, (0, self.gamma - g), value=float("nan"))
        if self.want_confidence and self.imposed is not None:   # imposed rates impose the confidences too
            confidence = self.imposed[None, :].expand(proposal.tokens.shape[0], -1)
        window = torch.cat([row.x0[:, None], proposal.tokens], dim=1)
        return Drafted(window, q, confidence)

    def round_verify(self, inp: RoundInputs, window: torch.Tensor | None) -> Verified:
        """Target over the ``window`` [x0, d_1..d_{W-1}] (:attr:`Drafted.window`; None at width 1: [x0])
        at s..s+W-1 (conv tape recorded, K/V written);
        column i predicts position s + i + 1. The draft context injection forks to the side stream
        as soon as every aux tap exists, before the layers after the last tapped one
        (:meth:`fork_injection`; :meth:`round_commit` joins it)."""
        caches = self.tcache.layer_caches(self.target.config)
        fwd = self.verify_head(inp, window, caches[0])
        injected = False
        for layer, cache in zip(self.later_target_layers, caches[1:]):
            if not injected and (taps := self.target.taps_ready(fwd)) is not None:
                self.fork_injection(taps, fwd.rows)
                injected = True
            fwd = self.target.advance(fwd, [cache], verify_mode(inp.width), [layer])
        return Verified(fwd.h, fwd.delta, self.target.aux_taps(fwd), fwd.rows, injected)

    @region(draft=True, window={"window": 1})
    def verify_head(self, inp: RoundInputs, window: torch.Tensor | None, first_cache: LayerCache
                    ) -> PartialForward:
        """The verify up to its second layer: the window ``[x0, d_1..d_{W-1}]``'s embeddings and lens,
        and the first layer (``window`` None: the width-1 round's ``[x0]``, in DECODE mode)."""
        row = self.read_rows(inp.slots)
        mode = ForwardMode.DECODE if window is None else ForwardMode.VERIFY     # as verify_mode(width)
        tokens = row.x0[:, None] if window is None else window
        fwd = self.target.begin(tokens, self.tcache.rope, inp.slots, row.s, None, self.taps)
        return self.target.advance(fwd, [first_cache], mode, self.target.model.layers[:1])

    def round_commit(self, inp: RoundInputs, drafted: Drafted, verified: Verified) -> StepOutput:
        """The round's last phase: :meth:`round_accept_commit` beside the draft context injection
        (:meth:`round_inject`) on :attr:`side_stream`, which the verify forked (:meth:`round_verify`),
        or, where its taps only exist after the last layer (taps of the layer before the last, on
        a path that hands on a pending delta), this forks; then joins it. Uncompiled glue: it
        launches no kernel itself.

        Why: on one stream, the commit region's kernels after the verify's last layer run one after
        the other: the LM head (~64 us at batch 1: docs/benchmarks.md, "Kernels"), argmax,
        acceptance, conv commit, then the injection (cat, ``fc``, norm, ``kv_proj``, K/V write:
        ~28 us), which needs the accepted length only to mask its write. Written for all
        ``gamma + 1`` columns it needs nothing from the acceptance, so it runs beside it, and from
        the verify's last tapped layer on (layer 13 of 16 at the served shape) beside the remaining
        layers too, whose launches fill the SMs for a few microseconds each (beside the LM head
        alone, whose 512 programs hold every SM, it would be starved). Same kernels on the same
        inputs, so the same values; the extra columns sit at positions ``>= s' = s + a + 1``, the
        new committed length, which the draft never reads as context: the next block attends to
        ``[0, s' + gamma)`` (non-causal) after each draft layer has written its own K/V at
        ``s' .. s' + gamma - 1``, and the next round's injection rewrites them from ``s'`` on.

        Capture: the side stream forks from the current stream (the capture stream under
        graphs/capture.py) and joins back before the round returns, so a captured round records a
        fork and a join, and no kernel of the next round can overlap the injection. The tensors the
        side stream reads (``verified``'s aux taps and rows, allocated on the current stream) stay
        referenced here until after the join, so the allocator cannot hand their memory to a
        current-stream allocation while the injection still reads it.

        Split-K (ops/linear/skinny_linear.py): the injection's ``fc`` product is split-K (10 x 10240 ->
        2048 at the LFM2.5-1.2B shape: 4 splits), and products beside it may be too (a vocabulary under
        ~8.4k tokens splits the LM head, an ``LFMSPARK_TUNE`` ``tile.split_k`` any product).
        Concurrent split-K launches must not share arrival counters, so the side stream's take their
        own set (``skinny_linear(..., side_stream=True)``); exact mode's products (counter set 2) run on
        the main stream only (the injection leaves exact mode), the other kernels use no counters, and
        launches within each stream stay ordered by the PDL contract, as on one stream."""
        if not verified.injected:
            self.fork_injection(verified.aux, verified.rows)
        out = self.round_accept_commit(inp, drafted, verified)
        self.join_injection()
        return out

    def fork_injection(self, aux: tuple[torch.Tensor, ...], rows: Rows) -> None:
        """Launch :meth:`round_inject` on :attr:`side_stream`, forked from the current stream (in
        program order where there is none: CPU). The caller keeps ``aux`` and ``rows`` referenced
        until :meth:`join_injection` (they are the verify's tensors, allocated on the current
        stream: the allocator must not hand their memory to another allocation while the side
        stream reads them). The products there run as side-stream launches (their own split-K
        counters, at most ``SIDE_STREAM_STAGES`` pipeline stages so that their programs fit beside
        the main stream's in shared memory: ops/linear/skinny_linear.py)."""
        side = self.side_stream
        if side is None:
            with exact_scope(False):     # the draft: default routes (ops/routing.py)
                self.round_inject(aux, rows, side_stream=False)
            return
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side), exact_scope(False):
            self.round_inject(aux, rows, side_stream=True)
        self._injection_pending = True

    def join_injection(self) -> None:
        """Make the current stream wait for a forked injection (nothing when none is pending)."""
        if self._injection_pending:
            torch.cuda.current_stream(self.side_stream.device).wait_stream(self.side_stream)
            self._injection_pending = False

    @region(draft=True, window={"aux": 1})
    def round_inject(self, aux: tuple[torch.Tensor, ...], rows: Rows, side_stream: bool) -> None:
        """The draft context K/V of the verify's whole window ``[x0, d_1..d_gamma]`` at ``s .. s + gamma``
        from its aux taps (see :meth:`round_commit`): positions past the accepted ones are written
        too, and never read. Takes the window's rows from the verify, not from the slot state, whose
        committed length the concurrent :meth:`round_accept_commit` advances."""
        self.draft.inject_context(torch.cat(aux, dim=-1), self.dcache, rows.slots, rows.start, rows.lens, side_stream)

    @region(draft=True, window={"inp.columns": 0, "drafted.window": 1, "drafted.q": 0, "verified.hidden": 1,
                                "verified.delta": 1})
    def round_accept_commit(self, inp: RoundInputs, drafted: Drafted, verified: Verified) -> StepOutput:
        """Accept a drafts, draw the correction / bonus token at position s + a + 1, commit
        x0, d_1..d_a (the conv state from the tape; the draft context is :meth:`round_inject`'s).

        The round verified ``g = width - 1`` drafts, and a row accepts at most its ``draft_limit``
        (``SamplingParams.max_speculative_tokens``) of them. A row that accepted all it could
        (``a == min(g, limit)``) takes its next token from ``p`` at that position (the bonus), as a
        row does after a whole block: the drafts after it were never offered, not rejected."""
        st, gamma, g = self.state, self.gamma, inp.width - 1
        row = self.read_rows(inp.slots, inp.mode.sampling)
        rows, s = row.rows, row.s
        B, W = inp.slots.shape[0], g + 1
        d = drafted.tokens if g else s.new_zeros(B, 0)
        d_ext = torch.cat([d, row.x0[:, None]], dim=1)                         # a token id for the bonus column too
        cols = inp.columns[None, :]                                            # [1, W]: 0 .. g
        positions = s[:, None] + cols[:, 1:]                                   # of d_1..d_g
        if rows is None:   # [B, W], no fp32 copy
            logits, target_pick = self.target.compute_greedy(verified.hidden, verified.delta)
            scores = logits
            accepted = d == target_pick[:, :-1]
        else:
            logits = self.target.compute_logits(verified.hidden, verified.delta)
            window = s[:, None] + cols + 1                                     # predicted positions
            p = rows.filtered(logits.float(), window, block_history(d, logits.shape[-1]), inp.mode)   # B * W rows
            scores = p.scores().view(B, W, -1) if self.logprobs_mode == "processed" else logits
            accepted = torch.zeros_like(d, dtype=torch.bool)
            if g:
                q = drafted.q                                                  # B * g rows
                p_d = p.prob(d_ext.reshape(-1, 1)).view(B, W)[:, :g]
                q_d = q.prob(d.reshape(-1, 1)).view(B, g)
                u = uniform(draw_key(rows.seed[:, None], positions, STREAM_ACCEPT))
                accepted = u * q_d < p_d                                       # u < min(1, p/q)
        if self.imposed is not None:      # benchmark mode: accept lengths from the imposed rates
            seed = st.sampling.seed[row.index]
            accepted = uniform(draw_key(seed[:, None], positions, STREAM_IMPOSED)) < self.imposed[None, :g]
        limit = st.draft_limit[row.index].clamp(max=g)                         # [B] drafts each row may accept
        accepted = accepted & (cols[:, :g] < limit[:, None])
        a = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)                 # [B] in 0..limit
        if rows is None:
            final = target_pick.gather(1, a[:, None])[:, 0]
        else:
            b = torch.arange(B, device=s.device)
            p_a = p.rows(b * W + a)                                            # position s + a + 1's p
            residual = p_a.probs()
            if g:
                offered = (a < limit)[:, None]                                 # d_{a+1} was offered and rejected
                q_a = drafted.q.rows(b * g + a.clamp(max=g - 1)).probs() * offered
                residual = (residual - q_a).clamp(min=0)
                # where q covers p (within rounding), the residual is p itself
                residual = torch.where(residual.sum(-1, keepdim=True) > 1e-8, residual, p_a.probs())
            final = sample(residual, draw_key(rows.seed, s + a + 1, STREAM_TOKEN))

        commit = a + 1
        if g:      # width 1 ran as a decode step: its conv states are already the committed ones
            self.target.commit(self.tcache, inp.slots, commit)
        w = st.scatter_index(inp.slots)
        st.seq_len[w] = s + commit
        st.anchor[w] = final

        tokens = torch.where(cols < a[:, None], d_ext, final[:, None])         # [d_1..d_a, final, ...]
        if rows is not None:
            st.sampling.record(w, tokens, cols < commit[:, None])
        confidence = drafted.confidence
        if confidence is None:
            confidence = torch.full((B, gamma), float("nan"), device=s.device)
        return StepOutput(tokens=tokens, n_new=commit, scores=scores, confidence=confidence)
