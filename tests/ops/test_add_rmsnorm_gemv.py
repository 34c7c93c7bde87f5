"""``lfmspark::add_rmsnorm_gemv``: the Triton kernel (interpreter on CPU, native on CUDA) against
plain-PyTorch formulations of residual add + RMSNorm + GEMV (+ SwiGLU).

Two oracles:

- ``_emulated``: the op's arithmetic written out in PyTorch with the kernel's rounding points
  (the sum, the normalised row, the weighted row, the products; for SwiGLU the sum times the norm
  weight, the row-scaled products, gate, up, silu and the product). Under Triton's CPU interpreter a
  cast to bf16 truncates instead of rounding to nearest, so on CPU the emulation truncates too; on
  CUDA it rounds (for the plain product, the module composition). Only summation orders differ, so
  the kernel is held to tight bounds (``s`` bit-exact).
- the module composition (models/layers.py ``RMSNorm``, ``F.linear``, ``silu(gate) * up``), which the
  op's reference reproduces bit for bit for the plain product (SwiGLU: the several-row verify's
  epilogue pair instead, ops/linear/add_rmsnorm_gemv.py), and the kernel up to bf16 noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.linear.add_rmsnorm_gemv import MAX_K, add_rmsnorm_gemv_reference, add_rmsnorm_gemv_triton
from env_vars import interpret_triton, set_env

# bound on the relative error of y against the emulation (summation order only; for bf16 a few
# outputs may land one ulp apart) and against the fp64 / module composition (bf16 rounding noise)
TIGHT = {torch.float32: 2e-6, torch.bfloat16: 4e-3}
LOOSE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _inputs(device: str, dtype: torch.dtype, N: int, K: int, swiglu: bool, with_delta: bool, seed: int = 0):
    """``h`` with a non-unit scale (so the norm matters), ``delta``, a norm weight around 1 and a
    weight of ``N`` rows (``2N`` stacked gate/up rows with ``swiglu``)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(1, K, generator=g) * 3 + 0.5).to(device, dtype)
    delta = (torch.randn(1, K, generator=g) * 2).to(device, dtype) if with_delta else None
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).to(device, dtype)
    weight = (torch.randn(2 * N if swiglu else N, K, generator=g) / K ** 0.5).to(device, dtype)
    return h, delta, norm_weight, weight


def _cast(x32: torch.Tensor, dtype: torch.dtype, truncate: bool) -> torch.Tensor:
    """fp32 -> dtype as the kernel's ``.to(dtype)`` does where it runs."""
    if dtype == torch.float32:
        return x32
    if truncate:                                   # the interpreter: bf16 keeps the top 16 bits
        assert dtype == torch.bfloat16
        return (x32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x32.to(dtype)


def _emulated(h, delta, norm_weight, eps, weight, swiglu, scale_last=False):
    dtype, truncate = h.dtype, h.device.type == "cpu"
    s = h if delta is None else _cast(h.float() + delta.float(), dtype, truncate)
    x32 = s.float()
    inv = torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) / x32.shape[-1] + eps)
    if scale_last:  # the several-row verify's roundings: s * weight rounded, the row scale on the sums
        xv = _cast(norm_weight.float() * x32, dtype, truncate)
        y = (xv.double() @ weight.double().T) * inv.double()
    else:
        xn = _cast(x32 * inv, dtype, truncate)
        xv = _cast(norm_weight.float() * xn.float(), dtype, truncate)
        y = xv.double() @ weight.double().T
    if not swiglu:
        return s, _cast(y.float(), dtype, truncate)
    gate, up = (_cast(t.float(), dtype, truncate).float() for t in y.chunk(2, dim=-1))
    act = _cast(gate / (1 + torch.exp(-gate)), dtype, truncate).float()
    return s, _cast(act * up, dtype, truncate)


