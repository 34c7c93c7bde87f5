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

    @classmethod
    def allocate(cls, cfg: TargetConfig, n_slots: int, max_seq_len: int, verify_width: int,
                 dtype: torch.dtype, device: torch.device | str) -> "TargetCache":
        n_attn, n_conv = len(cfg.attention_layers), len(cfg.conv_layers)
        kv_shape = (n_attn, n_slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        km1 = cfg.conv_L_cache - 1
        return cls(
            k=torch.zeros(kv_shape, dtype=dtype, device=device),
            v=torch.zeros(kv_shape, dtype=dtype, device=device),
            conv_state=torch.zeros((n_conv, n_slots, km1, cfg.hidden_size), dtype=dtype, device=device),
            conv_tape=torch.zeros((n_conv, n_slots, verify_width + km1, cfg.hidden_size), dtype=dtype,
                                  device=device),
            rope=rope_cos_sin_table(max_seq_len, cfg.head_dim, cfg.rope_theta, device=device),
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
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.conv_state, self.conv_tape))

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Give slots ``dst`` the state slot ``src`` has after ``length`` tokens: their K/V at
        positions ``< length`` and the conv state (several samples of one prompt, one prefill)."""
        idx = torch.tensor(dst, dtype=torch.int64, device=self.k.device)
        self.k[:, idx, :length] = self.k[:, src:src + 1, :length]
        self.v[:, idx, :length] = self.v[:, src:src + 1, :length]
        self.conv_state[:, idx] = self.conv_state[:, src:src + 1]


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
