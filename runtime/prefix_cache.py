"""Prefix cache for a hybrid target with a DSpark draft: a new request that starts with prompt tokens
an earlier request already prefilled starts its prefill after them.

**What a reusable prefix needs.** For LFM2 the K/V of the attention layers is not enough: each
ShortConv layer carries a state (its last ``L_cache - 1`` gated inputs) that cannot be rebuilt from
any cache, and the draft reads a context K/V built from the target's hidden states. So a prefix is
reusable only where all three were kept: the target K/V and the draft's context K/V of its
positions, and the conv state at its end.

**Blocks.** Prefixes are kept in blocks of ``block`` tokens (256 by default, a multiple of the
KV page size) in a trie keyed by each block's token ids (exact tuples: no hash collision can match
wrong tokens). A node holds its block's KV pages (target and draft context: one page table maps
both, models/cache.py) **by reference**, and the conv state after its last token in a small pool
of its own. The conv states come from the prefill: its chunks never cross a multiple of ``block``
(runtime/scheduler.py ``chunk_len``), so the state after every full block of a prompt is the state
after some chunk, which the runner inserts, with the block's pages, after each prefill forward.

**Exactness, and how outputs are kept.** A hit of ``n`` tokens (a multiple of ``block``) maps the
blocks' pages into the request's page table (each page's reference count goes up: nothing is
copied), loads the conv state, and the prefill continues from ``n``, writing pages of its own. A
cached page is never written again: every sharer's writes land at positions past the prefix.
Without the hit the same prompt is cut into chunks at the same multiples of ``block`` (cache on
or off), so the resumed prefill runs the very chunk a miss runs, on the same state: on the CPU in
fp32 (the tests) outputs with the cache equal outputs without it bit for bit, tokens and
log-probabilities, greedy and seeded sampling, speculative or not. A request's output tokens have
state computed by decode steps and verify windows, whose reductions differ from a prefill's: a
later prompt that repeats them (the next chat turn) would get different low-order bits from that
state than from prefilling them. So by default outputs are prefilled as part of the next prompt
and kept from then on; with ``Engine(prefix_cache_outputs=True)`` a finished request's output is
prefilled once more as a queued job (runtime/scheduler.py ``queue_cache_job``: in a free slot at a
step where nothing decodes, the cached prefix loaded, then the chunks a prefill of those tokens
runs, on the block grid, batched with the other jobs), and those blocks are stored, so the next
turn finds its previous turn cached up to the last full block. On the GPU the reused state is the
same bits when the forwards that computed it batched rows alike; the default kernels do not
promise that across batch compositions (a product's reduction order may follow the row count), the
limit today's outputs already have across loads. A request asking for ``prompt_logprobs`` needs
every prompt position's logits, so it never takes a hit.

**Memory and eviction.** Cached pages are pages of the one KV pool (runtime/pages.py): a block
costs no memory of its own beyond its conv state (the conv pool holds ``capacity`` of them). When
an allocation finds the pool empty, the cache gives back the least recently used leaves (blocks no
other cached block extends) whose pages no request maps; a full conv pool evicts its least
recently used leaf too, never a block on the path being inserted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..models.cache import TargetCache
from .pages import SlotPages

DEFAULT_BLOCK = 256


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    pages: list[int]                                # its KV pages (held: one reference each)
    conv: int                                       # its row in the conv pool (-1: the root)
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
    """The trie of cached blocks, their pages by reference and their conv states (module doc)."""

    def __init__(self, tcache: TargetCache, slot_pages: SlotPages, capacity: int, block: int):
        if capacity < 1:
            raise ValueError(f"a prefix cache needs room for at least one block of {block} tokens")
        if block % slot_pages.page_size:
            raise ValueError(f"prefix_block {block} is not a multiple of the KV page size {slot_pages.page_size}")
        self.tcache, self.slot_pages, self.block, self.capacity = tcache, slot_pages, block, capacity
        self.pool = slot_pages.pool
        self.pages_per_block = block // slot_pages.page_size
        s = tcache.conv_state
        self.conv = s.new_zeros((s.shape[0], capacity, *s.shape[2:]))
        self.root = _Node((), None, [], -1)
        self._free = list(range(capacity - 1, -1, -1))
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()
        self.held = np.zeros(self.pool.n_pages, dtype=bool)     # the pages cached blocks hold
        self.pool.reclaim, self.pool.reclaimable = self.reclaim, self.reclaimable

    @property
    def cached_blocks(self) -> int:
        return self.capacity - len(self._free)

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
        """Map the blocks ``nodes`` (a :meth:`match`) into ``slot``, which holds no page yet: their
        pages by reference and the conv state at their end. Returns the tokens now in the slot."""
        if not nodes:
            return 0
        now = next(self._clock)
        for node in nodes:
            node.last_used = now
        self.slot_pages.share(slot, [p for node in nodes for p in node.pages])
        self.tcache.conv_state[:, slot] = self.conv[:, nodes[-1].conv]
        return len(nodes) * self.block

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, tokens: list[int], slot: int, end: int) -> bool:
        """A prefill forward of ``slot`` ended at ``end``, a multiple of the block: store the block it
        completed (``tokens[end - block:end]``: its pages and the slot's conv state, which is the
        state after it) under its cached parent. Nothing happens when the parent path is not cached
        (evicted meanwhile), the block is cached already, or the conv pool is full of blocks on this
        path. Returns whether it was stored."""
        b = self.block
        if end % b or end < b or end > len(tokens):
            raise ValueError(f"a block ends at a multiple of {b} within the tokens, not at {end}")
        node, now = self.root, next(self._clock)
        path = {id(self.root)}
        for j in range(end // b - 1):
            node = node.children.get(tuple(tokens[j * b:(j + 1) * b]))
            if node is None:
                return False
            node.last_used = now
            path.add(id(node))
        key = tuple(tokens[end - b:end])
        if key in node.children:
            node.children[key].last_used = now
            return False
        row = self._allocate(path)
        if row is None:
            return False
        j = end // b - 1
        pages = self.slot_pages.pages[slot][j * self.pages_per_block:(j + 1) * self.pages_per_block]
        self.pool.retain(pages)
        self.held[pages] = True
        self.conv[:, row] = self.tcache.conv_state[:, slot]
        node.children[key] = _Node(key, node, list(pages), row, last_used=now)
        self.stats.inserted += 1
        return True

    def _allocate(self, pinned: set[int]) -> int | None:
        if not self._free:
            victim = self._least_recent_leaf(lambda n: id(n) not in pinned)
            if victim is None:
                return None
            self._evict(victim)
        return self._free.pop()

    def _evict(self, node: _Node) -> None:
        del node.parent.children[node.tokens]
        self.held[node.pages] = False
        self.pool.release(node.pages)
        self._free.append(node.conv)
        self.stats.evicted += 1

    def _least_recent_leaf(self, eligible) -> _Node | None:
        best, stack = None, list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif eligible(node) and (best is None or node.last_used < best.last_used):
                best = node
        return best

    # -- giving pages back --------------------------------------------------------------------
    def _only_cached(self, node: _Node) -> bool:
        return bool((self.pool.refs[node.pages] == 1).all())

    def reclaimable(self) -> int:
        """Pages only the cache holds (what :meth:`reclaim` could free)."""
        return int((self.held & (self.pool.refs == 1)).sum())

    def reclaim(self, n: int) -> None:
        """Free at least ``n`` pages if the cache can: evict least recently used leaves whose pages
        no request maps."""
        freed = 0
        while freed < n:
            victim = self._least_recent_leaf(self._only_cached)
            if victim is None:
                return
            self._evict(victim)
            freed += len(victim.pages)

    def clear(self) -> int:
        """Drop every cached block (requests keep the pages they map); returns how many there were."""
        n, stack = self.cached_blocks, list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.pool.release(node.pages)
        self.held[:] = False
        self.root = _Node((), None, [], -1)
        self._free = list(range(self.capacity - 1, -1, -1))
        return n