def _composition(h, delta, norm_weight, eps, weight, swiglu):
    """The model's unfused modules: residual add, models/layers.py ``RMSNorm``, ``F.linear`` (+ SwiGLU)."""
    norm = RMSNorm(h.shape[-1], eps).to(h.device, h.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
        s = h if delta is None else h + delta
        y = F.linear(norm(s), weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return s, y


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("swiglu, scale_last", [(False, False), (True, False), (True, True), (False, True)],
                         ids=["plain", "swiglu", "swiglu_scale_last", "plain_scale_last"])
@pytest.mark.parametrize("N, K, eps", [(37, 1000, 1e-5), (21, 64, 1e-6), (64, 2048, 1e-5), (6, 40, 4.0)],
                         ids=["K1000", "K64", "K2048", "big_eps"])
def test_kernel_matches_reference(triton_device, dtype, with_delta, swiglu, scale_last, N, K, eps):
    h, delta, norm_weight, weight = _inputs(triton_device, dtype, N, K, swiglu, with_delta, seed=N + K)
    s, y = add_rmsnorm_gemv_triton(h, delta, norm_weight, eps, weight, swiglu, scale_last)
    assert s.shape == (1, K) and s.dtype == dtype and y.shape == (1, N) and y.dtype == dtype
    want_s, want_y = _emulated(h, delta, norm_weight, eps, weight, swiglu, scale_last)
    assert torch.equal(s, want_s)
    assert _rel_err(y, want_y) < TIGHT[dtype]
    assert _rel_err(y, _composition(h, delta, norm_weight, eps, weight, swiglu)[1]) < LOOSE[dtype]
    if delta is None:
        assert s.data_ptr() != h.data_ptr()                 # a fresh tensor, not h


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("block_n, num_warps", [(1, None), (2, 4), (8, None), (16, 8)])
def test_launch_overrides_compute_the_same(triton_device, swiglu, block_n, num_warps):
    # N = 43: not a multiple of any block_n > 1; SwiGLU with the epilogue pair's roundings
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 43, 300, swiglu, True, seed=3)
    s, y = add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, swiglu, swiglu, block_n=block_n,
                                   num_warps=num_warps)
    want_s, want_y = _emulated(h, delta, norm_weight, 1e-5, weight, swiglu, swiglu)
    assert torch.equal(s, want_s)
    assert _rel_err(y, want_y) < TIGHT[torch.float32]


def test_largest_k(triton_device):
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 3, MAX_K, False, True, seed=5)
    s, y = add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, False)
    want_s, want_y = _emulated(h, delta, norm_weight, 1e-5, weight, False)
    assert torch.equal(s, want_s) and _rel_err(y, want_y) < TIGHT[torch.float32]


def test_fp16(triton_device):
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float16, 24, 200, True, True, seed=6)
    s, y = add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, True)
    want_s, want_y = _composition(h, delta, norm_weight, 1e-5, weight, True)
    assert s.dtype == y.dtype == torch.float16
    assert _rel_err(s, want_s) < 1e-3 and _rel_err(y, want_y) < LOOSE[torch.float16]


def test_gate_and_up_halves_are_not_swapped(triton_device):
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 16, 64, True, True, seed=7)
    weight[16:] = 0                                        # up = 0: the output vanishes
    assert torch.equal(add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, True)[1],
                       torch.zeros(1, 16, device=triton_device))
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 16, 64, True, True, seed=8)
    x = _emulated(h, delta, norm_weight, 1e-5, weight, False)[0]
    xn = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    weight[16:] = 0
    weight[16:, 0] = 1 / xn[0, 0]                          # up = 1 in every column: out = silu(gate)
    gate = xn @ weight[:16].T
    torch.testing.assert_close(add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, True)[1], F.silu(gate),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_reference_is_the_module_composition(dtype, swiglu, with_delta):
    """Bit for bit: the CPU implementation is what the unfused model computes; with ``scale_last``
    (SwiGLU), what the several-row verify's epilogue pair computes (models/layers.py
    ``project_norm_feed_forward``, its inputs made here as its producer makes them), which the
    modules match to bf16 noise."""
    h, delta, norm_weight, weight = _inputs("cpu", dtype, 24, 96, swiglu, with_delta, seed=9)
    s, y = add_rmsnorm_gemv_reference(h, delta, norm_weight, 1e-5, weight, swiglu)
    want_s, want_y = _composition(h, delta, norm_weight, 1e-5, weight, swiglu)
    assert torch.equal(s, want_s) and torch.equal(y, want_y)
    op_s, op_y = torch.ops.lfmspark.add_rmsnorm_gemv(h, delta, norm_weight, 1e-5, weight, swiglu)
    assert torch.equal(op_s, want_s) and torch.equal(op_y, want_y)
    if swiglu:
        s_last, y_last = add_rmsnorm_gemv_reference(h, delta, norm_weight, 1e-5, weight, True, True)
        scaled = (s.float() * norm_weight.float()).to(dtype)
        pair = torch.ops.lfmspark.skinny_swiglu(scaled, weight, s.float().pow(2).sum(-1)[None, :], 1e-5)
        assert torch.equal(s_last, want_s) and torch.equal(y_last, pair)
        assert _rel_err(y_last, want_y) < LOOSE[dtype]


def test_n_zero(triton_device):
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 0, 32, False, True)
    s, y = add_rmsnorm_gemv_triton(h, delta, norm_weight, 1e-5, weight, False)
    assert y.shape == (1, 0) and torch.equal(s, h + delta)


