"""``lfmspark::qkv_window_attention``: the window attention straight from the qkv projection (q/k
norm + RoPE, the window's K/V write and the attention in one launch), against its reference (the
two ops it fuses, with the window's keys past ``lens`` hidden), against the two Triton launches it
replaces, its errors, op registration, torch.compile, and on CUDA the served shapes and graph replay.
The caches are paged with shuffled page tables (tests/ops/test_cache_attention.py ``paged``), and the
paged layout is checked against the dense one bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.attention.cache_attention import cache_attention_triton
from lfmspark.ops.attention.kv_norm_rope_write import qkv_norm_rope_write_triton
from lfmspark.ops.attention.rope import rope_cos_sin_table
from lfmspark.ops.attention.window_attention import qkv_window_attention_reference, qkv_window_attention_triton
from lfmspark.ops.routing import window_attention
from env_vars import interpret_triton
from test_cache_attention import dense_layout, paged

EPS = 1e-5
LAYERS, SLOTS = 2, 4
LAYER = 1  # the last layer, so a wrong layer offset reads other random values


def _case(device: str, dtype: torch.dtype, B: int, T: int, n_q: int, n_kv: int, hd: int, S: int,
          starts: list[int], slots: list[int], lens: list[int], seed: int = 0, n_slots: int = SLOTS,
          page: int | None = None):
    """Random qkv (per-head scales), norm weights and paged caches of random values everywhere (reads
    or writes of wrong positions, pages, slots, layers or heads change the result); ``page``: default
    the largest of 16, 8, ... that divides ``S``, ``page == 0`` the dense layout."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.5 * torch.randn(B, T, n_q + 2 * n_kv, 1, generator=g))
    qkv = (torch.randn(B, T, n_q + 2 * n_kv, hd, generator=g) * scale).reshape(B, T, -1).to(device, dtype)
    q_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    k_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    cos_sin = rope_cos_sin_table(S + 8, hd, 1e6, device=device)
    k_cache = torch.randn(LAYERS, n_slots, S, n_kv, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(LAYERS, n_slots, S, n_kv, hd, generator=g).to(device, dtype)
    if page == 0:
        k_cache, v_cache, table = dense_layout(k_cache, v_cache)
    else:
        k_cache, v_cache, table = paged(k_cache, v_cache, page or math.gcd(S, 16), seed=seed + 1)
    idx = [torch.tensor(x, dtype=torch.int64, device=device) for x in (slots, starts, lens)]
    return qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, idx


def _run(fn, case, is_neox: bool, causal: bool, **kw):
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, (slots, start, lens) = case
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    hd = k_cache.shape[-1]
    out = fn(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, LAYER, slots, start, lens, EPS, is_neox, causal,
             hd ** -0.5, **kw)
    return out, k_cache, v_cache


def _two_launches(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, layer, slots, start, lens, eps, is_neox, causal,
                  scale, num_splits=None):
    q = qkv_norm_rope_write_triton(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, layer, slots, start, lens, eps,
                                   is_neox)
    return cache_attention_triton(q, k_cache, v_cache, table, layer, slots, start, causal, scale,
                                  num_splits=num_splits)


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    _, e = torch.frexp(torch.maximum(a.float().abs(), b.float().abs()))
    return float(((a.float() - b.float()).abs() / torch.ldexp(torch.ones_like(a, dtype=torch.float32), e - 8)).max())


def _check(device: str, dtype: torch.dtype, shape: tuple, is_neox: bool, causal: bool, num_splits: int | None,
           seed: int = 0, n_slots: int = SLOTS) -> None:
    case = _case(device, dtype, *shape, seed=seed, n_slots=n_slots)
    out, k_out, v_out = _run(qkv_window_attention_triton, case, is_neox, causal, num_splits=num_splits)
    ref, k_ref, v_ref = _run(qkv_window_attention_reference, case, is_neox, causal)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **_tol(dtype))
    slots = case[-1][0]
    assert (out[slots < 0] == 0).all(), "padding rows must be exactly zero"
    # the writes: the same positions as the reference's, the same values (bit-exact on CUDA up to
    # head_dim 64, as qkv_norm_rope_write: its sum of squares follows torch's CUDA reduction order
    # there, not at 128; the interpreter's reductions differ from torch's CPU ones in the last bit)
    changed = k_ref != case[4]
    assert bool(changed.any()) and torch.equal(k_out != case[4], changed)
    assert torch.equal(v_out, v_ref)
    if device == "cuda" and shape[4] <= 64:
        assert torch.equal(k_out, k_ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    else:
        assert _bf16_ulps(k_out[changed], k_ref[changed]) <= 1.0


# (B, T, n_q, n_kv, hd, S, starts, slots, lens)
_SHAPES = {
    # decode: one token, group 4; row 1's query is the cache's last position, row 2 pads
    "decode_g4": (3, 1, 8, 2, 64, 64, [5, 63, 9], [2, 0, -1], [1, 1, 1]),
    # verify-sized window, group 4 (40 rows); commit masks of 0 / part / all, no prefix in row 2
    "t10_g4_lens": (3, 10, 8, 2, 16, 200, [70, 130, 0], [1, 3, 0], [0, 7, 10]),
    # a window running past the cache end; odd head counts (6 over 3)
    "t5_clip_odd": (2, 5, 6, 3, 32, 40, [37, 12], [3, 1], [5, 5]),
    # the draft block's shape: 9 tokens, group 4, no padding
    "t9_g4": (2, 9, 8, 2, 16, 160, [140, 3], [0, 2], [9, 9]),
    # a full tile (16 tokens x group 4 = 64 rows) at head_dim 128
    "t16_g4_hd128": (1, 16, 4, 1, 128, 80, [30], [2], [16]),
    # group 8 (64 rows); row 0 starts past the cache (nothing written, the whole cache visible) with
    # lens past T
    "t8_g8_past_s": (2, 8, 8, 1, 16, 40, [45, 20], [1, 0], [12, 8]),
    # group 1, one token
    "t1_g1": (2, 1, 2, 2, 32, 24, [23, 0], [3, 0], [1, 1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", list(_SHAPES))
def test_kernel_matches_reference(triton_device: str, name: str, causal: bool, dtype: torch.dtype) -> None:
    _check(triton_device, dtype, _SHAPES[name], is_neox=True, causal=causal, num_splits=None, seed=len(name))


@pytest.mark.parametrize("num_splits", [1, 3, 9], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_forced_splits(triton_device: str, num_splits: int, is_neox: bool) -> None:
    # prefixes of 0, 3 and 250 keys (4 key blocks of 64): 9 splits are more slices than blocks, and
    # the window's owner (the last split) then has an empty slice of the prefix
    shape = (3, 3, 4, 1, 16, 256, [250, 3, 0], [1, 3, 2], [3, 2, 3])
    _check(triton_device, torch.float32, shape, is_neox, causal=True, num_splits=num_splits, seed=num_splits)


@pytest.mark.parametrize("causal, is_neox, num_splits", [(True, True, None), (False, False, 9), (True, False, 1)],
                         ids=["causal-neox-auto", "noncausal-interleaved-splits9", "causal-interleaved-splits1"])
def test_matches_the_two_launches(triton_device: str, causal: bool, is_neox: bool, num_splits: int | None) -> None:
    """Against qkv_norm_rope_write + cache_attention (the path it replaces): the same cache writes
    and queries, so the same outputs on every row before ``lens`` (the rows callers read)."""
    shape = (2, 10, 8, 2, 32, 128, [40, 100], [2, 0], [10, 6])
    case = _case(triton_device, torch.bfloat16, *shape, seed=3)
    out, k_out, v_out = _run(qkv_window_attention_triton, case, is_neox, causal, num_splits=num_splits)
    two, k_two, v_two = _run(_two_launches, case, is_neox, causal, num_splits=num_splits)
    assert torch.equal(k_out, k_two) and torch.equal(v_out, v_two)
    for b, n in enumerate(shape[-1]):
        if not causal and n < shape[1]:
            continue   # the two launches let a non-causal window see stale cache rows past lens
        torch.testing.assert_close(out[b, :n], two[b, :n], **_tol(torch.bfloat16))


def test_window_attention_route() -> None:
    assert window_attention(16, 32, 8) and window_attention(1, 32, 8) and window_attention(64, 4, 4)
    assert not window_attention(17, 32, 8) and not window_attention(33, 2, 1)


def test_errors() -> None:
    case = _case("cpu", torch.float32, 1, 17, 8, 2, 16, 64, [0], [0], [17])
    with pytest.raises(ValueError, match="more than 64 rows"):
        _run(qkv_window_attention_triton, case, True, True)
    case = _case("cpu", torch.float32, 1, 2, 8, 2, 8, 64, [0], [0], [2])
    with pytest.raises(ValueError, match="power of two >= 16"):
        _run(qkv_window_attention_triton, case, True, True)
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, idx = _case("cpu", torch.float32, 1, 2, 8, 2, 16, 64, [0], [0],
                                                                  [2])
    with pytest.raises(ValueError, match="share a dtype"):
        _run(qkv_window_attention_triton, (qkv, q_w, k_w, cos_sin, k_cache.half(), v_cache.half(), table, idx), True,
             True)
    for bad, message in ((table.long(), "int32"), (table[0], "2-D"),
                         (torch.stack([table, table], -1)[..., 0], r"stride\(1\) == 1"),
                         (table.to("meta"), "page_table is on meta")):
        with pytest.raises(ValueError, match=message):
            _run(qkv_window_attention_triton, (qkv, q_w, k_w, cos_sin, k_cache, v_cache, bad, idx), True, True)


# ---------------------------------------------------------------------------------------------
# op registration, torch.compile

def _op_args() -> tuple:
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, (slots, start, lens) = _case(
        "cpu", torch.float32, 2, 3, 4, 2, 16, 32, [4, 29], [1, -1], [3, 2])
    return (qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, LAYER, slots, start, lens, EPS, True, True, 0.25)


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.qkv_window_attention, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.qkv_window_attention, _op_args())


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, layer, slots, start, lens, eps, neox, causal, scale = _op_args()

    def attend(qkv, k_cache, v_cache):
        return torch.ops.lfmspark.qkv_window_attention(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, layer, slots,
                                                       start, lens, eps, neox, causal, scale)

    torch._dynamo.reset()
    k2, v2 = k_cache.clone(), v_cache.clone()
    compiled = torch.compile(attend, fullgraph=True)(qkv, k2, v2)
    eager = attend(qkv, k_cache, v_cache)
    assert torch.equal(compiled, eager) and torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


# ---------------------------------------------------------------------------------------------
# CUDA: LFM2.5-1.2B shapes (32 heads, 8 kv heads, head_dim 64, 8192 positions)

_GPU_STARTS, _GPU_SLOTS = [0, 511, 8191 - 10, 4000], [3, 0, 2, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,causal", [(1, True), (10, True), (9, False), (16, True)],
                         ids=["decode", "verify", "draft", "t16"])
@pytest.mark.parametrize("num_splits", [None, 1, 16], ids=["auto", "nosplit", "splits16"])
def test_gpu_served_shapes(dtype: torch.dtype, T: int, causal: bool, num_splits: int | None) -> None:
    lens = [T, T - T // 2, T, T]
    _check("cuda", dtype, (4, T, 32, 8, 64, 8192, _GPU_STARTS, _GPU_SLOTS, lens), True, causal, num_splits, seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_batches(B: int) -> None:
    # one slot per row, as the engine's (rows sharing a slot would read K/V another row writes)
    starts = [(997 * i) % 8000 for i in range(B)]
    slots = [i if i % 5 != 4 else -1 for i in range(B)]
    _check("cuda", torch.bfloat16, (B, 10, 32, 8, 64, 8192, starts, slots, [10] * B), True, True, None, seed=B,
           n_slots=B)


@pytest.mark.gpu
def test_gpu_cuda_graph_follows_indices() -> None:
    case = _case("cuda", torch.bfloat16, 2, 10, 32, 8, 64, 8192, [100, 6000], [1, 2], [10, 10])
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, (slots, start, lens) = case
    k_base, v_base = k_cache.clone(), v_cache.clone()

    def attend():
        return torch.ops.lfmspark.qkv_window_attention(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, LAYER, slots,
                                                       start, lens, EPS, True, True, 0.125)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()

    pages = table.clone()
    for i, (new_start, new_slots, new_lens) in enumerate([([100, 6000], [1, 2], [10, 4]),
                                                          ([8100, 3], [0, -1], [10, 10]),
                                                          ([0, 7777], [-1, 3], [0, 10])]):
        start.copy_(torch.tensor(new_start))
        slots.copy_(torch.tensor(new_slots))
        lens.copy_(torch.tensor(new_lens))
        table.copy_(pages.roll(i, dims=0))   # the table is read at replay too: other pages for each slot
        k_cache.copy_(k_base)
        v_cache.copy_(v_base)
        graph.replay()
        torch.cuda.synchronize()
        k_ref, v_ref = k_base.clone(), v_base.clone()
        ref = qkv_window_attention_reference(qkv, q_w, k_w, cos_sin, k_ref, v_ref, table, LAYER, slots, start, lens,
                                             EPS, True, True, 0.125)
        torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        assert (out[slots < 0] == 0).all()


# ---------------------------------------------------------------------------------------------
# the paged layout

# (B, T, n_q, n_kv, hd, S, starts, slots, lens): row 0's window (13-17) crosses a page of 16, row 2's
# prefix spans two 64-key blocks and its window runs past the slot end; row 1 pads, row 3 commits
# nothing. At hd 32 in fp32 the unsplit launch takes 128-key blocks: 32 pages of 4 in one block.
_PAGED = (4, 5, 4, 2, 32, 128, [13, 40, 123, 61], [2, -1, 3, 0], [5, 5, 5, 0])


def _logical(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A paged cache in slot order, ``[L, R, S, n_kv, hd]`` (the dense layout's view)."""
    return cache[:, table.long()].flatten(2, 3)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "splits3"])
@pytest.mark.parametrize("page", [16, 4], ids=lambda n: f"page{n}")
def test_paged_equals_dense_layout(triton_device: str, page: int, num_splits: int | None) -> None:
    """The same call on shuffled pages and on the dense layout (one page per slot, the identity
    table): the same output and cache bits, and physical pages no slot maps untouched."""
    dense = _case(triton_device, torch.float32, *_PAGED, seed=7, page=0)
    case = _case(triton_device, torch.float32, *_PAGED, seed=7, page=page)
    table = case[6]
    assert torch.equal(_logical(case[4], table), dense[4])   # the same cache contents
    out, k_out, v_out = _run(qkv_window_attention_triton, case, True, True, num_splits=num_splits)
    want, k_want, v_want = _run(qkv_window_attention_triton, dense, True, True, num_splits=num_splits)
    assert torch.equal(out, want)
    assert torch.equal(_logical(k_out, table), k_want) and torch.equal(_logical(v_out, table), v_want)
    spare = torch.ones(k_out.shape[1], dtype=torch.bool)
    spare[table.flatten().long()] = False
    assert torch.equal(k_out[:, spare], case[4][:, spare]) and torch.equal(v_out[:, spare], case[5][:, spare])


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "splits3"])
def test_writes_only_the_windows_positions(triton_device: str, num_splits: int | None) -> None:
    """Caches of NaN but for each row's prefix: the output is finite and the reference's, and exactly
    the window positions before ``lens`` (inside the slot) turn into numbers, in the table's pages."""
    page = 16
    qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, (slots, start, lens) = _case(
        triton_device, torch.float32, *_PAGED, seed=8, page=page)
    T, S = _PAGED[1], _PAGED[5]
    k_nan, v_nan = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    want = torch.zeros(k_cache.shape[:3], dtype=torch.bool, device=k_cache.device)   # [L, n_pages, page]
    for slot, s0, n in zip(slots.tolist(), start.tolist(), lens.tolist()):
        if slot < 0:
            continue
        for pos in range(min(s0 + min(n, T), S)):
            cell = (LAYER, table[slot, pos // page], pos % page)
            want[cell] = True
            if pos < s0:
                k_nan[cell], v_nan[cell] = k_cache[cell], v_cache[cell]
    case = (qkv, q_w, k_w, cos_sin, k_nan, v_nan, table, (slots, start, lens))
    out, k_out, v_out = _run(qkv_window_attention_triton, case, True, True, num_splits=num_splits)
    ref, k_ref, v_ref = _run(qkv_window_attention_reference, case, True, True)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, ref, **_tol(torch.float32))
    for got, exp in ((k_out, k_ref), (v_out, v_ref)):
        assert torch.equal(~torch.isnan(got), want[..., None, None].expand_as(got))
        assert torch.equal(~torch.isnan(exp), want[..., None, None].expand_as(exp))
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(v_out.nan_to_num(), v_ref.nan_to_num())
