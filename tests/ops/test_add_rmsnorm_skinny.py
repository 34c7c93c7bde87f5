"""``lfmspark::add_rmsnorm_skinny``: residual add + RMSNorm as the prologue of the swap-AB product
(``NORM`` in ops/skinny_linear.py), 2-16 rows, against the unfused modules' reference
(ops/add_rmsnorm_gemv.py ``add_rmsnorm_gemv_reference``: the add, models/layers.py ``RMSNorm``,
``F.linear``, ``silu(gate) * up``) and an emulation of the kernel's roundings.

The emulation (``_emulated``) writes the kernel's arithmetic out in PyTorch with its rounding
points (the sum, the normalised rows, the weighted rows; the product; gate, up, silu and the product
for SwiGLU). Triton's CPU interpreter truncates fp32 -> bf16 casts instead of rounding to nearest, so
on CPU the emulation truncates too (on CUDA it rounds, and is the reference). Only summation orders
differ from it, so the kernel is held to tight bounds (``s`` bit-exact); against the reference the
bounds are bf16 rounding noise.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.add_rmsnorm_gemv import add_rmsnorm_gemv_reference
from lfmspark.ops.add_rmsnorm_skinny import add_rmsnorm_skinny_triton, default_config
from lfmspark.ops.skinny_linear import SkinnyConfig, _split_counters, split_k_plan

TIGHT = {torch.float32: 2e-6, torch.bfloat16: 4e-3}   # against the emulation: summation order only
LOOSE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}   # against the reference: bf16 rounding noise
EPS = 1e-5
lfm = torch.ops.lfmspark


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, swiglu: bool, with_delta: bool, seed: int = 0):
    """``h`` with a per-row scale (so each row's statistics matter), ``delta``, a norm weight around 1
    and ``N`` weight rows (``2N`` stacked gate/up rows with ``swiglu``)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, K, generator=g) * torch.linspace(0.5, 4, M)[:, None] + 0.5).to(device, dtype)
    delta = (torch.randn(M, K, generator=g) * 2).to(device, dtype) if with_delta else None
    norm_weight = (1 + 0.3 * torch.randn(K, generator=g)).to(device, dtype)
    weight = (torch.randn(2 * N if swiglu else N, K, generator=g) * 2 / K ** 0.5).to(device, dtype)
    return h, delta, norm_weight, weight


def _cast(x32: torch.Tensor, dtype: torch.dtype, truncate: bool) -> torch.Tensor:
    """fp32 -> dtype as the kernel's ``.to(dtype)`` does where it runs."""
    if dtype == torch.float32:
        return x32
    if truncate:  # the interpreter: bf16 keeps the top 16 bits
        return (x32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x32.to(dtype)


def _emulated(h, delta, norm_weight, eps, weight, swiglu):
    dtype, truncate = h.dtype, h.device.type == "cpu"
    s = h if delta is None else _cast(h.float() + delta.float(), dtype, truncate)
    x32 = s.float()
    inv = torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) / x32.shape[-1] + eps)
    xn = _cast(x32 * inv, dtype, truncate)
    xv = _cast(norm_weight.float() * xn.float(), dtype, truncate)
    y = (xv.double() @ weight.double().T).float()
    if not swiglu:
        return s, _cast(y, dtype, truncate)
    gate, up = (_cast(t, dtype, truncate).float() for t in y.chunk(2, dim=-1))
    act = _cast(gate / (1 + torch.exp(-gate)), dtype, truncate).float()
    return s, _cast(act * up, dtype, truncate)


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _check(got: tuple[torch.Tensor, torch.Tensor], args: tuple, loose_only: bool = False) -> None:
    h, delta, norm_weight, weight, swiglu = args
    s, y = got
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert s.shape == h.shape and y.shape == (h.shape[0], N) and s.dtype == y.dtype == h.dtype
    ref_s, ref_y = add_rmsnorm_gemv_reference(h, delta, norm_weight, EPS, weight, swiglu)
    assert _rel_err(y, ref_y) < LOOSE[h.dtype]
    if loose_only:
        return
    emu_s, emu_y = _emulated(h, delta, norm_weight, EPS, weight, swiglu)
    assert torch.equal(s, emu_s)
    assert _rel_err(y, emu_y) < TIGHT[h.dtype]


# (M, N, K, cfg): K without a tail, one split; K with a tail; split-K (K tail in the last split),
# a column tile wider than N
CASES = [
    (2, 48, 128, SkinnyConfig(block_n=64, block_k=64, swap_ab=True)),
    (9, 40, 200, SkinnyConfig(block_n=32, block_k=64, swap_ab=True)),
    (10, 72, 256, SkinnyConfig(block_n=64, block_k=64, split_k=4, swap_ab=True)),
    (16, 24, 300, SkinnyConfig(block_n=32, block_k=32, split_k=3, swap_ab=True)),
]


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, _, K, cfg in CASES] == [1, 1, 4, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("M, N, K, cfg", CASES, ids=["m2", "m9_tail", "m10_split", "m16_split_tail"])
def test_kernel_matches_reference(triton_device, dtype, swiglu, with_delta, M, N, K, cfg) -> None:
    h, delta, norm_weight, weight = _inputs(triton_device, dtype, M, N, K, swiglu, with_delta, seed=M + K)
    got = add_rmsnorm_skinny_triton(h, delta, norm_weight, EPS, weight, swiglu, config=cfg)
    _check(got, (h, delta, norm_weight, weight, swiglu))


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_default_config_and_op(triton_device, monkeypatch, swiglu) -> None:
    """The default launch (split-K at this size on the interpreter's 8 "SMs") through the op."""
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    M, N, K = 10, 96, 1024
    cfg = default_config(M, N, K, 4, 8, swiglu)
    assert cfg.swap_ab and split_k_plan(K, cfg.block_k, cfg.split_k)[1] > 1
    args = _inputs(triton_device, torch.float32, M, N, K, swiglu, True)
    _check(lfm.add_rmsnorm_skinny(*args[:3], EPS, args[3], swiglu), (*args, swiglu))


def test_split_k_is_deterministic_and_matches_unsplit(triton_device) -> None:
    M, N, K, cfg = CASES[2]
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, M, N, K, False, True)
    s, first = add_rmsnorm_skinny_triton(h, delta, norm_weight, EPS, weight, False, config=cfg)
    assert not _split_counters(h.device).any()
    assert torch.equal(add_rmsnorm_skinny_triton(h, delta, norm_weight, EPS, weight, False, config=cfg)[1], first)
    unsplit = add_rmsnorm_skinny_triton(h, delta, norm_weight, EPS, weight, False,
                                        config=SkinnyConfig(block_n=64, block_k=64, swap_ab=True))
    assert torch.equal(unsplit[0], s)
    torch.testing.assert_close(first, unsplit[1], rtol=1e-5, atol=1e-6)