def _bad(**changes):
    h, delta, norm_weight, weight = _inputs("cpu", torch.float32, 6, 16, False, True)
    args = dict(h=h, delta=delta, norm_weight=norm_weight, eps=1e-5, weight=weight, swiglu=False)
    args.update(changes)
    return args


@pytest.mark.parametrize("triton_on_cpu", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("changes, match", [
    (dict(h=torch.randn(2, 16), delta=torch.randn(2, 16)), r"one row h \[1, K\], got h of shape \(2, 16\)"),
    (dict(h=torch.randn(16), delta=None), "one row"),
    (dict(weight=torch.randn(6, 12)), r"weight \[N, K\]"),
    (dict(delta=torch.randn(1, 12)), "delta must have h's shape"),
    (dict(norm_weight=torch.randn(12)), r"norm_weight must be \[K\]"),
    (dict(h=torch.randn(1, MAX_K + 1), delta=None, norm_weight=torch.randn(MAX_K + 1),
          weight=torch.randn(2, MAX_K + 1)), r"K <= 8192.*K = 8193"),
    (dict(swiglu=True, weight=torch.randn(5, 16)), "stack gate and up"),
    (dict(weight=torch.randn(6, 16, dtype=torch.bfloat16)), "h and weight must share a dtype"),
    (dict(delta=torch.randn(1, 16, dtype=torch.float16)), "h and delta must share a dtype"),
    (dict(h=torch.ones(1, 16, dtype=torch.int32), delta=None), "bf16, fp16 or fp32"),
    (dict(weight=torch.randn(16, 6).T), r"weight must be contiguous along K"),
    (dict(h=torch.randn(1, 32)[:, ::2]), r"h must be contiguous along K"),
])
def test_rejects_bad_inputs(monkeypatch, triton_on_cpu, changes, match):
    if triton_on_cpu:
        interpret_triton(monkeypatch)
    with pytest.raises(ValueError, match=match):
        torch.ops.lfmspark.add_rmsnorm_gemv(**_bad(**changes))


def test_rejects_bad_block_n():
    with pytest.raises(ValueError, match="power of two"):
        add_rmsnorm_gemv_triton(**_bad(), block_n=3)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("triton_on_cpu", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch, triton_on_cpu, with_delta, swiglu):
    if triton_on_cpu:
        interpret_triton(monkeypatch)
    h, delta, norm_weight, weight = _inputs("cpu", torch.float32, 12, 96, swiglu, with_delta)
    torch.library.opcheck(torch.ops.lfmspark.add_rmsnorm_gemv, (h, delta, norm_weight, 1e-5, weight, swiglu))


@pytest.mark.gpu
@pytest.mark.parametrize("N, K, swiglu", [(6144, 2048, False), (3072, 2048, False), (65536, 2048, False),
                                          (8192, 2048, True), (4608, 1024, True), (3072, 1024, False)])
def test_gpu_served_shapes(N, K, swiglu):
    h, delta, norm_weight, weight = _inputs("cuda", torch.bfloat16, N, K, swiglu, True)
    s, y = torch.ops.lfmspark.add_rmsnorm_gemv(h, delta, norm_weight, 1e-5, weight, swiglu)
    want_s, want_y = _emulated(h, delta, norm_weight, 1e-5, weight, swiglu)   # rounding on CUDA
    assert torch.equal(s, want_s) and torch.equal(s, h + delta)
    assert _rel_err(y, want_y) < TIGHT[torch.bfloat16]
    assert _rel_err(y, _composition(h, delta, norm_weight, 1e-5, weight, swiglu)[1]) < LOOSE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_pdl_graph_replay_is_bit_exact(monkeypatch):
    """Back-to-back fused ops, each reading both outputs of its predecessor (the residual carry
    of a decode step), replayed from a CUDA graph with PDL: bit-exact against PDL off (a kernel
    reading h or delta before gdc_wait would see stale data in the replay; see tests/ops/test_pdl.py)."""
    from lfmspark.ops._dispatch import use_pdl

    K = 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    norms = [1 + 0.2 * torch.randn(K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(12)]
    weights = [(torch.randn((2 if i % 3 == 2 else 1) * K, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
               for i in range(12)]
    h0 = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)

    def chain():
        h, delta = h0, None
        for i, (nw, w) in enumerate(zip(norms, weights)):
            h, delta = torch.ops.lfmspark.add_rmsnorm_gemv(h, delta, nw, 1e-5, w, i % 3 == 2)
        return h, delta

    set_env(monkeypatch, PDL="0")
    want = chain()
    set_env(monkeypatch, PDL="1")
    assert use_pdl(h0), "the GPU supports PDL (sm_90 or newer)"
    chain()                                   # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    assert want[1].abs().max() > 0.1
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
