"""Device state the models read and write: paged target KV + conv state + verify tape, paged draft context KV.

**Pages.** The attention layers' K/V (the target's and the draft's context) live in fixed-size pages
of ``page_size`` positions: ``k, v [layers, n_pages + 1, page_size, n_kv, head_dim]``. A slot's
positions map to pages through one ``page_table [n_slots, max_pages]`` (int32, shared by the target
and the draft: both keep one K/V row per position): position ``p`` of slot ``s`` is at page
``page_table[s, p // page_size]``, offset ``p % page_size``. The last physical page (index
``n_pages``) is the **trash page**: table entries no request owns point at it, so a write a round
makes past its slot's pages (the pipelined round a finished request rides along in) lands there and
nowhere else. Which pages a slot holds is the host's business (runtime/pages.py); the table is a
device tensor the kernels read by address, so a CUDA graph replays whatever it maps.

Without a page pool (``n_pages=None``) each slot owns ``max_pages`` consecutive pages, the table is
the identity: the layout of one dense ``[slots, max_seq_len]`` cache per layer, which tests and the
model-level code use.

Allocated once per engine with fixed ``n_slots`` (= max batch), ``max_seq_len`` and verify width,
so every tensor keeps its address for CUDA graph replay. Rows of a batch address slots through a
``slots`` index tensor; the verify tape is indexed by batch row instead. Caches start zeroed
(finite values everywhere, so attention over never-written positions of a padding row cannot
produce NaN). The RoPE cos/sin tables live here too: they are sized by ``max_seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.attention.rope import rope_cos_sin_table
from .config import ATTENTION, DraftConfig, TargetConfig

DEFAULT_PAGE_SIZE = 16   # vLLM's; a key block of the attention (64 or 128 keys) reads several pages

# one decoder layer's share of the cache, one-layer slices: (k, v, page_table) for attention,
# (conv_state, conv_tape) for ShortConv
LayerCache = tuple[torch.Tensor, ...]


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold ``positions`` positions."""
    return -(-positions // page_size)


def make_page_table(n_slots: int, max_pages: int, n_pages: int | None, device: torch.device | str) -> torch.Tensor:
    """The table of a fresh cache: the identity layout without a pool (``n_pages=None``: slot ``s``
    owns pages ``s * max_pages ..``), else every entry on the trash page ``n_pages``."""
    if n_pages is None:
        return torch.arange(n_slots * max_pages, dtype=torch.int32, device=device).view(n_slots, max_pages)
    return torch.full((n_slots, max_pages), n_pages, dtype=torch.int32, device=device)


def _kv_pages(layers: int, n_pages: int, page_size: int, n_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (layers, n_pages + 1, page_size, n_kv, head_dim)   # + the trash page
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


class _PagedKV:
    """What the target's and the draft's caches share: reading, writing and copying positions
    through the page table (host-side helpers for the prefix cache, tests and ``n > 1`` prompts;
    the models go through the ops)."""

    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_seq_len(self) -> int:
        """Positions a slot's table can map."""
        return self.page_table.shape[1] * self.page_size

    def gather(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v) [layers, length, n_kv, head_dim]``: slot ``slot``'s positions ``< length``."""
        pages = self.page_table[slot, :pages_for(length, self.page_size)].long()
        return (self.k[:, pages].flatten(1, 2)[:, :length], self.v[:, pages].flatten(1, 2)[:, :length])

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Physical pages ``dst`` get the contents of pages ``src`` (int64 index tensors)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


@dataclass
class TargetCache(_PagedKV):
    k: torch.Tensor            # [n_attn_layers, n_pages + 1, page_size, n_kv, head_dim]
    v: torch.Tensor
    page_table: torch.Tensor   # [n_slots, max_pages] int32
    conv_state: torch.Tensor   # [n_conv_layers, n_slots, L_cache - 1, hidden]
    conv_tape: torch.Tensor    # [n_conv_layers, n_rows, verify_width + L_cache - 1, hidden]
    rope: torch.Tensor         # [max_seq_len, head_dim] fp32 (cos | sin)

    @classmethod
    def allocate(cls, cfg: TargetConfig, n_slots: int, max_seq_len: int, verify_width: int,
                 dtype: torch.dtype, device: torch.device | str, *, page_size: int = DEFAULT_PAGE_SIZE,
                 n_pages: int | None = None) -> "TargetCache":
        """``n_pages``: the pool's pages (None: ``max_seq_len`` per slot, the identity table)."""
        n_attn, n_conv = len(cfg.attention_layers), len(cfg.conv_layers)
        max_pages = pages_for(max_seq_len, page_size)
        table = make_page_table(n_slots, max_pages, n_pages, device)
        k, v = _kv_pages(n_attn, n_slots * max_pages if n_pages is None else n_pages, page_size,
                         cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        km1 = cfg.conv_L_cache - 1
        return cls(
            k=k, v=v, page_table=table,
            conv_state=torch.zeros((n_conv, n_slots, km1, cfg.hidden_size), dtype=dtype, device=device),
            conv_tape=torch.zeros((n_conv, n_slots, verify_width + km1, cfg.hidden_size), dtype=dtype,
                                  device=device),
            rope=rope_cos_sin_table(max_seq_len, cfg.head_dim, cfg.rope_theta, device=device),
        )

    def layer_caches(self, cfg: TargetConfig) -> list[LayerCache]:
        """Each decoder layer's one-layer slices (``[1, ...]`` views, addressed as layer 0 by the ops).

        Slicing outside the layer is what lets one compiled graph serve every layer of a kind: the
        layer sees its cache as a plain input instead of indexing by a constant it would specialise on.
        """
        out, n_attn, n_conv = [], 0, 0
        for kind in cfg.layer_types:
            if kind == ATTENTION:
                out.append((self.k[n_attn:n_attn + 1], self.v[n_attn:n_attn + 1], self.page_table))
                n_attn += 1
            else:
                out.append((self.conv_state[n_conv:n_conv + 1], self.conv_tape[n_conv:n_conv + 1]))
                n_conv += 1
        return out


@dataclass
class DraftCache(_PagedKV):
    k: torch.Tensor            # [n_draft_layers, n_pages + 1, page_size, n_kv, head_dim]
    v: torch.Tensor
    page_table: torch.Tensor   # the target cache's table (same tensor)
    rope: torch.Tensor         # [max_seq_len, head_dim] fp32

    @classmethod
    def allocate(cls, cfg: DraftConfig, n_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, *, page_size: int = DEFAULT_PAGE_SIZE, n_pages: int | None = None,
                 page_table: torch.Tensor | None = None) -> "DraftCache":
        """``page_table``: the target cache's, whose pages this cache mirrors (None: a table of its own,
        as :meth:`TargetCache.allocate` makes it)."""
        max_pages = pages_for(max_seq_len, page_size)
        if page_table is None:
            page_table = make_page_table(n_slots, max_pages, n_pages, device)
        k, v = _kv_pages(cfg.num_hidden_layers, n_slots * max_pages if n_pages is None else n_pages, page_size,
                         cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        return cls(k=k, v=v, page_table=page_table,
                   rope=rope_cos_sin_table(max_seq_len, cfg.head_dim, cfg.rope_theta, device=device))

    def layer_caches(self) -> list[LayerCache]:
        """Each layer's one-layer K/V slices ``[1, ...]`` and the page table (as :meth:`TargetCache.layer_caches`)."""
        return [(self.k[i:i + 1], self.v[i:i + 1], self.page_table) for i in range(self.k.shape[0])]
