"""Device state the models read and write: target KV + conv state + verify tape, draft context KV.

Allocated once per engine (DESIGN §4) with fixed ``n_slots`` (= max batch), ``max_seq_len`` and
verify width, so every tensor keeps its address for CUDA graph replay. Rows of a batch address
slots through a ``slots`` index tensor; the verify tape is indexed by batch row instead.
Caches start zeroed (finite values everywhere, so attention over never-written positions of a
padding row cannot produce NaN). The RoPE cos/sin tables live here too: they are sized by
``max_seq_len``, like the caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.attention.rope import rope_cos_sin_table
from .config import ATTENTION, DraftConfig, TargetConfig

# one decoder layer's share of the cache: (k, v) or (conv_state, conv_tape), each a one-layer slice
LayerCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TargetCache:
    k: torch.Tensor            # [n_attn_layers, n_slots, max_seq_len, n_kv, head_dim]
    v: torch.Tensor
    conv_state: torch.Tensor   # [n_conv_layers, n_slots, L_cache - 1, hidden]
    conv_tape: torch.Tensor    # [n_conv_layers, n_rows, verify_width + L_cache - 1, hidden]
    rope: torch.Tensor         # [max_seq_len, head_dim] fp32 (cos | sin)
    # the prefix cache's conv-state snapshots (runtime/prefix_cache.py): per slot, the conv state at each
    # multiple of `block` tokens its prompt's prefill passed, [n_conv_layers, n_slots, max_seq_len // block,
    # L_cache - 1, hidden]; None without a prefix cache
    block_state: torch.Tensor | None = None
    block: int = 0

    @classmethod
    def allocate(cls, cfg: TargetConfig, n_slots: int, max_seq_len: int, verify_width: int,
                 dtype: torch.dtype, device: torch.device | str, block: int = 0) -> "TargetCache":
        """``block``: the prefix cache's block (0: no prefix cache, no block states)."""
        n_attn, n_conv = len(cfg.attention_layers), len(cfg.conv_layers)
        kv_shape = (n_attn, n_slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        km1 = cfg.conv_L_cache - 1
        block_state = None
        if block:
            block_state = torch.zeros((n_conv, n_slots, max_seq_len // block, km1, cfg.hidden_size),
                                      dtype=dtype, device=device)
        return cls(
            k=torch.zeros(kv_shape, dtype=dtype, device=device),
            v=torch.zeros(kv_shape, dtype=dtype, device=device),
            conv_state=torch.zeros((n_conv, n_slots, km1, cfg.hidden_size), dtype=dtype, device=device),
            conv_tape=torch.zeros((n_conv, n_slots, verify_width + km1, cfg.hidden_size), dtype=dtype,
                                  device=device),
            rope=rope_cos_sin_table(max_seq_len, cfg.head_dim, cfg.rope_theta, device=device),
            block_state=block_state, block=block,
        )

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def layer_caches(self, cfg: TargetConfig) -> list[LayerCache]:
        """Each decoder layer's one-layer slices (``[1, ...]`` views, addressed as layer 0 by the ops).

        Slicing outside the layer is what lets one compiled graph serve every layer of a kind: the
        layer sees its cache as a plain input instead of indexing by a constant it would specialise on.
        """
        out, n_attn, n_conv = [], 0, 0
        for kind in cfg.layer_types:
            if kind == ATTENTION:
                out.append((self.k[n_attn:n_attn + 1], self.v[n_attn:n_attn + 1]))
                n_attn += 1
            else:
                out.append((self.conv_state[n_conv:n_conv + 1], self.conv_tape[n_conv:n_conv + 1]))
                n_conv += 1
        return out

    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.conv_state, self.conv_tape]
        if self.block_state is not None:
            tensors.append(self.block_state)
        return sum(t.numel() * t.element_size() for t in tensors)

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Give slots ``dst`` the state slot ``src`` has after ``length`` tokens: their K/V at
        positions ``< length`` and the conv state (several samples of one prompt, one prefill)."""
        idx = torch.tensor(dst, dtype=torch.int64, device=self.k.device)
        self.k[:, idx, :length] = self.k[:, src:src + 1, :length]
        self.v[:, idx, :length] = self.v[:, src:src + 1, :length]
        self.conv_state[:, idx] = self.conv_state[:, src:src + 1]
        if self.block_state is not None:
            blocks = length // self.block
            self.block_state[:, idx, :blocks] = self.block_state[:, src:src + 1, :blocks]


@dataclass
class DraftCache:
    k: torch.Tensor            # [n_draft_layers, n_slots, max_seq_len, n_kv, head_dim]
    v: torch.Tensor
    rope: torch.Tensor         # [max_seq_len, head_dim] fp32

    @classmethod
    def allocate(cls, cfg: DraftConfig, n_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> "DraftCache":
        shape = (cfg.num_hidden_layers, n_slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
                   rope=rope_cos_sin_table(max_seq_len, cfg.head_dim, cfg.rope_theta, device=device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Give slots ``dst`` the draft context of slot ``src`` at positions ``< length``."""
        idx = torch.tensor(dst, dtype=torch.int64, device=self.k.device)
        self.k[:, idx, :length] = self.k[:, src:src + 1, :length]
        self.v[:, idx, :length] = self.v[:, src:src + 1, :length]
