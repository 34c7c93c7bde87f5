"""How many KV pages the pool gets, and the context length that follows from it.

The pool (models/cache.py, runtime/pages.py) is sized once, at engine construction, by the first
of: ``kv_cache_memory`` (bytes, vLLM's ``--kv-cache-memory``); on a GPU, ``gpu_memory_utilization``
of the device's memory (vLLM's meaning: the fraction this engine may hold in all) less what is in
use already (the weights) and a reserve for activations, logits and CUDA graphs; on a CPU, at most
``CPU_KV_BYTES``. Without ``kv_cache_memory`` it is never more than every slot filled to
``max_seq_len`` could use. ``max_seq_len`` left unset is the checkpoint's context length
(``max_position_embeddings``), or what the pool holds if that is less.
"""

from __future__ import annotations

import logging

import torch

from ..models.cache import pages_for
from .config import EngineConfig

log = logging.getLogger("lfmspark")

CPU_KV_BYTES = 1 << 30
_ACTIVATION_RESERVE = 1 << 30    # besides the logits: workspaces, graph pools, the allocator's slack


def kv_pool_pages(config: EngineConfig, page_bytes: int, device: torch.device, max_position_embeddings: int,
                  vocab_size: int, verify_width: int) -> int:
    """The pool's pages (module doc); raises ``ValueError`` when the budget leaves none."""
    size = config.page_size
    most = config.max_batch * pages_for((config.max_seq_len or max_position_embeddings) + verify_width, size)
    if config.kv_cache_memory is not None:
        n, source = config.kv_cache_memory // page_bytes, f"kv_cache_memory={config.kv_cache_memory}"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        logits = 2 * 4 * vocab_size * (config.max_batch * verify_width + config.prefill_chunk)
        budget = config.gpu_memory_utilization * total - (total - free) - logits - _ACTIVATION_RESERVE
        n = min(most, int(budget // page_bytes))
        source = (f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / 2**30:.1f} GiB with "
                  f"{(total - free) / 2**30:.1f} GiB in use")
    else:
        n, source = min(most, CPU_KV_BYTES // page_bytes), f"the CPU's {CPU_KV_BYTES >> 20} MiB"
    if n < 1:
        raise ValueError(f"no room for the KV cache: {source} leaves less than one page of {size} tokens "
                         f"({page_bytes} bytes); raise gpu_memory_utilization or kv_cache_memory")
    return int(n)


def resolve_max_seq_len(config: EngineConfig, max_position_embeddings: int, pool_tokens: int, window: int) -> int:
    """The tokens one request's prompt and output may hold: ``config.max_seq_len`` if set, else the
    checkpoint's context length, lowered to what the pool holds where that is smaller. The pool
    must hold one such request and the ``window`` positions a round writes past it."""
    if config.max_seq_len is not None:
        if config.max_seq_len + window > pool_tokens:
            raise ValueError(f"max_seq_len {config.max_seq_len} and the verify window ({window}) are more than the KV "
                             f"cache holds ({pool_tokens} tokens): lower max_seq_len (--max-model-len) or raise "
                             "kv_cache_memory / gpu_memory_utilization")
        if config.max_seq_len > max_position_embeddings:
            log.warning("max_seq_len %d is more than the model's context length (max_position_embeddings %d): "
                        "positions past it were never trained", config.max_seq_len, max_position_embeddings)
        return config.max_seq_len
    fits = pool_tokens - window
    if fits < 1:
        raise ValueError(f"the KV cache holds {pool_tokens} tokens, not even the verify window ({window}): raise "
                         "kv_cache_memory / gpu_memory_utilization")
    if fits < max_position_embeddings:
        log.warning("the KV cache holds %d tokens, less than the model's context length %d and the verify window: "
                    "max_seq_len is %d", pool_tokens, max_position_embeddings, fits)
    return min(max_position_embeddings, fits)
