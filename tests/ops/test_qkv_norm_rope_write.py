"""``lfmspark::qkv_norm_rope_write``: the target attention's q/k norm + RoPE and K/V write in one
kernel, against its reference (interpreter on CPU, bit-exact on CUDA like kv_norm_rope_write), and
the reference against the unfused module path it replaces (models/layers.py ``RMSNorm``,
ops/attention/rope.py, a plain K/V cache write)."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.attention.kv_norm_rope_write import qkv_norm_rope_write_reference, qkv_norm_rope_write_triton
from lfmspark.ops.attention.rope import apply_rope, gather_cos_sin, rope_cos_sin_table, window_positions
from env_vars import interpret_triton

EPS = 1e-5
SENTINEL = -768.0


def _write_kv(k, v, k_cache, v_cache, layer, slots, start, lens) -> None:
    """The K/V write, token by token: the first ``lens[b]`` tokens of each real row (slot >= 0) at
    positions ``start[b] + t`` inside the cache."""
    for b in range(k.shape[0]):
        for t in range(int(lens[b])):
            pos = int(start[b]) + t
            if int(slots[b]) >= 0 and pos < k_cache.shape[2]:
                k_cache[layer, slots[b], pos] = k[b, t].to(k_cache.dtype)
                v_cache[layer, slots[b], pos] = v[b, t].to(v_cache.dtype)


def _case(device: str, dtype: torch.dtype, B: int, T: int, n_q: int, n_kv: int, hd: int, S: int, slots, start,
          lens, seed: int = 0, layers: int = 2, layer: int = 1):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(B, T, n_q + 2 * n_kv, 1, generator=g))     # per-head scales
    qkv = (torch.randn(B, T, n_q + 2 * n_kv, hd, generator=g) * scale).reshape(B, T, -1).to(device, dtype)
    q_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    k_w = (1.0 + 0.5 * torch.randn(hd, generator=g)).to(device, dtype)
    cos_sin = rope_cos_sin_table(S + 8, hd, 1e6, device=device)
    idx = [torch.tensor(x, dtype=torch.int64, device=device) for x in (slots, start, lens)]
    shape = (layers, 4, S, n_kv, hd)
    caches = lambda: (torch.full(shape, SENTINEL, dtype=dtype, device=device),  # noqa: E731
                      torch.full(shape, SENTINEL, dtype=dtype, device=device))
    return qkv, q_w, k_w, cos_sin, caches, idx, layer


def _run(fn, case, is_neox: bool):
    qkv, q_w, k_w, cos_sin, caches, (slots, start, lens), layer = case
    k_cache, v_cache = caches()
    q = fn(qkv, q_w, k_w, cos_sin, k_cache, v_cache, layer, slots, start, lens, EPS, is_neox)
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
    qkv, q_w, k_w, cos_sin, caches, (slots, start, lens), layer = case = _case("cpu", dtype, B, T, n_q, n_kv, hd, S,
                                                                              slots, start, lens, seed=5)
    q_norm, k_norm = RMSNorm(hd, EPS), RMSNorm(hd, EPS)
    q_norm.weight.data, k_norm.weight.data = q_w.clone(), k_w.clone()
    q, k, v = qkv.split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
    cos, sin = gather_cos_sin(cos_sin, window_positions(start, T))
    cos, sin = cos[:, :, None], sin[:, :, None]
    with torch.no_grad():
        q_want = apply_rope(q_norm(q.reshape(B, T, n_q, hd)).float(), cos, sin, True).to(dtype)
        k_want = apply_rope(k_norm(k.reshape(B, T, n_kv, hd)).float(), cos, sin, True).to(dtype)
    k_cache, v_cache = caches()
    _write_kv(k_want, v.reshape(B, T, n_kv, hd), k_cache, v_cache, layer, slots, start, lens)
    q_got, k_got, v_got = _run(qkv_norm_rope_write_reference, case, True)
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_cache) and torch.equal(v_got, v_cache)


def test_bad_width_is_refused() -> None:
    qkv, q_w, k_w, cos_sin, caches, (slots, start, lens), layer = _case("cpu", torch.float32, *_SHAPES["t1"])
    with pytest.raises(ValueError, match="qkv width"):
        torch.ops.lfmspark.qkv_norm_rope_write(qkv[..., :-8], q_w, k_w, cos_sin, *caches(), layer, slots, start,
                                               lens, EPS, True)


def test_opcheck(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    qkv, q_w, k_w, cos_sin, caches, (slots, start, lens), layer = _case(triton_device, torch.float32, *_SHAPES["t3_odd"])
    torch.library.opcheck(torch.ops.lfmspark.qkv_norm_rope_write,
                          (qkv, q_w, k_w, cos_sin, *caches(), layer, slots, start, lens, EPS, True))


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (16, 10), (2, 300)])
def test_gpu_bit_exact_at_lfm2_shapes(B: int, T: int) -> None:
    """LFM2.5-1.2B's attention: 32 query heads, 8 kv heads, head_dim 64, bf16."""
    g = torch.Generator().manual_seed(B * 1000 + T)
    slots = torch.randperm(4, generator=g)[:min(B, 4)].tolist() + [-1] * max(0, B - 4)
    start = torch.randint(0, 200, (B,), generator=g).tolist()
    lens = torch.randint(0, T + 1, (B,), generator=g).tolist()
    case = _case("cuda", torch.bfloat16, B, T, 32, 8, 64, 512, slots, start, lens, seed=B + T)
    q_ref, k_ref, v_ref = _run(qkv_norm_rope_write_reference, case, True)
    q_out, k_out, v_out = _run(torch.ops.lfmspark.qkv_norm_rope_write, case, True)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
