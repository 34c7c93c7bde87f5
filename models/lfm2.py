"""LFM2 target: gated short convolutions + GQA attention (HF ``Lfm2ForCausalLM`` semantics).

The module is compile-friendly: no Python branching on tensor values and no host syncs in
``forward``. Every forward works on a batch of rows, each owning a state slot (DESIGN §4):

- ``PREFILL``: up to ``T`` tokens per row at positions ``start[b] ..``; only the first ``lens[b]`` are
  real (ragged prompts, right-padded). Resumable: a second chunk continues from the stored state
  (a row with ``start == 0`` starts from an empty conv state).
- ``DECODE``: one token per row (``T == 1``).
- ``VERIFY``: ``W`` tokens per row continuing from the committed state. Attention layers write K/V
  for all ``W`` tokens; ShortConv layers leave the conv state alone and record a tape, from which
  :meth:`Lfm2ForCausalLM.commit` restores the state after any accepted length ``1..W``.

Any mode can return the aux hidden states of ``aux_layer_ids`` (HF "output of decoder layer k",
``-1`` = the embeddings) concatenated as ``[B, T, n_taps * H]``, which feed the DSpark draft.

A forward is three pieces that the runtime can also call one by one (runtime/steps.py):
:meth:`Lfm2ForCausalLM.begin` (the glue before the first layer: embedding lookup, the window's
``lens``), :meth:`Lfm2ForCausalLM.advance` (the next
decoder layers, collecting aux taps) and :meth:`Lfm2ForCausalLM.aux_taps`. The decode step and the
verify compile ``begin`` together with the first layer as one region, so that glue runs inside a
compiled graph instead of as loose kernels between graphs (graphs/compile.py).

Residual carry: a decoder layer does not finish with its residual add. It returns its
feed-forward output as a pending ``delta`` and the next layer starts with ``h = h + delta``, the
same bf16 add as HF's, so each layer's compiled graph (graphs/compile.py) fuses that add into its
first RMSNorm; at the end of a layer it would be a kernel of its own, between a GEMM without an
epilogue and a region boundary. The last layer's delta is added by the consumer, which fuses it
into the final norm (:meth:`Lfm2ForCausalLM.compute_logits`). Results are bit-identical to adding
at the end of each layer, eager and compiled (graphs/compile.py keeps the bf16 rounding of the sum
that Inductor would elide).

Where the products, norms and attention windows run is ops/routing.py's choice, applied in
models/layers.py: at one-row decode on CUDA each add + RMSNorm + projection is one
``lfmspark::add_rmsnorm_gemv`` (the layer's pending add with ``operator_norm`` and ``in_proj`` /
``qkv_proj``, the mid-layer add with ``ffn_norm`` and a dense SwiGLU's gate/up product, the last add
with the final norm and the LM head); on 2-16 rows outside decode (the batch-1 verify, short prompt
chunks) the norms ride in the products' epilogues, and a VERIFY forward hands each layer's output on
as a ``NormedCarry`` that the next layer's first product (or the LM head) finishes. That kernel
normalises the sum *after* its rounding to the activation dtype, as HF eager does.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.routing import exact_mode, window_attention
from .cache import LayerCache, TargetCache
from .config import ATTENTION, TargetConfig
from ..ops.argmax_rows import argmax_last
from .layers import Linear, NormedCarry, Pending, RMSNorm, SwiGLU, completed, norm_linear, project_norm_feed_forward

lfm = torch.ops.lfmspark


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class Rows:
    """Index tensors of one forward, all ``[B]`` int64 on the model's device."""

    slots: torch.Tensor    # state slot per row, -1 = padding row
    start: torch.Tensor    # absolute position of column 0 (= committed tokens before this window)
    lens: torch.Tensor     # real tokens per row in this window


