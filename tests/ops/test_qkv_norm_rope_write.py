"""``lfmspark::qkv_norm_rope_write``: the target attention's q/k norm + RoPE and K/V write in one
kernel, against its reference (interpreter on CPU, bit-exact on CUDA like kv_norm_rope_write), and
the reference against the unfused module path it replaces (models/layers.py ``RMSNorm``,
ops/attention/rope.py, a plain K/V cache write). The caches are paged with shuffled page tables
(tests/ops/test_cache_attention.py ``shuffled_table``), checked against the dense layout bit for bit."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.attention.kv_norm_rope_write import qkv_norm_rope_write_reference, qkv_norm_rope_write_triton
from lfmspark.ops.attention.rope import apply_rope, gather_cos_sin, rope_cos_sin_table, window_positions
from env_vars import interpret_triton
from test_cache_attention import shuffled_table

EPS = 1e-5
SENTINEL = -768.0


def _write_kv(k, v, k_cache, v_cache, table, layer, slots, start, lens) -> None:
    """The K/V write, token by token: the first ``lens[b]`` tokens of each real row (slot >= 0) at
    positions ``start[b] + t`` below the slot length, through the page table."""
    page = k_cache.shape[2]
    for b in range(k.shape[0]):
        for t in range(int(lens[b])):
            pos = int(start[b]) + t
            if int(slots[b]) >= 0 and pos < table.shape[1] * page:
                cell = (layer, int(table[slots[b], pos // page]), pos % page)
                k_cache[cell] = k[b, t].to(k_cache.dtype)
                v_cache[cell] = v[b, t].to(v_cache.dtype)


def _case(device: str, dtype: torch.dtype, B: int, T: int, n_q: int, n_kv: int, hd: int, S: int, slots, start,
          lens, seed: int = 0, layers: int = 2, layer: int = 1, page: int = 4, dense: bool = False):
    """Random inputs, a page table (shuffled pages of ``page`` positions and two unmapped pages, or with
    ``dense`` one page per slot and the identity table) and a maker of sentinel-filled caches."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(B, T, n_q + 2 * n_kv, 1, generator=g))     # per-head scales
    qkv = (torch.randn(B, T, n_q + 2 * n_kv, hd, generator=g) * scale).reshape(B, T, -1).to(device, dtype)
    q_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    k_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    cos_sin = rope_cos_sin_table(S + 8, hd, 1e6, device=device)
    idx = [torch.tensor(x, dtype=torch.int64, device=device) for x in (slots, start, lens)]
    if dense:
        table, n_pages, page = torch.arange(4, dtype=torch.int32, device=device)[:, None], 4, S
    else:
        table, n_pages = shuffled_table(4, S // page, seed).to(device), 4 * (S // page) + 2
    shape = (layers, n_pages, page, n_kv, hd)
    caches = lambda: (torch.full(shape, SENTINEL, dtype=dtype, device=device),  # noqa: E731
                      torch.full(shape, SENTINEL, dtype=dtype, device=device))
    return qkv, q_w, k_w, cos_sin, caches, table, idx, layer


def _run(fn, case, is_neox: bool):
    qkv, q_w, k_w, cos_sin, caches, table, (slots, start, lens), layer = case
    k_cache, v_cache = caches()
    q = fn(qkv, q_w, k_w, cos_sin, k_cache, v_cache, table, layer, slots, start, lens, EPS, is_neox)
    return q, k_cache, v_cache


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    _, e = torch.frexp(torch.maximum(a.float().abs(), b.float().abs()))
    return float(((a.float() - b.float()).abs() / torch.ldexp(torch.ones_like(a, dtype=torch.float32), e - 8)).max())


_SHAPES = {
    # decode: one token, LFM2's group of 4 at a small head count; a padding row
    "t1": (3, 1, 8, 2, 64, 32, [2, -1, 0], [5, 0, 31], [1, 1, 1]),
    # verify-sized window crossing the cache end, commit masks of 0 / part / all
    "t10": (3, 10, 4, 1, 16, 24, [1, 3, 0], [0, 2, 20], [0, 7, 10]),
    # three kv heads and six query heads (not powers of two)
    "t3_odd": (2, 3, 6, 3, 32, 16, [0, 1], [5, 0], [3, 2]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("name", list(_SHAPES))
def test_kernel_matches_reference(triton_device: str, name: str, is_neox: bool, dtype: torch.dtype) -> None:
    case = _case(triton_device, dtype, *_SHAPES[name], seed=len(name) + 2 * is_neox)
    q_ref, k_ref, v_ref = _run(qkv_norm_rope_write_reference, case, is_neox)
    q_out, k_out, v_out = _run(qkv_norm_rope_write_triton, case, is_neox)
    assert q_out.shape == q_ref.shape and q_out.dtype == q_ref.dtype
    written = k_ref != SENTINEL
    assert bool(written.any()) and torch.equal(k_out != SENTINEL, written)   # the same rows, nothing else
    assert torch.equal(v_out, v_ref)
    if triton_device == "cuda":
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    else:   # the interpreter's reductions differ from torch's CPU ones in the last fp32 bit
        assert _bf16_ulps(q_out, q_ref) <= 1.0 and _bf16_ulps(k_out[written], k_ref[written]) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_unfused_attention_path(dtype: torch.dtype) -> None:
    """What Lfm2Attention computed before the op: RMSNorm modules, RoPE in fp32 with one rounding,
    the K/V write of the first lens[b] tokens."""
    B, T, n_q, n_kv, hd, S, slots, start, lens = _SHAPES["t10"]
    qkv, q_w, k_w, cos_sin, caches, table, (slots, start, lens), layer = case = _case(
        "cpu", dtype, B, T, n_q, n_kv, hd, S, slots, start, lens, seed=5)
    q_norm, k_norm = RMSNorm(hd, EPS), RMSNorm(hd, EPS)
    q_norm.weight.data, k_norm.weight.data = q_w.clone(), k_w.clone()
    q, k, v = qkv.split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = gather_cos_sin(cos_sin, window_positions(start, T))
    cos, sin = cos[:, :, None], sin[:, :, None]
    with torch.no_grad():
        q_want = apply_rope(q_norm(q.reshape(B, T, n_q, hd)).float(), cos, sin, True).to(dtype)
        k_want = apply_rope(k_norm(k.reshape(B, T, n_kv, hd)).float(), cos, sin, True).to(dtype)
    k_cache, v_cache = caches()
    _write_kv(k_want, v.reshape(B, T, n_kv, hd), k_cache, v_cache, table, layer, slots, start, lens)
    q_got, k_got, v_got = _run(qkv_norm_rope_write_reference, case, True)
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_cache) and torch.equal(v_got, v_cache)


def test_bad_width_is_refused() -> None:
    qkv, q_w, k_w, cos_sin, caches, table, (slots, start, lens), layer = _case("cpu", torch.float32, *_SHAPES["t1"])
    with pytest.raises(ValueError, match="qkv width"):
        torch.ops.lfmspark.qkv_norm_rope_write(qkv[..., :-8], q_w, k_w, cos_sin, *caches(), table, layer, slots,
                                               start, lens, EPS, True)


def test_page_table_is_checked() -> None:
    qkv, q_w, k_w, cos_sin, caches, table, (slots, start, lens), layer = _case("cpu", torch.float32, *_SHAPES["t1"])
    for bad, message in ((table.long(), "int32"), (table[0], "2-D"),
                         (torch.stack([table, table], -1)[..., 0], r"stride\(1\) == 1"),
                         (table.to("meta"), "page_table is on meta")):
        with pytest.raises(ValueError, match=message):
            qkv_norm_rope_write_triton(qkv, q_w, k_w, cos_sin, *caches(), bad, layer, slots, start, lens, EPS, True)


def test_opcheck(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    qkv, q_w, k_w, cos_sin, caches, table, (slots, start, lens), layer = _case(triton_device, torch.float32,
                                                                                *_SHAPES["t3_odd"])
    torch.library.opcheck(torch.ops.lfmspark.qkv_norm_rope_write,
                          (qkv, q_w, k_w, cos_sin, *caches(), table, layer, slots, start, lens, EPS, True))


@pytest.mark.parametrize("page", [16, 4], ids=lambda n: f"page{n}")
def test_paged_equals_dense_layout(triton_device: str, page: int) -> None:
    """The same call on shuffled pages and on the dense layout (one page per slot, the identity
    table), fp32: the same queries and the same bits in every slot position, pages no slot maps
    untouched. Pages of 16 split row 0's window (13-18), row 1's runs past the slot end, row 2 pads;
    pages of 4 split every window."""
    shape = (3, 6, 4, 2, 16, 32, [1, 3, -1], [13, 28, 0], [6, 6, 6])
    case = _case(triton_device, torch.float32, *shape, seed=4, page=page)
    q_out, k_out, v_out = _run(qkv_norm_rope_write_triton, case, True)
    q_want, k_want, v_want = _run(qkv_norm_rope_write_triton, _case(triton_device, torch.float32, *shape, seed=4,
                                                                    dense=True), True)
    table = case[5].long()
    assert torch.equal(q_out, q_want)
    assert torch.equal(k_out[:, table].flatten(2, 3), k_want) and torch.equal(v_out[:, table].flatten(2, 3), v_want)
    unmapped = torch.ones(k_out.shape[1], dtype=torch.bool, device=k_out.device)
    unmapped[table.flatten()] = False
    assert bool((k_out[:, unmapped] == SENTINEL).all()) and bool((v_out[:, unmapped] == SENTINEL).all())
    assert bool((k_want != SENTINEL).any())


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (16, 10), (2, 300)])
def test_gpu_bit_exact_at_lfm2_shapes(B: int, T: int) -> None:
    """LFM2.5-1.2B's attention: 32 query heads, 8 kv heads, head_dim 64, bf16."""
    g = torch.Generator().manual_seed(B * 1000 + T)
    slots = torch.randperm(4, generator=g)[:min(B, 4)].tolist() + [-1] * max(0, B - 4)
    start = torch.randint(0, 200, (B,), generator=g).tolist()
    lens = torch.randint(0, T + 1, (B,), generator=g).tolist()
    case = _case("cuda", torch.bfloat16, B, T, 32, 8, 64, 512, slots, start, lens, seed=B + T, page=16)
    q_ref, k_ref, v_ref = _run(qkv_norm_rope_write_reference, case, True)
    q_out, k_out, v_out = _run(torch.ops.lfmspark.qkv_norm_rope_write, case, True)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
