"""KV pages on the host: the pool's free list and reference counts, and each slot's page list.

The device caches (models/cache.py) hold ``n_pages`` physical pages and a page table; which page
backs which positions of which slot is decided here, on the host, and pushed to the device table
(:meth:`SlotPages.flush`) before the forwards that read it. A page is referenced by every slot whose
table maps it and by the prefix cache while a cached block holds it; it returns to the free list
when the last reference goes. Pages are shared only where their contents can no longer change: full
pages of a prompt below every sharer's length (a prefix-cache hit, the samples of one prompt).

A slot's pages cover its positions from 0 up: :meth:`SlotPages.ensure` appends pages until a length
fits, :meth:`SlotPages.release` drops them all (finish, abort, preemption) and points the slot's
table row back at the trash page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .transfer import to_device


class OutOfPagesError(RuntimeError):
    """The pool has no free page left (after the prefix cache gave back what it could)."""


class PagePool:
    """Physical pages ``0 .. n_pages - 1`` with reference counts. The prefix cache, when there is one,
    sets ``reclaimable()`` (the pages only it holds) and ``reclaim(n)`` (release at least ``n`` of them,
    least recently used first), which an allocation calls before it fails."""

    def __init__(self, n_pages: int):
        if n_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.n_pages = n_pages
        self.refs = np.zeros(n_pages, dtype=np.int32)
        self._free = list(range(n_pages - 1, -1, -1))
        self.peak_in_use = 0          # the most pages in use at once (benchmarks reset it)
        self.reclaim: Callable[[int], None] | None = None
        self.reclaimable: Callable[[], int] | None = None

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.n_pages - len(self._free)

    def available(self) -> int:
        """Pages an allocation could get: the free ones and those only the prefix cache holds."""
        return self.n_free + (self.reclaimable() if self.reclaimable is not None else 0)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (reference count 1), or :class:`OutOfPagesError` leaving nothing taken."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError(f"{n} KV pages wanted, {len(self._free)} free of {self.n_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self.refs[pages] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages`` (all in use)."""
        if len(pages) and (self.refs[list(pages)] < 1).any():
            raise RuntimeError(f"retaining free KV pages {[p for p in pages if self.refs[p] < 1]}")
        np.add.at(self.refs, list(pages), 1)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each of ``pages``; a page whose last reference goes is free again."""
        for p in pages:
            if self.refs[p] < 1:
                raise RuntimeError(f"KV page {p} released more times than it was referenced")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


class SlotPages:
    """Each slot's pages (positions ``0 ..`` in order) and the host copy of the page table, with the
    entries the device table has not seen yet."""

    def __init__(self, pool: PagePool, n_slots: int, max_pages: int, page_size: int, trash: int):
        self.pool, self.page_size, self.trash = pool, page_size, trash
        self.max_pages = max_pages
        self.pages: list[list[int]] = [[] for _ in range(n_slots)]
        self._dirty: dict[tuple[int, int], int] = {}       # (slot, logical page) -> physical page

    def covered(self, slot: int) -> int:
        """Positions slot ``slot``'s pages cover."""
        return len(self.pages[slot]) * self.page_size

    def pages_needed(self, slot: int, length: int) -> int:
        """Pages :meth:`ensure` would allocate for ``length`` positions."""
        return max(0, min(-(-length // self.page_size), self.max_pages) - len(self.pages[slot]))

    def ensure(self, slot: int, length: int) -> None:
        """Cover positions ``< length`` (capped at the table's width) with pages of its own; raises
        :class:`OutOfPagesError` (nothing taken) when the pool cannot."""
        n = self.pages_needed(slot, length)
        if n:
            self._append(slot, self.pool.allocate(n))

    def share(self, slot: int, pages: Sequence[int]) -> None:
        """Append pages someone else holds (a cached prefix, a prompt's other sample): referenced, not copied."""
        self.pool.retain(pages)
        self._append(slot, list(pages))

    def release(self, slot: int) -> None:
        """Drop every page of ``slot``; its table row points at the trash page again."""
        pages = self.pages[slot]
        for j in range(len(pages)):
            self._dirty[slot, j] = self.trash
        self.pages[slot] = []
        self.pool.release(pages)

    def _append(self, slot: int, pages: list[int]) -> None:
        mine = self.pages[slot]
        if len(mine) + len(pages) > self.max_pages:
            raise ValueError(f"slot {slot} would map {len(mine) + len(pages)} pages, the table holds {self.max_pages}")
        for p in pages:
            self._dirty[slot, len(mine)] = p
            mine.append(p)

    def flush(self, table: torch.Tensor) -> None:
        """Write the changed entries to the device table (queued on the stream, like the forwards that
        read it): one copy of (slot, logical page, page) triples, one indexed store."""
        if not self._dirty:
            return
        items = [(s, j, p) for (s, j), p in self._dirty.items()]
        self._dirty.clear()
        rows, cols, pages = to_device(items, table.device).unbind(1)
        table[rows, cols] = pages.to(table.dtype)
