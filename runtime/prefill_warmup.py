"""Which prefills the warm-up runs so that no first request compiles a Triton kernel variant
(:meth:`lfmspark.runtime.engine.Engine.prefill_warm_shapes`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence

from ..models.config import TargetConfig
from ..ops.attention.window_attention import launch_variant as attention_launch_variant
from ..ops.moe import launch_variant as moe_launch_variant


def prefill_warm_shapes(max_batch: int, longest: int,
                        variants: Sequence[Callable[[int, int], Hashable]] = ()) -> list[tuple[int, int]]:
    """The ``(rows, length)`` prefills that compile every Triton variant a prefill can need, for
    prompts of up to ``longest`` tokens per chunk.

    Each variant a first request compiles costs it 0.3-0.6 s of TTFT on a GPU (a first 128-token
    request: 577 ms without the warm-up, 22.9 ms with it; docs/decisions.md, "Prefill, warm-up and
    the allocator"). Which variant a kernel needs is decided by compile-time choices and by
    Triton's specialization of integer arguments ("== 1", "% 16 == 0"):

    - the row count selects the LM head's and argmax's tiles: every row count, at length 16;
    - the length: one token, a multiple of 16 (above) and not (17);
    - kernels whose launch plan depends on both, each named by a function ``variant(rows, length)``
      in ``variants``: the attention (``ops.window_attention.launch_variant``: the window kernel and its
      token block for short windows, and the launch plan's row tiles by length and key splits by
      the number of programs) and, for an MoE target, the experts
      (``ops.moe.launch_variant`` of the ``rows * length * top_k`` pairs: tiles and plan chunking).
      One shape per variant of each, the one with the fewest tokens. Their shape-dependent
      integer arguments are not specialized, so one shape covers a variant.
    """
    shapes = [(rows, 16) for rows in range(1, max_batch + 1)] + [(1, 1), (1, 17)]
    for variant in variants:
        cheapest: dict[Hashable, tuple[int, int]] = {}
        for rows in range(1, max_batch + 1):
            for length in range(1, longest + 1):
                v = variant(rows, length)
                if v not in cheapest or rows * length < math.prod(cheapest[v]):
                    cheapest[v] = (rows, length)
        shapes += sorted(cheapest.values())
    return list(dict.fromkeys((r, n) for r, n in shapes if n <= longest))


def prefill_variants(cfg: TargetConfig, cache_len: int, elem_size: int, sms: int
                     ) -> list[Callable[[int, int], Hashable]]:
    """The ``variant(rows, length)`` functions of :func:`prefill_warm_shapes` for a target: its
    attention's launch plan (with a KV cache of ``cache_len`` positions) and, for an MoE target, its
    experts' (``ops.moe.launch_variant`` of the prefill's ``rows * length * top_k`` pairs)."""
    variants: list[Callable[[int, int], Hashable]] = []
    if cfg.attention_layers:
        def attention_variant(rows: int, length: int) -> Hashable:
            return attention_launch_variant(rows, length, cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.head_dim, cache_len, elem_size, sms)
        variants.append(attention_variant)
    if cfg.is_moe and cfg.num_hidden_layers > cfg.num_dense_layers:
        # a function of the pair count alone, which many shapes share
        moe_variant = functools.lru_cache(maxsize=None)(
            lambda pairs: moe_launch_variant(pairs, cfg.num_experts, elem_size))
        variants.append(lambda rows, length: moe_variant(rows * length * cfg.num_experts_per_tok))
    return variants
