"""``lfmspark::cache_attention``: Triton kernel (interpreter on CPU, native on CUDA) against the
plain-PyTorch reference, op registration checks, torch.compile and CUDA-graph replay.

The caches are paged (ops/attention/cache_attention.py) with a shuffled page table: each slot's
logical pages sit at random physical pages, the slots' pages interleaved, and a few physical pages
belong to no slot. The paged layout is checked against the dense one (one page per slot, the
identity table) bit for bit, with pages that split windows and key blocks."""

from __future__ import annotations

import math

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.attention.cache_attention import cache_attention_reference, cache_attention_triton, plan_launch
from env_vars import interpret_triton

LAYERS, SLOTS = 2, 4
LAYER = 1  # the last layer, so a wrong layer offset reads other random values


def shuffled_table(n_slots: int, per_slot: int, seed: int = 0, spare: int = 2) -> torch.Tensor:
    """An int32 ``page_table [n_slots, per_slot]`` over ``n_slots * per_slot + spare`` physical pages: a
    random permutation (a slot's logical pages scattered, the slots' interleaved), ``spare`` pages
    mapped by no slot."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_slots * per_slot + spare, generator=g)
    return order[:n_slots * per_slot].view(n_slots, per_slot).to(torch.int32)


def paged(k: torch.Tensor, v: torch.Tensor, page: int, seed: int = 0, spare: int = 2):
    """Dense caches ``[L, R, S, n_kv, hd]`` (slot ``r``'s positions in row ``r``) as paged caches
    ``[L, n_pages, page, n_kv, hd]`` and their :func:`shuffled_table` ``[R, S // page]``, the
    ``spare`` pages holding random values."""
    L, R, S = k.shape[:3]
    per_slot = S // page
    assert per_slot * page == S, f"page {page} does not divide {S}"
    n_pages = R * per_slot + spare
    table = shuffled_table(R, per_slot, seed, spare).long()
    g = torch.Generator().manual_seed(seed)
    out = []
    for dense in (k, v):
        cache = torch.randn(L, n_pages, page, *dense.shape[3:], generator=g).to(dense.device, dense.dtype)
        cache[:, table.flatten().to(dense.device)] = dense.reshape(L, R * per_slot, page, *dense.shape[3:])
        out.append(cache)
    return out[0], out[1], table.to(device=k.device, dtype=torch.int32)


def dense_layout(k: torch.Tensor, v: torch.Tensor):
    """The dense caches as the paged layout's special case: one page of ``S`` positions per slot."""
    return k, v, torch.arange(k.shape[1], dtype=torch.int32, device=k.device)[:, None]


def _dense_inputs(device: str, dtype: torch.dtype, B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int,
                  starts: list[int], slots: list[int], seed: int = 0):
    """Random q, dense caches ``[LAYERS, SLOTS, S, n_kv, hd]`` of random values, slots and starts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, n_heads, hd, generator=g).to(device, dtype)
    k_dense = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(device, dtype)
    v_dense = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(device, dtype)
    start = torch.tensor(starts, dtype=torch.int64, device=device)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    return q, k_dense, v_dense, slot_t, start


def _inputs(device: str, dtype: torch.dtype, B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int,
            starts: list[int], slots: list[int], seed: int = 0, page: int | None = None):
    """Random q and paged caches filled with random values everywhere (reads of wrong positions,
    pages, slots, layers or heads change the result); ``page``: default the largest of 16, 8, ...
    that divides ``S``."""
    q, k_dense, v_dense, slot_t, start = _dense_inputs(device, dtype, B, T, n_heads, n_kv, hd, S, starts, slots, seed)
    k_cache, v_cache, table = paged(k_dense, v_dense, page or math.gcd(S, 16), seed=seed + 1)
    return q, k_cache, v_cache, table, slot_t, start


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _check(device: str, dtype: torch.dtype, B: int, T: int, n_heads: int, n_kv: int, hd: int, S: int,
           starts: list[int], slots: list[int], causal: bool, num_splits: int | None, seed: int = 0) -> None:
    q, k_cache, v_cache, table, slot_t, start = _inputs(device, dtype, B, T, n_heads, n_kv, hd, S, starts, slots,
                                                        seed)
    scale = hd ** -0.5
    out = cache_attention_triton(q, k_cache, v_cache, table, LAYER, slot_t, start, causal, scale,
                                 num_splits=num_splits)
    ref = cache_attention_reference(q, k_cache, v_cache, table, LAYER, slot_t, start, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **_tol(dtype))
    pad = slot_t < 0
    if pad.any():
        assert (out[pad] == 0).all(), "padding rows must be exactly zero"


# ---------------------------------------------------------------------------------------------
# parity at tiny shapes: the interpreter on CPU (CI), native on CUDA

# (B, T, n_heads, n_kv, hd, S, starts, slots)
_SHAPES = {
    # decode, group 4; row 1's query is the cache's last position
    "decode_g4": (2, 1, 8, 2, 64, 64, [5, 63], [2, 0]),
    # verify-sized block, group 1, a padding row in the middle
    "t3_g1_pad": (3, 3, 2, 2, 16, 40, [0, 7, 30], [1, -1, 3]),
    # odd head count (6 heads over 2 kv heads); row 1's window runs past the cache end
    "t10_odd_heads_clip": (2, 10, 6, 2, 16, 200, [12, 195], [3, 1]),
    # prefill-like: 33 tokens x group 4 = 132 rows -> two row tiles; several 64-key blocks
    "t33_prefill": (1, 33, 4, 1, 16, 160, [100], [2]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", list(_SHAPES))
@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto", "nosplit"])
def test_parity_fp32(triton_device: str, name: str, causal: bool, num_splits: int | None) -> None:
    _check(triton_device, torch.float32, *_SHAPES[name], causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("num_splits", [1, 3, 9], ids=lambda n: f"splits{n}")
def test_forced_splits(triton_device: str, causal: bool, num_splits: int) -> None:
    # 2 rows: 3 and 253 keys (4 key blocks of 64): 3 splits give row 1 slices of 2, 2 and 0
    # blocks; 9 splits are more slices than keys for row 0 and than key blocks for row 1
    _check(triton_device, torch.float32, 2, 3, 4, 1, 16, 256, [0, 250], [1, 3], causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"splits{n}")
def test_large_scores(triton_device: str, num_splits: int) -> None:
    # scores of several hundred: exp without the running-max shift would overflow fp32 (the
    # tolerance is looser: fp32 rounding of such scores alone moves the probabilities by ~1e-5)
    q, k_cache, v_cache, table, slots, start = _inputs(triton_device, torch.float32, 1, 2, 4, 2, 16, 256, [200], [2])
    out = cache_attention_triton(q, k_cache, v_cache, table, LAYER, slots, start, True, 40.0, num_splits=num_splits)
    ref = cache_attention_reference(q, k_cache, v_cache, table, LAYER, slots, start, True, 40.0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_split_with_padding_row(triton_device: str) -> None:
    _check(triton_device, torch.float32, 2, 2, 4, 2, 16, 32, [9, 4], [-1, 2], causal=True, num_splits=4)


@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "nosplit", "splits3"])
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False)], ids=["decode", "verify", "draft"])
def test_parity_bf16(triton_device: str, T: int, causal: bool, num_splits: int | None) -> None:
    _check(triton_device, torch.bfloat16, 2, T, 8, 2, 64, 192, [17, 180], [3, -1], causal=causal, num_splits=num_splits)


def test_parity_fp16(triton_device: str) -> None:
    _check(triton_device, torch.float16, 2, 3, 4, 2, 16, 32, [1, 25], [0, 1], causal=True, num_splits=None)


def test_noncontiguous_q(triton_device: str) -> None:
    q, k_cache, v_cache, table, slots, start = _inputs(triton_device, torch.float32, 2, 3, 4, 2, 16, 32, [3, 20],
                                                       [2, 0])
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, hd] view with heads outermost
    out = cache_attention_triton(q, k_cache, v_cache, table, LAYER, slots, start, True, 0.3)
    ref = cache_attention_reference(q, k_cache, v_cache, table, LAYER, slots, start, True, 0.3)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# op registration, torch.compile

def _op_args() -> tuple:
    q, k_cache, v_cache, table, slots, start = _inputs("cpu", torch.float32, 2, 3, 4, 2, 16, 32, [4, 29], [1, -1])
    return (q, k_cache, v_cache, table, LAYER, slots, start, True, 0.25)


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, _op_args())
    torch.library.opcheck(torch.ops.lfmspark.cache_attention, (*_op_args(), True))   # exact mode's plan


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    q, k_cache, v_cache, table, layer, slots, start, causal, scale = _op_args()

    def attend(q, k_cache, v_cache, table, slots, start):
        return torch.ops.lfmspark.cache_attention(q, k_cache, v_cache, table, layer, slots, start, causal, scale)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    eager = attend(q, k_cache, v_cache, table, slots, start)
    torch.testing.assert_close(compiled(q, k_cache, v_cache, table, slots, start), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, cache_attention_reference(q, k_cache, v_cache, table, layer, slots, start,
                                                                causal, scale), **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# CUDA: LFM2.5-1.2B shapes (32 heads, 8 kv heads, head_dim 64, 8192 positions)

_GPU = dict(n_heads=32, n_kv=8, hd=64, S=8192)
_GPU_STARTS, _GPU_SLOTS = [0, 511, 8191 - 10, 4000], [3, 0, 2, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False), (300, True)],
                         ids=["decode", "verify", "draft", "prefill"])
@pytest.mark.parametrize("num_splits", [None, 1, 16], ids=["auto", "nosplit", "splits16"])
def test_gpu_parity(dtype: torch.dtype, T: int, causal: bool, num_splits: int | None) -> None:
    _check("cuda", dtype, 4, T, _GPU["n_heads"], _GPU["n_kv"], _GPU["hd"], _GPU["S"], _GPU_STARTS, _GPU_SLOTS,
           causal=causal, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_parity_batch(B: int) -> None:
    starts = [(997 * i) % 8000 for i in range(B)]
    slots = [i % SLOTS if i % 5 != 4 else -1 for i in range(B)]
    _check("cuda", torch.bfloat16, B, 1, _GPU["n_heads"], _GPU["n_kv"], _GPU["hd"], _GPU["S"], starts, slots,
           causal=True, num_splits=None)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto", "nosplit"])
def test_gpu_cuda_graph_follows_indices(num_splits: int | None) -> None:
    B, T = 2, 10
    q, k_cache, v_cache, table, slots, start = _inputs("cuda", torch.bfloat16, B, T, _GPU["n_heads"], _GPU["n_kv"],
                                                       _GPU["hd"], _GPU["S"], [100, 6000], [1, 2])
    scale = _GPU["hd"] ** -0.5

    def attend():
        if num_splits is None:  # the op itself (default heuristic: split path at B = 2)
            return torch.ops.lfmspark.cache_attention(q, k_cache, v_cache, table, LAYER, slots, start, True, scale)
        return cache_attention_triton(q, k_cache, v_cache, table, LAYER, slots, start, True, scale,
                                      num_splits=num_splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()

    pages = table.clone()
    for i, (new_start, new_slots) in enumerate([([100, 6000], [1, 2]), ([8100, 3], [0, -1]), ([0, 7777], [-1, 3])]):
        start.copy_(torch.tensor(new_start))
        slots.copy_(torch.tensor(new_slots))
        table.copy_(pages.roll(i, dims=0))   # the table is read at replay too: other pages for each slot
        graph.replay()
        torch.cuda.synchronize()
        ref = cache_attention_reference(q, k_cache, v_cache, table, LAYER, slots, start, True, scale)
        torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
        assert (out[slots < 0] == 0).all()


def test_split_heuristic() -> None:
    """At the LFM2.5-1.2B shape on 132 SMs with a 960-position cache: the decode step's 4-row windows
    take 15 splits (the cache's 64-key blocks), the round's 40-row windows 4, a full wave none; a
    17-token prefill (68 rows) with an 8192-position cache 33 (about two programs per SM)."""
    assert plan_launch(1, 1, 32, 8, 64, 960, 2, 132).num_splits == 15
    assert plan_launch(1, 10, 32, 8, 64, 960, 2, 132).num_splits == 4
    assert plan_launch(1, 9, 32, 8, 64, 960, 2, 132).num_splits == 4
    assert plan_launch(16, 10, 32, 8, 64, 960, 2, 132).num_splits == 1
    # prefill tiles (more than 64 rows) keep the occupancy rule
    assert plan_launch(1, 17, 32, 8, 64, 8192, 2, 132).num_splits == 33


# ---------------------------------------------------------------------------------------------
# exact mode: a query's bits do not depend on the launch

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", [200, 2600], ids=["one_slice", "three_slices"])
def test_exact_plan_gives_a_query_the_same_bits_in_any_window_and_batch(triton_device: str, dtype: torch.dtype,
                                                                       S: int) -> None:
    """The query at absolute position ``p`` of slot 2, run as a decode step (alone, and beside other
    rows), at position 4 of a verify window and at position 20 of a 33-token prefill chunk (other
    queries random, the window's keys already in the cache, as the engine writes them first): the
    same output bits each time, and the reference's values within rounding. The query sits at rows
    0-1 of its 16-row tile alone and at rows 8-9 in the window and the chunk; under the interpreter
    the kernel's exact dots are its own per-element sums (``_exact_dot``), as numpy's BLAS may sum a
    row by its position in the product (the GPU's dot does not)."""
    hd, n_heads, n_kv, p = 16, 4, 2, S - 40
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(triton_device, dtype)
    v_cache = torch.randn(LAYERS, SLOTS, S, n_kv, hd, generator=g).to(triton_device, dtype)
    k_cache, v_cache, table = paged(k_cache, v_cache, 8, seed=5)
    query = torch.randn(n_heads, hd, generator=g).to(triton_device, dtype)
    scale = hd ** -0.5

    def run(B: int, T: int, row: int, t: int, slots: list[int], starts: list[int]) -> torch.Tensor:
        q = torch.randn(B, T, n_heads, hd, generator=g).to(triton_device, dtype)
        q[row, t] = query
        args = (k_cache, v_cache, table, LAYER, torch.tensor(slots, device=triton_device),
                torch.tensor(starts, device=triton_device), True, scale)
        out = cache_attention_triton(q, *args, exact=True)
        torch.testing.assert_close(out, cache_attention_reference(q, *args), **_tol(dtype))
        return out[row, t]

    alone = run(1, 1, 0, 0, [2], [p])
    assert torch.equal(run(3, 1, 1, 0, [0, 2, 3], [7, p, S - 1]), alone)          # a decode batch
    assert torch.equal(run(2, 10, 0, 4, [2, 1], [p - 4, 3]), alone)                # a verify window
    assert torch.equal(run(1, 33, 0, 20, [2], [p - 20]), alone)                    # a prefill chunk


def test_exact_plan_follows_the_slot_length_only() -> None:
    plans = {plan_launch(B, T, 32, 8, 64, 4096, 2, sms, exact=True) for B, T, sms in
             ((1, 1, 132), (64, 10, 132), (4, 256, 78))}
    (plan,) = {(p.block_m, p.num_splits, p.block_n) for p in plans}
    assert plan == (16, 4, 64)


# ---------------------------------------------------------------------------------------------
# the paged layout

# (B, T, n_heads, n_kv, hd, S, starts, slots): row 0's window (13-17) crosses a page of 16, row 2's
# (61-65) a page and a 64-key block, row 3's runs past the slot end; row 1 pads. At hd 32 in fp32 the
# unsplit launch takes 128-key blocks: 32 pages of 4 in one block.
_PAGED = (4, 5, 4, 2, 32, 128, [13, 50, 61, 123], [2, -1, 0, 3])


@pytest.mark.parametrize("page, num_splits, causal", [(16, 3, True), (16, 1, False), (4, 3, False), (4, 1, True)],
                         ids=["page16-splits3-causal", "page16-splits1-noncausal", "page4-splits3-noncausal",
                              "page4-splits1-causal"])
def test_paged_equals_dense_layout(triton_device: str, page: int, num_splits: int, causal: bool) -> None:
    """The same call on shuffled pages and on the dense layout (one page per slot, the identity
    table): the same bits, from the kernel and from the reference."""
    q, k_dense, v_dense, slots, start = _dense_inputs(triton_device, torch.float32, *_PAGED)
    scale = 0.2
    dense = dense_layout(k_dense, v_dense)
    k_cache, v_cache, table = paged(k_dense, v_dense, page, seed=page)
    assert table.shape == (SLOTS, _PAGED[5] // page)
    out = cache_attention_triton(q, k_cache, v_cache, table, LAYER, slots, start, causal, scale, num_splits=num_splits)
    want = cache_attention_triton(q, *dense, LAYER, slots, start, causal, scale, num_splits=num_splits)
    assert torch.equal(out, want)
    ref = cache_attention_reference(q, k_cache, v_cache, table, LAYER, slots, start, causal, scale)
    assert torch.equal(ref, cache_attention_reference(q, *dense, LAYER, slots, start, causal, scale))
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("num_splits", [3, 1], ids=lambda n: f"splits{n}")
def test_reads_only_the_rows_keys(triton_device: str, num_splits: int) -> None:
    """NaN in every physical page no row needs, behind the table entries past each row's keys and at
    the positions past its keys in its last page: the output bits of a cache of random values there
    (no read leaves a row's keys; masked lanes load zeros, so their NaN never reaches a product)."""
    page = 16
    q, k_cache, v_cache, table, slots, start = _inputs(triton_device, torch.float32, *_PAGED, page=page)
    T, S = _PAGED[1], _PAGED[5]
    clean = cache_attention_triton(q, k_cache, v_cache, table, LAYER, slots, start, True, 0.2, num_splits=num_splits)
    ends = {slot: min(s0 + T, S) for slot, s0 in zip(slots.tolist(), start.tolist()) if slot >= 0}
    spare = min(set(range(k_cache.shape[1])) - set(table.flatten().tolist()))   # a page no slot maps
    k_nan, v_nan = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    poison = torch.full_like(table, spare)
    for slot, end in ends.items():
        n_pages = -(-end // page)
        poison[slot, :n_pages] = table[slot, :n_pages]
        for pos in range(end):
            cell = (LAYER, table[slot, pos // page], pos % page)
            k_nan[cell], v_nan[cell] = k_cache[cell], v_cache[cell]
    out = cache_attention_triton(q, k_nan, v_nan, poison, LAYER, slots, start, True, 0.2, num_splits=num_splits)
    assert torch.equal(out, clean)


def test_page_table_is_checked() -> None:
    q, k_cache, v_cache, table, slots, start = _inputs("cpu", torch.float32, 1, 1, 2, 2, 16, 32, [3], [0])
    for bad, message in ((table.long(), "int32"), (table[0], "2-D"),
                         (torch.stack([table, table], -1)[..., 0], r"stride\(1\) == 1"),
                         (table.to("meta"), "page_table is on meta")):
        with pytest.raises(ValueError, match=message):
            cache_attention_triton(q, k_cache, v_cache, bad, LAYER, slots, start, True, 0.25)