def test_strided_inputs_and_no_weight_rows(triton_device) -> None:
    h, delta, norm_weight, weight = _inputs(triton_device, torch.float32, 10, 40, 3 * 64, False, True)
    h, delta = h[:, 64:128], delta[:, :64]                  # row strides 192, not K
    weight = weight[:, :64].contiguous()
    _check(add_rmsnorm_skinny_triton(h, delta, norm_weight[:64], EPS, weight, False),
           (h, delta, norm_weight[:64], weight, False))
    s, y = add_rmsnorm_skinny_triton(h, delta, norm_weight[:64], EPS, weight[:0], False)
    assert y.shape == (10, 0) and torch.equal(s, h + delta)


_BAD = [
    (lambda a: {**a, "h": a["h"][:1]}, r"2 <= M <= 16"),
    (lambda a: {**a, "h": torch.randn(17, 8), "delta": None}, r"2 <= M <= 16"),
    (lambda a: {**a, "h": a["h"][0]}, r"h \[M, K\]"),
    (lambda a: {**a, "weight": torch.randn(6, 9)}, r"h \[M, K\] and weight \[N, K\]"),
    (lambda a: {**a, "delta": torch.randn(4, 8)}, "delta must have h's shape"),
    (lambda a: {**a, "norm_weight": torch.randn(9)}, r"norm_weight must be \[K\]"),
    (lambda a: {**a, "weight": torch.randn(5, 8), "swiglu": True}, "stack gate and up"),
    (lambda a: {**a, "weight": a["weight"].double()}, "h and weight must share a dtype"),
    (lambda a: {**a, "delta": a["delta"].half()}, "h and delta must share a dtype"),
    (lambda a: {k: (v.long() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}, "bf16, fp16 or fp32"),
    (lambda a: {**a, "weight": torch.randn(8, 6).T}, "contiguous along K"),
]


@pytest.mark.parametrize("route", ["op", "triton"])
@pytest.mark.parametrize("change, match", _BAD, ids=[f"bad{i}" for i in range(len(_BAD))])
def test_rejects_bad_inputs(route, change, match) -> None:
    """Clear errors, the same from the op's reference path (CPU) and the Triton launcher."""
    fn = lfm.add_rmsnorm_skinny if route == "op" else add_rmsnorm_skinny_triton
    args = change({"h": torch.randn(10, 8), "delta": torch.randn(10, 8), "norm_weight": torch.randn(8),
                   "weight": torch.randn(6, 8), "swiglu": False})
    with pytest.raises(ValueError, match=match):
        fn(args["h"], args["delta"], args["norm_weight"], EPS, args["weight"], args["swiglu"])


def test_rejects_a_config_without_swap_ab() -> None:
    h, delta, norm_weight, weight = _inputs("cpu", torch.float32, 4, 16, 64, False, True)
    with pytest.raises(ValueError, match="swap-AB kernel"):
        add_rmsnorm_skinny_triton(h, delta, norm_weight, EPS, weight, False, config=SkinnyConfig(32, 64))


@pytest.mark.parametrize("triton_on_cpu", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_opcheck(monkeypatch, triton_on_cpu, swiglu) -> None:
    if triton_on_cpu:
        monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    h, delta, norm_weight, weight = _inputs("cpu", torch.float32, 9, 24, 96, swiglu, not swiglu)
    torch.library.opcheck(lfm.add_rmsnorm_skinny, (h, delta, norm_weight, EPS, weight, swiglu))


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes (LFM2.5-1.2B verify, M = 10, K = 2048: qkv / out-sized 2048, in_proj
# 6144, the LM head 65536 with its 128-row tiles, the gate/up w13 [16384, 2048])

@pytest.mark.gpu
@pytest.mark.parametrize("N, swiglu", [(2048, False), (6144, False), (65536, False), (8192, True)],
                         ids=["2048", "6144", "lm_head", "swiglu"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_gpu_served_shapes(N, swiglu, with_delta) -> None:
    h, delta, norm_weight, weight = _inputs("cuda", torch.bfloat16, 10, N, 2048, swiglu, with_delta, seed=N)
    got = lfm.add_rmsnorm_skinny(h, delta, norm_weight, EPS, weight, swiglu)
    _check(got, (h, delta, norm_weight, weight, swiglu))
    ref_s, _ = add_rmsnorm_gemv_reference(h, delta, norm_weight, EPS, weight, swiglu)
    assert torch.equal(got[0], ref_s)    # the sum is torch's bf16 add, bit for bit
