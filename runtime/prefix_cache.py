"""Prefix cache for a hybrid target with a DSpark draft: a new request that starts with prompt tokens
an earlier request already prefilled starts its prefill after them.

**What a reusable prefix needs.** For LFM2 the K/V of the attention layers is not enough: each
ShortConv layer carries a state (its last ``L_cache - 1`` gated inputs) that cannot be rebuilt from
any cache, and the draft reads a context K/V built from the target's hidden states. So a prefix is
reusable only where all three were kept: the target K/V and the draft's context K/V of its
positions, and the conv state at its end.

**Blocks.** Prefixes are kept in blocks of ``block`` tokens (256 by default) in a trie keyed by each
block's token ids (exact tuples: no hash collision can match wrong tokens). A node holds its
block's target and draft K/V in a fixed pool and the conv state after its last token. The conv
states come from the prefill: its chunks never cross a multiple of ``block`` (runtime/engine.py
``_next_chunks``), so the state after every full block of a prompt is the state after some chunk,
which the engine stores per slot (``TargetCache.block_state``) and inserts, with the blocks, after
each prefill forward.

**Exactness, and how outputs are kept.** A hit of ``n`` tokens (a multiple of ``block``)
copies the blocks' K/V, draft K/V and conv states into the request's slot, and the prefill
continues from ``n``. Without the hit the same prompt is cut into chunks at the same multiples of
``block`` (cache on or off), so the resumed prefill runs the very chunk a miss runs, on the same
state: on the CPU in fp32 (the tests) outputs with the cache equal outputs without it bit for bit,
tokens and log-probabilities, greedy and seeded sampling, speculative or not. A request's output
tokens have state computed by decode steps and verify windows, whose reductions differ from a
prefill's: a later prompt that repeats them (the next chat turn) would get different low-order bits
from that state than from prefilling them. So by default outputs are prefilled as part of the next
prompt and kept from then on; with ``Engine(prefix_cache_outputs=True)`` a finished request's
output is prefilled once more as a queued job (``Engine._queue_cache_job``: in a free slot at a step
where nothing decodes, the cached prefix loaded, then the chunks a prefill of those tokens runs, on
the block grid, batched with the other jobs), and those blocks are stored, so the next turn finds
its previous turn cached up to the last full block. On the GPU the reused state is the same bits when the forwards that computed
it batched rows alike; the default kernels do not promise that across batch compositions (a
product's reduction order may follow the row count), the limit today's outputs already have
across loads. A request asking for ``prompt_logprobs`` needs every prompt position's logits, so it
never takes a hit.

**Memory and eviction.** The pool holds ``capacity`` blocks (``Engine(prefix_cache_tokens=...)``
over the block size), allocated once. Inserting into a full pool evicts the least recently used
leaf (a block no other cached block extends), never a block on the path being inserted. A hit
copies on the current stream before any later insert can overwrite the pool, so a block evicted
after its copy was queued cannot corrupt the request that read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..models.cache import DraftCache, TargetCache
from .transfer import to_device

DEFAULT_BLOCK = 256


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    block: int                                      # its row in the pools (-1: the root)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up (requests that could take a hit)
    hits: int = 0           # of those, found cached
    inserted: int = 0       # blocks stored
    evicted: int = 0        # blocks dropped to make room

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "inserted_blocks": self.inserted,
                "evicted_blocks": self.evicted}


class PrefixCache:
    """The trie of cached blocks and their pools (see the module doc)."""

    def __init__(self, tcache: TargetCache, dcache: DraftCache | None, capacity: int, block: int):
        if capacity < 1:
            raise ValueError(f"a prefix cache needs room for at least one block of {block} tokens")
        self.tcache, self.dcache, self.block, self.capacity = tcache, dcache, block, capacity
        k = tcache.k
        self.k = k.new_zeros((k.shape[0], capacity, block, *k.shape[3:]))
        self.v = torch.zeros_like(self.k)
        s = tcache.conv_state
        self.conv = s.new_zeros((s.shape[0], capacity, *s.shape[2:]))
        self.dk = self.dv = None
        if dcache is not None:
            self.dk = dcache.k.new_zeros((dcache.k.shape[0], capacity, block, *dcache.k.shape[3:]))
            self.dv = torch.zeros_like(self.dk)
        self.root = _Node((), None, -1)
        self._free = list(range(capacity - 1, -1, -1))
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()

    @property
    def cached_blocks(self) -> int:
        return self.capacity - len(self._free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.conv, self.dk, self.dv) if t is not None)

    # -- lookup -------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[_Node]:
        """The cached blocks ``tokens`` starts with, leaving at least one token to run (a prefill must
        compute the last prompt token's logits)."""
        nodes, node, b = [], self.root, self.block
        for j in range((len(tokens) - 1) // b):
            node = node.children.get(tuple(tokens[j * b:(j + 1) * b]))
            if node is None:
                break
            nodes.append(node)
        return nodes

    def load(self, nodes: list[_Node], slot: int) -> int:
        """Copy the blocks ``nodes`` (a :meth:`match`) into ``slot``: target K/V, draft context K/V, the
        conv state at their end and the block states on the way. Returns the tokens now in the slot."""
        if not nodes:
            return 0
        now = next(self._clock)
        for node in nodes:
            node.last_used = now
        n, b = len(nodes), self.block
        idx = to_device([node.block for node in nodes], self.k.device)
        t = self.tcache
        t.k[:, slot, :n * b] = self.k[:, idx].flatten(1, 2)
        t.v[:, slot, :n * b] = self.v[:, idx].flatten(1, 2)
        t.conv_state[:, slot] = self.conv[:, idx[-1]]
        t.block_state[:, slot, :n] = self.conv[:, idx]
        if self.dcache is not None:
            self.dcache.k[:, slot, :n * b] = self.dk[:, idx].flatten(1, 2)
            self.dcache.v[:, slot, :n * b] = self.dv[:, idx].flatten(1, 2)
        return n * b

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, tokens: list[int], slot: int, length: int) -> int:
        """Store the full blocks of the first ``length`` tokens of ``tokens`` that ``slot`` holds (its
        K/V, draft context and block states are final up to ``length``: a prompt prefilled that far)
        and that are not cached yet. Returns the blocks added (fewer when the pool is full of blocks
        on this path)."""
        node, b, added = self.root, self.block, 0
        now = next(self._clock)
        new: list[tuple[int, int]] = []            # (pool block, block index in the slot)
        path = {id(self.root)}
        for j in range(min(length, len(tokens)) // b):
            key = tuple(tokens[j * b:(j + 1) * b])
            child = node.children.get(key)
            if child is None:
                block = self._allocate(path)
                if block is None:
                    break
                child = _Node(key, node, block)
                node.children[key] = child
                new.append((block, j))
                added += 1
            child.last_used = now
            path.add(id(child))
            node = child
        if new:
            dst = to_device([blk for blk, _ in new], self.k.device)
            src = to_device([j for _, j in new], self.k.device)
            t = self.tcache
            cols = (src[:, None] * b + torch.arange(b, device=self.k.device)).flatten()
            self.k[:, dst] = t.k[:, slot, cols].unflatten(1, (len(new), b))
            self.v[:, dst] = t.v[:, slot, cols].unflatten(1, (len(new), b))
            self.conv[:, dst] = t.block_state[:, slot, src]
            if self.dcache is not None:
                self.dk[:, dst] = self.dcache.k[:, slot, cols].unflatten(1, (len(new), b))
                self.dv[:, dst] = self.dcache.v[:, slot, cols].unflatten(1, (len(new), b))
        self.stats.inserted += added
        return added

    def _allocate(self, pinned: set[int]) -> int | None:
        if not self._free:
            victim = self._least_recent_leaf(pinned)
            if victim is None:
                return None
            del victim.parent.children[victim.tokens]
            self._free.append(victim.block)
            self.stats.evicted += 1
        return self._free.pop()

    def _least_recent_leaf(self, pinned: set[int]) -> _Node | None:
        best, stack = None, list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif id(node) not in pinned and (best is None or node.last_used < best.last_used):
                best = node
        return best

    def clear(self) -> int:
        """Drop every cached block; returns how many there were."""
        n = self.cached_blocks
        self.root = _Node((), None, -1)
        self._free = list(range(self.capacity - 1, -1, -1))
        return n
