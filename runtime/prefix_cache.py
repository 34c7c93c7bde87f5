"""Prefix cache for a hybrid target with a DSpark draft: a new request that starts with prompt tokens
an earlier request already prefilled starts its prefill after them.

**What a reusable prefix needs.** For LFM2 the K/V of the attention layers is not enough: each
ShortConv layer carries a state (its last ``L_cache - 1`` gated inputs) that cannot be rebuilt from
any cache, and the draft reads a context K/V built from the target's hidden states. So a prefix is
reusable only where all three were kept: the target K/V and the draft's context K/V of its
positions, and the conv state at its end.

**Blocks of one page.** Prefixes are kept in blocks of one KV page (``block`` = the page size, 16
tokens by default) in a trie keyed by each block's token ids (exact tuples: no hash collision can
match wrong tokens). A node holds its block's KV page (target and draft context: one page table
maps both, models/cache.py) **by reference**, and a snapshot of the conv state after its last token
in a pool of its own. A prompt of a few dozen tokens (a short system prompt) is found up to its
last full page.

**Snapshots.** The conv state after a page is taken where the prefill computes it: every prefill
forward copies the state after each page multiple its rows pass into the conv pool
(models/lfm2.py ``ConvSnapshots``: a gather of the ``in_proj`` output at the two positions before
the multiple and the gates' multiply, the bits the conv op stores after a chunk's last token;
tests/models/test_conv_snapshots.py). Which pool row each multiple goes to is an index the prefill
runner fills before the forward (graphs/prefill.py), a fixed buffer that the captured bucket graphs
read, so the prefill keeps its CUDA graphs; multiples nothing stores go to a scratch row. The nodes
are inserted before their forward runs (:meth:`PrefixCache.insert`; nothing reads the cache before
the forward is queued, and a forward that fails takes them back: :meth:`PrefixCache.drop`).

**Chunks.** Prefill chunks keep their length: they never cross a multiple of ``prefix_block`` (256
by default; runtime/scheduler.py ``chunk_len``, cache on or off) and are otherwise at most
``prefill_chunk``. A hit of ``n`` tokens maps the blocks' pages into the request's page table (each
page's reference count goes up: nothing is copied), loads the snapshot, and the prefill continues
from ``n``, writing pages of its own; a cached page is never written again (every sharer's writes
land at positions past the prefix). A hit on the ``prefix_block`` grid resumes with the very chunk a
miss runs; a hit off it runs a chunk from ``n`` to the next multiple, which a miss runs from the
multiple before.

**Exactness, and how outputs are kept.** On the CPU in fp32 (the tests), a request run alone on a
dense target gets the same tokens and log-probabilities with a hit as without, bit for bit, on the
grid and off it, greedy and seeded sampling, speculative or not (tests/e2e/test_prefix_cache.py):
every product of the bucketed prefill rounds a row alike whatever the other rows of the forward.
An MoE target's expert products group a forward's tokens by expert, so a row's roundings follow the
chunk it was in: with a hit off the grid (or a snapshot stored by such a chunk) log-probabilities
move by a few units in the last place (measured up to 5e-7), tokens equal. Where several requests
batch differently with the cache than without (the forwards and steps hold other rows), the same
holds: tokens equal, log-probabilities to the roundings of the batch shape. On the GPU the reused
state is the same bits only where the forwards that computed it rounded rows alike; the default
kernels do not promise that across row counts (a product's reduction order may follow the rows),
the limit outputs already have across loads and batch compositions.
A request's output tokens have state computed by decode steps and verify windows, whose
reductions differ from a prefill's: a later prompt that repeats them (the next chat turn) would
get different low-order bits from that state than from prefilling them. So by default outputs are
prefilled as part of the next prompt and kept from then on; with
``Engine(prefix_cache_outputs=True)`` a finished request's output is prefilled once more as a
queued job (runtime/scheduler.py ``queue_cache_job``: in a free slot at a step where nothing
decodes, the cached prefix loaded, then the chunks a prefill of those tokens runs, batched with the
other jobs), and its pages are stored, so the next turn finds its previous turn cached up to the
last full page. A request asking for ``prompt_logprobs`` needs every prompt position's logits, so
it never takes a hit.

**Memory and eviction.** Cached pages are pages of the one KV pool (runtime/pages.py); each block
also holds one conv snapshot: ``n_conv_layers x (L_cache - 1) x hidden x dtype bytes`` (LFM2.5-1.2B
in bf16: 10 x 2 x 2048 x 2 = 80 KiB per 16 tokens, about 5 KiB a token beside its ~12 KiB of target
K/V). The pool holds ``capacity`` snapshots: ``prefix_cache_tokens / page_size``; at the default
budget (``None``) one per four pages of the KV pool, whose size then budgets every page with a
quarter of a snapshot (runtime/model_runner.py ``DEFAULT_CACHED_SHARE``): cached prefixes may take
up to a quarter of the pool without memory beyond the budget, for about 5% fewer pages at the
LFM2.5-1.2B shape (a snapshot for every page would cost about a fifth). When an allocation finds the KV pool empty, the cache gives back the least recently used
leaves (blocks no other cached block extends) whose pages no request maps; a full conv pool evicts
its least recently used leaf too, never a block the same forward stores or the path its row
extends. Leaves are kept in a heap by last use (stale entries skipped), so an eviction does not
walk the trie.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.cache import TargetCache
from .pages import SlotPages

log = logging.getLogger("lfmspark")

DEFAULT_BLOCK = 256


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    pages: list[int]                                # its KV page (held: one reference)
    conv: int                                       # its row in the conv pool (-1: the root)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0
    cached: bool = True                             # False once evicted or dropped


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up (requests that could take a hit)
    hits: int = 0           # of those, found cached
    inserted: int = 0       # blocks (one KV page and its conv snapshot each) stored
    evicted: int = 0        # blocks dropped to make room

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "inserted_blocks": self.inserted,
                "evicted_blocks": self.evicted}


@dataclass
class Insertion:
    """The blocks one prefill forward stores (:meth:`PrefixCache.insert`): per row, the conv pool row
    of each page multiple its chunk passes (the forward's snapshot index, models/lfm2.py
    ``ConvSnapshots``), and the nodes made for them, which :meth:`PrefixCache.drop` takes back if the
    forward fails."""

    rows: list[list[int]]
    nodes: list[_Node]


class PrefixCache:
    """The trie of cached blocks (one KV page each), their pages by reference and their conv
    snapshots (module doc)."""

    def __init__(self, tcache: TargetCache, slot_pages: SlotPages, capacity: int):
        if capacity < 1:
            raise ValueError(f"a prefix cache needs room for at least one block of {slot_pages.page_size} tokens")
        self.tcache, self.slot_pages, self.capacity = tcache, slot_pages, capacity
        self.block = slot_pages.page_size
        self.pool = slot_pages.pool
        s = tcache.conv_state
        # + one scratch row: where the prefill writes the snapshots nobody stores
        self.conv = s.new_zeros((s.shape[0], capacity + 1, *s.shape[2:]))
        self.scratch = capacity
        self.root = _Node((), None, [], -1)
        self._free = list(range(capacity - 1, -1, -1))
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._leaves: list[tuple[int, int, _Node]] = []    # heap of (last_used, seq, node); stale entries skipped
        self.stats = PrefixCacheStats()
        self.held = np.zeros(self.pool.n_pages, dtype=bool)     # the pages cached blocks hold
        self.pool.reclaim, self.pool.reclaimable = self.reclaim, self.reclaimable

    @staticmethod
    def snapshot_nbytes(tcache: TargetCache) -> int:
        """Bytes of one block's conv snapshot: every ShortConv layer's last ``K - 1`` gated inputs."""
        s = tcache.conv_state
        return s.shape[0] * s.shape[2] * s.shape[3] * s.element_size()

    @property
    def cached_blocks(self) -> int:
        return self.capacity - len(self._free)

    # -- lookup -------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> list[_Node]:
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
        pages by reference and the conv snapshot at their end. Returns the tokens now in the slot."""
        if not nodes:
            return 0
        now = next(self._clock)
        for node in nodes:
            node.last_used = now
        self._push_leaf(nodes[-1])
        self.slot_pages.share(slot, [p for node in nodes for p in node.pages])
        self.tcache.conv_state[:, slot] = self.conv[:, nodes[-1].conv]
        return len(nodes) * self.block

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, rows: Sequence[tuple[Sequence[int], int, int, int]], per_row: int) -> Insertion:
        """Before a prefill forward: store the blocks its rows complete. ``rows``: ``(tokens, slot, start,
        end)`` per row of the forward, the chunk ``tokens[start:end]`` of slot ``slot``; ``per_row``: the
        page multiples a row's snapshot index holds. A row passes the multiples ``p = (start // block
        + 1 + j) * block``; each ``p <= end`` whose earlier blocks are cached (or stored by this call)
        and that is not cached yet becomes a node holding the slot's page ``p / block - 1`` and the
        conv pool row the forward writes the state after ``p`` into. Returns those rows (the scratch
        row where nothing is stored) and the new nodes. Nothing is stored past a block whose parent
        is not cached (evicted meanwhile), nor once the conv pool is full of blocks this call stores or
        the row extends.

        The nodes exist before the forward computes their contents: nothing reads the cache until
        the forward is queued, and the device runs it before any later read; a forward that fails
        hands them to :meth:`drop`."""
        b, now = self.block, next(self._clock)
        created: set[int] = set()      # the nodes this forward fills: never evicted before it runs
        out = Insertion([], [])
        for tokens, slot, start, end in rows:
            pinned = created | {id(self.root)}   # ... nor the path this row extends
            index = [self.scratch] * per_row
            out.rows.append(index)
            first = start // b + 1                 # the first page multiple past start, in blocks
            node, complete = self.root, True
            for j in range(first - 1):             # the cached path to the page before it
                child = node.children.get(tuple(tokens[j * b:(j + 1) * b]))
                if child is None:
                    complete = False
                    break
                node = child
                node.last_used = now
                pinned.add(id(node))
            if not complete:
                if node is not self.root:
                    self._push_leaf(node)          # used now: its older entry went stale
                continue
            for k in range(min(per_row, end // b - first + 1)):
                j = first + k - 1                  # the block ending at (first + k) * block
                key = tuple(tokens[j * b:(j + 1) * b])
                child = node.children.get(key)
                if child is None:
                    row = self._allocate(pinned)
                    if row is None:
                        break
                    page = self.slot_pages.pages[slot][j]
                    self.pool.retain([page])
                    self.held[page] = True
                    child = _Node(key, node, [page], row, last_used=now)
                    node.children[key] = child
                    out.nodes.append(child)
                    created.add(id(child))
                    index[k] = row
                    self.stats.inserted += 1
                child.last_used = now
                pinned.add(id(child))
                node = child
            if node is not self.root:
                self._push_leaf(node)
        return out

    def drop(self, insertion: Insertion) -> None:
        """Take back the nodes of an :meth:`insert` whose forward failed (their contents were never
        written), newest first: each is a leaf by then."""
        for node in reversed(insertion.nodes):
            if node.cached:
                self._remove(node)
                self.stats.inserted -= 1

    def _allocate(self, pinned: set[int]) -> int | None:
        """A free conv pool row, evicting the least recently used leaf not in ``pinned`` (ids) if
        none is free; None when every leaf is pinned."""
        if not self._free:
            victim = self._least_recent_leaf(lambda n: id(n) not in pinned)
            if victim is None:
                return None
            self._evict(victim)
        return self._free.pop()

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.tokens]
        node.cached = False
        self.held[node.pages] = False
        self.pool.release(node.pages)
        self._free.append(node.conv)
        if parent is not self.root and not parent.children:
            self._push_leaf(parent)

    def _evict(self, node: _Node) -> None:
        self._remove(node)
        self.stats.evicted += 1

    # -- least recently used leaves -------------------------------------------------------------
    def _push_leaf(self, node: _Node) -> None:
        """Record ``node`` (its ``last_used`` now) as a candidate leaf. Entries go stale when the node
        is used again, gains a child or leaves the cache; :meth:`_least_recent_leaf` skips those."""
        if node.children:
            return
        heapq.heappush(self._leaves, (node.last_used, next(self._seq), node))
        if len(self._leaves) > 4 * self.cached_blocks + 64:
            self._leaves = [(n.last_used, next(self._seq), n) for n in self._all_nodes() if not n.children]
            heapq.heapify(self._leaves)

    def _least_recent_leaf(self, eligible: Callable[[_Node], bool]) -> _Node | None:
        """The least recently used leaf (a block no cached block extends) that is ``eligible``, taken
        off the candidates, or None."""
        skipped, found = [], None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            last_used, _, node = entry
            if not node.cached or node.children or node.last_used != last_used:
                continue                           # stale
            if eligible(node):
                found = node
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._leaves, entry)
        return found

    def _all_nodes(self) -> list[_Node]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

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
        n = self.cached_blocks
        for node in self._all_nodes():
            node.cached = False
            self.pool.release(node.pages)
        self.held[:] = False
        self.root = _Node((), None, [], -1)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._leaves = []
        return n
