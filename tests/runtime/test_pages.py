"""KV pages on the host (runtime/pages.py): the pool's reference counts and the slots' page lists,
and the device table they produce."""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime.pages import OutOfPagesError, PagePool, SlotPages


def test_pages_return_to_the_pool_when_their_last_reference_goes():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.n_free == 1 and pool.in_use == 3
    pool.retain(a[:2])                   # a second holder of two of them
    pool.release(a)
    assert pool.n_free == 2              # a[2] is free, a[0] and a[1] are still held once
    pool.release(a[:2])
    assert pool.n_free == 4 and not pool.refs.any()
    with pytest.raises(RuntimeError, match="released more times"):
        pool.release([a[0]])
    with pytest.raises(RuntimeError, match="retaining free"):
        pool.retain([a[0]])


def test_an_allocation_that_cannot_be_met_takes_nothing_and_asks_the_cache_first():
    pool = PagePool(3)
    held = pool.allocate(2)
    with pytest.raises(OutOfPagesError, match="2 KV pages wanted, 1 free of 3"):
        pool.allocate(2)
    assert pool.n_free == 1
    asked = []

    def reclaim(n: int) -> None:            # a cache that gives back one of the held pages
        asked.append(n)
        pool.release(held[:1])

    pool.reclaim = reclaim
    got = pool.allocate(2)
    assert asked == [1] and len(got) == 2 and pool.n_free == 0


def test_slot_pages_cover_lengths_share_and_flush_to_the_device_table():
    pool = PagePool(8)
    pages = SlotPages(pool, n_slots=2, max_pages=4, page_size=4, trash=8)
    table = torch.full((2, 4), 8, dtype=torch.int32)
    pages.ensure(0, 5)                       # 5 positions: 2 pages
    assert len(pages.pages[0]) == 2 and pages.covered(0) == 8 and pages.pages_needed(0, 9) == 1
    pages.ensure(0, 8)                       # already covered: nothing taken
    assert pool.in_use == 2
    pages.share(1, pages.pages[0][:1])       # slot 1 maps slot 0's first page by reference
    pages.ensure(1, 6)                       # and a page of its own after it
    assert pages.pages[1][0] == pages.pages[0][0] and pool.refs[pages.pages[0][0]] == 2 and pool.in_use == 3
    pages.flush(table)
    assert table[0, :2].tolist() == pages.pages[0] and table[1, :2].tolist() == pages.pages[1]
    assert table[:, 2:].eq(8).all()
    pages.release(0)
    assert pool.in_use == 2 and pool.refs[pages.pages[1][0]] == 1    # the shared page stays with slot 1
    pages.flush(table)
    assert table[0].eq(8).all() and table[1, :2].tolist() == pages.pages[1]
    pages.release(1)
    pages.flush(table)
    assert pool.n_free == 8 and table.eq(8).all()


def test_a_slot_cannot_map_more_pages_than_its_table_row():
    pages = SlotPages(PagePool(8), n_slots=1, max_pages=2, page_size=4, trash=8)
    pages.ensure(0, 100)                     # capped at the row: positions past it are never written
    assert len(pages.pages[0]) == 2
    with pytest.raises(ValueError, match="table holds 2"):
        pages.share(0, pages.pages[0][:1])