@dataclass
class PartialForward:
    """A forward between two decoder layers: what :meth:`Lfm2ForCausalLM.begin` sets up and each
    :meth:`Lfm2ForCausalLM.advance` carries on (updated in place)."""

    h: torch.Tensor                       # [B, T, H] residual stream (the embeddings before layer 0)
    delta: Pending                        # the last layer's pending output (models/layers.py; None before layer 0)
    rows: Rows
    rope: torch.Tensor                    # [P, head_dim] the cache's cos/sin table (fp32), read at rows.start + t
    aux_layer_ids: tuple[int, ...]
    taps: dict[int, torch.Tensor | None]  # aux layer id -> that layer's output, once a later layer has run
    done: int = 0                         # decoder layers run so far


@dataclass
class TargetOutput:
    logits: torch.Tensor              # [B, T, V], or [B, V] when logits_index is given
    aux: torch.Tensor | None          # [B, T, n_taps * H] or None


class Lfm2Attention(nn.Module):
    """GQA attention: fused qkv projection, per-head q/k RMSNorm, neox RoPE, paged KV cache (models/cache.py)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim)
        self.out_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size)
        self.q_layernorm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, kv: LayerCache, rows: Rows, rope: torch.Tensor) -> torch.Tensor:
        """Attention over the normalised input ``x [B, T, H]``: ``qkv_proj``, :meth:`attend`, ``out_proj``."""
        return self.out_proj(self.attend(self.qkv_proj(x), kv, rows, rope))

    def attend(self, qkv: torch.Tensor, kv: LayerCache, rows: Rows, rope: torch.Tensor) -> torch.Tensor:
        """The block between its projections: from ``qkv [B, T, (n_heads + 2 n_kv) * head_dim]``, which
        the decoder layer computes (fused with its norm on the one-row decode path), to the heads'
        outputs ``[B, T, n_heads * head_dim]``, whose ``out_proj`` the layer runs (with the residual
        add and the next norm on the several-row route).

        One ``lfmspark::qkv_norm_rope_write`` launch takes q and k through their per-head RMSNorm
        (these modules' weights) and neox RoPE at ``rows.start + t`` (the cache's fp32 table, one
        rounding; HF rounds cos/sin to the activation dtype first, a difference within bf16 noise),
        writes K and V of the first ``rows.lens`` tokens to the cache and returns the queries: three
        launches before (Inductor's q and k kernels and the K/V write). Windows of at most one
        attention row tile (decode, verify; ops/routing.py ``window_attention``) fold that launch
        into the attention's: ``lfmspark::qkv_window_attention`` (ops/attention/window_attention.py)."""
        B, T, _ = qkv.shape
        k_cache, v_cache, page_table = kv
        if window_attention(T, self.n_heads, self.n_kv):
            o = lfm.qkv_window_attention(qkv, self.q_layernorm.weight, self.k_layernorm.weight, rope, k_cache,
                                         v_cache, page_table, 0, rows.slots, rows.start, rows.lens, self.q_layernorm.eps, True,
                                         True, self.scale)
            return o.reshape(B, T, self.n_heads * self.head_dim)
        q = lfm.qkv_norm_rope_write(qkv, self.q_layernorm.weight, self.k_layernorm.weight, rope, k_cache, v_cache,
                                    page_table, 0, rows.slots, rows.start, rows.lens, self.q_layernorm.eps, True)
        o = lfm.cache_attention(q, k_cache, v_cache, page_table, 0, rows.slots, rows.start, True, self.scale, exact_mode())
        return o.reshape(B, T, self.n_heads * self.head_dim)


@dataclass
class ConvSnapshots:
    """Where a PREFILL forward copies the conv state after each multiple of ``every`` its rows pass
    (the prefix cache's snapshots, runtime/prefix_cache.py), beside the state after the chunk's last
    token that the op keeps.

    Row ``b`` of a forward at ``start[b]`` passes the multiples ``p_j = (start[b] // every + 1 + j) *
    every`` for ``j = 0, 1, ...``; the state after ``p_j`` (the gated inputs ``Bx`` at positions ``p_j -
    K + 1 .. p_j - 1``) goes to row ``index[b, j]`` of ``store``, the last row of which is scratch: the
    destination of every snapshot nobody wants (a multiple past the row's end, a padding row, a
    page already cached). ``index`` is a fixed buffer the runner fills before each forward, so a
    captured prefill graph reads whatever it holds at replay."""

    store: torch.Tensor     # [n_conv_layers, rows + 1, K - 1, H]; row ``rows``: scratch
    index: torch.Tensor     # [max_rows, max_per_row] int64 (the widest forward passes at most max_per_row multiples)
    every: int

    @property
    def scratch(self) -> int:
        return self.store.shape[1] - 1

    def per_row(self, width: int) -> int:
        """The multiples a row of ``width`` tokens can pass (at most ``ceil(width / every)``), capped at
        what ``index`` holds."""
        return min(-(-width // self.every), self.index.shape[1])


class Lfm2ShortConv(nn.Module):
    """Double-gated short convolution: ``out_proj(C * conv(B * x))`` with ``[B | C | x] = in_proj(h)``."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        H = cfg.hidden_size
        self.in_proj = Linear(H, 3 * H)
        self.conv_weight = nn.Parameter(torch.empty(H, cfg.conv_L_cache))   # HF conv.conv.weight squeezed
        self.out_proj = Linear(H, H)
        # (where PREFILL forwards copy snapshots of the state, this layer's index into its store) or None
        self.snapshots: tuple[ConvSnapshots, int] | None = None

    def forward(self, x: torch.Tensor, state_tape: LayerCache, rows: Rows, mode: ForwardMode) -> torch.Tensor:
        """The block over the normalised input ``x [B, T, H]``: ``in_proj``, :meth:`mix`, ``out_proj``."""
        return self.out_proj(self.mix(self.in_proj(x), state_tape, rows, mode))

    def mix(self, bcx: torch.Tensor, state_tape: LayerCache, rows: Rows, mode: ForwardMode) -> torch.Tensor:
        """The block between its projections: from ``in_proj``'s output ``bcx = [B | C | x]`` ``[B, T,
        3H]``, which the decoder layer computes (fused with its norm on the one-row decode path), to
        the gated convolution ``[B, T, H]``, whose ``out_proj`` the layer runs."""
        # the ops take the whole in_proj output and apply both gates in the conv kernel
        conv_state, conv_tape = state_tape
        if mode is ForwardMode.VERIFY:
            # a block narrower than the allocated tape width records into its first W + K - 1 columns
            y = lfm.short_conv_verify(bcx, self.conv_weight, conv_state, conv_tape, 0, rows.slots)
        else:
            if mode is ForwardMode.PREFILL and self.snapshots is not None:
                self.snapshot(bcx, conv_state, rows)        # reads the state before the op replaces it
            y = lfm.short_conv_prefill(bcx, self.conv_weight, conv_state, 0, rows.slots, rows.start, rows.lens)
        return y

    def snapshot(self, bcx: torch.Tensor, conv_state: torch.Tensor, rows: Rows) -> None:
        """Copy the state after each multiple of ``snapshots.every`` inside the rows' chunks into the
        snapshot store (:class:`ConvSnapshots`), from ``bcx`` and the state the chunk starts from
        (``conv_state``, this layer's one-layer slice, read before the op overwrites it).

        The state after position ``p`` is ``x_ext[p - start : p - start + K - 1]`` with ``x_ext = [state ;
        Bx]``, as the op stores it after a chunk's last token; ``Bx = B * x`` is one multiply in
        ``bcx``'s dtype, which is the op's rounding of its fp32 product (ops/short_conv.py), so a
        snapshot at a chunk's end holds the bits the op writes. A few gathers and a multiply over
        ``rows x multiples x (K - 1)`` tokens: no host sync, so a captured prefill graph holds them."""
        sink, layer = self.snapshots
        B, T, H3 = bcx.shape
        S = sink.per_row(T)
        if B * S == 0:
            return
        H, km1, every = H3 // 3, conv_state.shape[2], sink.every
        dev = bcx.device
        start = rows.start[:, None]
        off = (start // every + 1 + torch.arange(S, device=dev)) * every - start       # [B, S] >= 1: p_j - start
        col = off.clamp(max=T)[:, :, None] + torch.arange(-km1, 0, device=dev)        # [B, S, K-1]: bcx column
        b = torch.arange(B, device=dev)[:, None, None]
        tok = bcx[b, col.clamp(min=0)]                                                 # [B, S, K-1, 3H]
        bx = tok[..., :H] * tok[..., 2 * H:]
        init = conv_state[0, rows.slots.clamp(min=0)].to(bcx.dtype)                    # [B, K-1, H]
        init = torch.where((rows.start > 0)[:, None, None], init, torch.zeros_like(init))   # the op's zero start
        from_state = init[b, (col + km1).clamp(min=0, max=km1 - 1)]                    # columns before the chunk
        snap = torch.where((col < 0)[..., None], from_state, bx)
        store = sink.store[layer]
        store.index_put_((sink.index[:B, :S].reshape(-1),), snap.reshape(B * S, km1, H).to(store.dtype))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int, feed_forward: nn.Module):
        super().__init__()
        self.is_attention = cfg.layer_types[layer] == ATTENTION
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if self.is_attention:
            self.self_attn = Lfm2Attention(cfg)
        else:
            self.conv = Lfm2ShortConv(cfg)
        self.feed_forward = feed_forward

    def forward(self, h: torch.Tensor, delta: Pending, layer_cache: LayerCache, rows: Rows, mode: ForwardMode,
                rope: torch.Tensor, next_norm: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, Pending]:
        """The layer over the residual stream ``h`` plus the previous layer's pending feed-forward
        output ``delta`` (None for the first layer, whose ``h`` is the embeddings; see the module doc).

        Returns ``(h_in, h, delta)``: the input after the pending add (= the previous layer's HF
        output, which the aux taps need), the residual stream after the mixer, and this layer's own
        pending feed-forward output; this layer's HF output is ``h + delta``. ``layer_cache``: this
        layer's one-layer slices of the cache, ``(k, v)`` for attention, ``(conv_state, conv_tape)``
        for ShortConv (see :meth:`TargetCache.layer_caches`).

        ``delta is None`` makes the first layer trace differently from the others: under compile
        the runtime runs it inside the step's head region, with the embedding lookup and the rest
        of the glue before it (runtime/steps.py), not as a graph of its own. Handing it a zero
        delta instead would cost a fill kernel (and the add), which is what this interface removes.

        Each add, its RMSNorm and the projection after it go through ``norm_linear`` /
        ``project_norm_feed_forward`` (models/layers.py): the modules one by one, at batch-1 DECODE on
        CUDA one fused kernel (see the module doc), and on 2-16 rows on CUDA the mixer's output
        projection with the residual add and the norm's statistics in its epilogue.

        ``delta`` may also be a ``NormedCarry`` (``h`` is then the previous layer's output), and
        with ``next_norm`` (the weight of the norm after this layer) the layer may return one in
        place of its delta (models/layers.py ``project_norm_feed_forward``)."""
        decode = mode is ForwardMode.DECODE
        if self.is_attention:
            h_in, qkv = norm_linear(h, delta, self.operator_norm, self.self_attn.qkv_proj, decode)
            mixed, out_proj = self.self_attn.attend(qkv, layer_cache, rows, rope), self.self_attn.out_proj
        else:
            h_in, bcx = norm_linear(h, delta, self.operator_norm, self.conv.in_proj, decode)
            mixed, out_proj = self.conv.mix(bcx, layer_cache, rows, mode), self.conv.out_proj
        feed_forward = self.feed_forward
        if getattr(feed_forward, "routing_bias", None) is not None:   # MoE routing locality (models/lfm2_moe.py)
            feed_forward = functools.partial(feed_forward, slots=rows.slots)
        h, pending = project_norm_feed_forward(h_in, mixed, out_proj, self.ffn_norm, feed_forward, decode,
                                               next_norm)
        return h_in, h, pending


class Lfm2Backbone(nn.Module):
    """``model.*`` of the HF checkpoint: embeddings, decoder layers, final norm (``embedding_norm``)."""

    def __init__(self, cfg: TargetConfig, make_feed_forward):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(cfg, i, make_feed_forward(cfg, i))
                                    for i in range(cfg.num_hidden_layers))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


def dense_feed_forward(cfg: TargetConfig, layer: int) -> nn.Module:
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Lfm2ForCausalLM(nn.Module):
    def __init__(self, cfg: TargetConfig, make_feed_forward=dense_feed_forward):
        super().__init__()
        self.config = cfg
        self.model = Lfm2Backbone(cfg, make_feed_forward)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cache: TargetCache, slots: torch.Tensor, start: torch.Tensor,
                lens: torch.Tensor | None = None, mode: ForwardMode = ForwardMode.PREFILL,
                aux_layer_ids: tuple[int, ...] = (), logits_index: torch.Tensor | None = None) -> TargetOutput:
        """Run ``input_ids [B, T]`` at positions ``start[b] + t``.

        ``lens`` (real tokens per row) defaults to all ``T`` columns. ``logits_index [B]`` selects one
        column per row to project (prefill needs only the last real token); otherwise every column
        is projected.
        """
        h, delta, aux = self.hidden_states(input_ids, cache, slots, start, lens, mode, aux_layer_ids)
        if logits_index is not None:
            picked = torch.arange(h.shape[0], device=h.device), logits_index
            if isinstance(delta, NormedCarry):   # its statistics are of every column: dropped (h is complete)
                delta = None
            h, delta = h[picked], None if delta is None else delta[picked]
        return TargetOutput(logits=self.compute_logits(h, delta, decode=mode is ForwardMode.DECODE), aux=aux)

    def hidden_states(self, input_ids: torch.Tensor, cache: TargetCache, slots: torch.Tensor, start: torch.Tensor,
                      lens: torch.Tensor | None = None, mode: ForwardMode = ForwardMode.PREFILL,
                      aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, Pending, torch.Tensor | None]:
        """``(h, delta, aux)``: the last layer's output ``[B, T, H]`` (before the final norm) as its
        residual stream ``h`` and pending part ``delta`` (a feed-forward output, or a ``NormedCarry``
        of the final norm in a VERIFY forward), left unadded so that the
        caller's compiled tail fuses ``h + delta`` into the final norm (see the module doc), and the
        aux taps concatenated. :meth:`begin`, :meth:`advance` over every layer, :meth:`aux_taps`."""
        fwd = self.begin(input_ids, cache.rope, slots, start, lens, aux_layer_ids)
        fwd = self.advance(fwd, cache.layer_caches(self.config), mode, self.model.layers)
        taps = self.aux_taps(fwd)
        return fwd.h, fwd.delta, torch.cat(taps, dim=-1) if taps else None

    def begin(self, input_ids: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
              lens: torch.Tensor | None = None, aux_layer_ids: tuple[int, ...] = ()) -> PartialForward:
        """The forward of ``input_ids [B, T]`` at positions ``start[b] + t`` up to its first layer: the
        embeddings and the rows (``lens`` defaults to all ``T`` columns); the attention layers read
        the RoPE table ``rope`` themselves."""
        B, T = input_ids.shape
        if lens is None:
            lens = torch.full_like(slots, T)
        return PartialForward(h=self.model.embed_tokens(input_ids), delta=None, rows=Rows(slots, start, lens),
                              rope=rope, aux_layer_ids=tuple(aux_layer_ids), taps=dict.fromkeys(aux_layer_ids))

    def advance(self, fwd: PartialForward, layer_caches: Sequence[LayerCache], mode: ForwardMode,
                layers: Sequence[nn.Module]) -> PartialForward:
        """Run the next ``len(layers)`` decoder layers of ``fwd`` (layers ``fwd.done ..``), each with its
        cache slices (:meth:`TargetCache.layer_caches`). ``layers`` are those of ``self.model.layers``,
        or stand-ins for them: the runtime passes compiled wrappers (graphs/compile.py)."""
        for layer, layer_cache in zip(layers, layer_caches, strict=True):
            next_norm = self.next_norm_weight(fwd.done) if mode is ForwardMode.VERIFY else None
            h_in, fwd.h, fwd.delta = layer(fwd.h, fwd.delta, layer_cache, fwd.rows, mode, fwd.rope, next_norm)
            if fwd.done - 1 in fwd.taps:    # layer i's input is layer i - 1's output (the embeddings for i = 0)
                fwd.taps[fwd.done - 1] = h_in
            fwd.done += 1
        return fwd

    def next_norm_weight(self, layer: int) -> torch.Tensor:
        """The weight of the RMSNorm after decoder layer ``layer``: the next layer's ``operator_norm``,
        or the final norm after the last layer. A VERIFY forward hands it to the layer, which may
        start that norm in its last product's epilogue (see the module doc)."""
        layers = self.model.layers
        return layers[layer + 1].operator_norm.weight if layer + 1 < len(layers) else self.model.embedding_norm.weight

    def taps_ready(self, fwd: PartialForward) -> tuple[torch.Tensor, ...] | None:
        """The aux taps of ``fwd`` (``aux_layer_ids`` order) if every one exists as a tensor already,
        with no kernel to run for them; else None. A tapped layer's output is recorded once the next
        layer has run (:meth:`advance`); the latest layer's output is ``fwd.h`` itself when nothing
        is pending to add (``NormedCarry``: the sum was written by its last product's epilogue).
        The runtime forks the draft's context injection at this point (runtime/steps.py
        ``Steps.round_verify``)."""
        taps = []
        for i in fwd.aux_layer_ids:
            if fwd.taps[i] is not None:
                taps.append(fwd.taps[i])
            elif i == fwd.done - 1 and not isinstance(fwd.delta, torch.Tensor):
                taps.append(fwd.h)
            else:
                return None
        return tuple(taps)

    def aux_taps(self, fwd: PartialForward) -> tuple[torch.Tensor, ...]:
        """The aux taps ``[B, T, H]`` of a finished forward, in ``aux_layer_ids`` order. The last layer's
        output is completed here (``h + delta``): no later layer adds it. Drafts never tap it
        (models/dspark.py refuses such drafts), so the runtime's verify never runs this add."""
        last = len(self.model.layers) - 1
        return tuple(completed(fwd.h, fwd.delta) if i == last else fwd.taps[i] for i in fwd.aux_layer_ids)

    def compute_logits(self, h: torch.Tensor, delta: Pending, decode: bool = True) -> torch.Tensor:
        """Logits of the last layer's output ``h + delta`` (see :meth:`hidden_states`; with a
        ``NormedCarry``, of ``h``, the LM head applying the final norm's row scale). ``decode``: a
        single row may run the add, final norm and LM head as one kernel (``norm_linear``; the
        decode step's one-row case); :meth:`forward` passes it for DECODE only."""
        return norm_linear(h, delta, self.model.embedding_norm, self.lm_head, decode)[1]

    def compute_greedy(self, h: torch.Tensor, delta: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, logits.argmax(-1))`` of :meth:`compute_logits` (the verify's greedy picks)."""
        logits = self.compute_logits(h, delta)
        return logits, argmax_last(logits)

    @staticmethod
    def commit(cache: TargetCache, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a VERIFY forward: set every conv state to the window after ``accepted[b]`` block tokens.

        Attention KV needs no undo: positions past the new committed length are never attended and
        are overwritten by the next window.
        """
        lfm.short_conv_commit(cache.conv_state, cache.conv_tape, slots, accepted)

    @contextlib.contextmanager
    def conv_snapshots(self, snapshots: ConvSnapshots | None) -> Iterator[None]:
        """Inside, PREFILL forwards copy conv snapshots into ``snapshots`` (None: nowhere), each
        ShortConv layer into its row of the store, in layer order. Scoped, not set once: engines may
        share one target module, each with its own prefix cache (and a graph captured inside holds
        the store and index it was captured with)."""
        convs = [layer.conv for layer in self.model.layers if not layer.is_attention]
        if snapshots is not None and snapshots.store.shape[0] != len(convs):
            raise ValueError(f"a snapshot store of {snapshots.store.shape[0]} layers for {len(convs)} ShortConv layers")
        before = [conv.snapshots for conv in convs]
        for i, conv in enumerate(convs):
            conv.snapshots = None if snapshots is None else (snapshots, i)
        try:
            yield
        finally:
            for conv, old in zip(convs, before):
                conv.snapshots = old

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype
