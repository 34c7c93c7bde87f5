"""Attention over the slot-indexed KV caches: the K/V writes with per-head norm and RoPE
(``kv_norm_rope_write``, ``qkv_norm_rope_write``), ``cache_attention``, and ``qkv_window_attention``
(the write and the attention of a short window in one launch). ops/routing.py says which window takes which."""

from . import cache_attention, kv_norm_rope_write, window_attention  # noqa: F401  (registers the ops)
