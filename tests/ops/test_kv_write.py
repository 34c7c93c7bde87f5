"""``lfmspark::kv_write``: the Triton kernel (interpreter on CPU, native on CUDA) against the
reference and an independent index walk; registration checks, torch.compile, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.kv_write import kv_write_reference, kv_write_triton

SENTINEL = -512.0


def case(device: str, dtype: torch.dtype, B: int, T: int, n_kv: int, hd: int, S: int = 24, L: int = 3,
         n_slots: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, n_kv, hd, generator=g).to(device, dtype)
    v = torch.randn(B, T, n_kv, hd, generator=g).to(device, dtype)
    caches = [torch.full((L, n_slots, S, n_kv, hd), SENTINEL, dtype=dtype, device=device) for _ in range(2)]
    return k, v, caches


def expected(k, v, caches, layer, slots, start, lens):
    """Plain index walk, independent of the op's helpers."""
    kc, vc = (c.clone() for c in caches)
    S = kc.shape[2]
    for b, (slot, s0, n) in enumerate(zip(slots, start, lens)):
        for t in range(min(n, k.shape[1])):
            if slot >= 0 and s0 + t < S:
                kc[layer, slot, s0 + t] = k[b, t]
                vc[layer, slot, s0 + t] = v[b, t]
    return kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B, T, n_kv, hd", [(4, 1, 2, 64), (3, 10, 8, 64), (2, 7, 1, 16), (5, 3, 3, 128)])
def test_kernel_matches_reference(triton_device, dtype, B, T, n_kv, hd):
    k, v, caches = case(triton_device, dtype, B, T, n_kv, hd, seed=B * T)
    slots = [4, -1, 0, 2, 1][:B]
    start = [0, 3, 20, 5, 23][:B]                 # rows 2 and 4 run past the cache end (S = 24)
    lens = [T, T, T, max(T - 1, 0), T][:B]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=triton_device)  # noqa: E731
    want = expected(k, v, caches, 1, slots, start, lens)
    got_kernel = [c.clone() for c in caches]
    kv_write_triton(k, v, *got_kernel, 1, t(slots), t(start), t(lens))
    got_ref = [c.clone() for c in caches]
    kv_write_reference(k, v, *got_ref, 1, t(slots), t(start), t(lens))
    for a, b, c in zip(got_kernel, got_ref, want):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_strided_inputs(triton_device):
    """K and V as views of a fused qkv projection (token stride > row) are handled."""
    qkv = torch.randn(2, 4, 3 * 2 * 16, device=triton_device)
    k = qkv[..., 32:64].view(2, 4, 2, 16)
    v = qkv[..., 64:].view(2, 4, 2, 16)
    caches = [torch.zeros(1, 2, 8, 2, 16, device=triton_device) for _ in range(2)]
    idx = torch.tensor([1, 0], device=triton_device)
    kv_write_triton(k, v, *caches, 0, idx, torch.tensor([0, 2], device=triton_device),
                    torch.tensor([4, 4], device=triton_device))
    assert torch.equal(caches[0][0, 1, :4], k[0]) and torch.equal(caches[1][0, 0, 2:6], v[1])


@pytest.mark.parametrize("triton_cpu", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch, triton_cpu):
    if triton_cpu:
        monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    k, v, caches = case("cpu", torch.float32, 3, 4, 2, 16)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    torch.library.opcheck(torch.ops.lfmspark.kv_write, (k, v, *caches, 2, t([1, -1, 3]), t([0, 2, 5]), t([4, 4, 2])))


def test_torch_compile_matches_eager(monkeypatch):
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    k, v, caches = case("cpu", torch.float32, 3, 4, 2, 16)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    args = (t([1, -1, 3]), t([0, 2, 5]), t([4, 4, 2]))

    def step(k, v, kc, vc, slots, start, lens):
        torch.ops.lfmspark.kv_write(k * 2, v + 1, kc, vc, 0, slots, start, lens)
        return kc.sum()

    eager = [c.clone() for c in caches]
    step(k, v, *eager, *args)
    compiled = [c.clone() for c in caches]
    torch.compile(step, fullgraph=True, dynamic=False)(k, v, *compiled, *args)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_indices():
    k, v, caches = case("cuda", torch.bfloat16, 4, 10, 8, 64, S=64)
    slots = torch.tensor([0, 1, 2, 3], device="cuda")
    start = torch.zeros(4, dtype=torch.int64, device="cuda")
    lens = torch.full((4,), 10, device="cuda")
    kv_write_triton(k, v, *caches, 0, slots, start, lens)       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_write_triton(k, v, *caches, 2, slots, start, lens)
    slots.copy_(torch.tensor([4, -1, 3, 0], device="cuda"))
    start.copy_(torch.tensor([5, 0, 50, 1], device="cuda"))
    lens.copy_(torch.tensor([10, 10, 10, 3], device="cuda"))
    before = [c.clone() for c in caches]
    graph.replay()
    want = expected(k, v, before, 2, [4, -1, 3, 0], [5, 0, 50, 1], [10, 10, 10, 3])
    for a, b in zip(caches, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_cache_past_2_pow_31_elements():
    """Layer offsets beyond 2^31 elements (6 layers x 64 slots x 512k positions x 16) are addressed
    in 64 bits: the last layer's write lands where the reference puts it."""
    L, n_slots, S, n_kv, hd = 6, 64, 1 << 19, 1, 16
    assert (L - 1) * n_slots * S * n_kv * hd >= 2**31
    caches = [torch.zeros(L, n_slots, S, n_kv, hd, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    k = torch.randn(2, 3, n_kv, hd, device="cuda").bfloat16()
    v = torch.randn_like(k)
    slots = torch.tensor([63, 5], device="cuda")
    start = torch.tensor([S - 3, 7], device="cuda")
    lens = torch.tensor([3, 3], device="cuda")
    kv_write_triton(k, v, *caches, L - 1, slots, start, lens)
    assert torch.equal(caches[0][L - 1, 63, S - 3:], k[0]) and torch.equal(caches[1][L - 1, 5, 7:10], v[1])
    assert int((caches[0] != 0).sum()) == int((k != 0).sum())     # nothing written anywhere else
