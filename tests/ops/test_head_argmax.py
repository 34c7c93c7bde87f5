"""The LM head with argmax partials from its epilogue (ops/head_argmax.py): ``skinny_linear_argmax``
on the kernel (interpreter on CPU, native on CUDA) against ``skinny_linear`` on the same launch
(the product bit for bit) and against partials recomputed in plain PyTorch from that product
(``argmax_partials_reference``); ``argmax_of_partials`` against ``torch.argmax`` of the product;
ties, NaN and ``-inf``; the ops' errors.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.head_argmax import (argmax_of_partials_reference, argmax_of_partials_triton, argmax_partials_reference,
                                      argmax_tiles, head_argmax_config, skinny_linear_argmax_triton)
from lfmspark.ops.skinny_linear import SkinnyConfig, skinny_linear_triton, split_k_plan

lfm = torch.ops.lfmspark

# (N, K, cfg): tails, no split; split-K (the epilogue in the last program's fix-up); the regular
# layout (x as the A operand); a column tile wider than N
CASES = [
    (200, 96, SkinnyConfig(block_n=64, block_k=32, swap_ab=True)),
    (160, 300, SkinnyConfig(block_n=64, block_k=64, split_k=3, swap_ab=True)),
    (96, 128, SkinnyConfig(block_n=32, block_k=32, split_k=2)),
    (40, 64, SkinnyConfig(block_n=64, block_k=32, swap_ab=True)),
]


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    return x, w


def _check(x, w, cfg, row_ssq=None, eps=0.0):
    out, pv, pi = skinny_linear_argmax_triton(x, w, row_ssq, eps, config=cfg)
    # the product is skinny_linear's on the same launch, bit for bit
    torch.testing.assert_close(out, skinny_linear_triton(x, w, cfg, row_ssq=row_ssq, eps=eps), rtol=0, atol=0,
                               equal_nan=True)
    want_v, want_i = argmax_partials_reference(out, cfg.block_n)
    assert pv.dtype == torch.float32 and pi.dtype == torch.int32
    assert pv.shape == (x.shape[0], -(-w.shape[0] // cfg.block_n))
    assert torch.equal(pi.cpu(), want_i.cpu())
    torch.testing.assert_close(pv.cpu(), want_v.cpu(), rtol=0, atol=0, equal_nan=True)
    picks = argmax_of_partials_triton(pv, pi)
    assert torch.equal(picks.cpu(), out.float().argmax(dim=-1).cpu())
    return out, pv, pi


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, K, cfg in CASES] == [1, 3, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 9, 16])
@pytest.mark.parametrize("N, K, cfg", CASES, ids=["tails", "split_k", "regular", "wide_tile"])
def test_matches_product_and_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                       cfg: SkinnyConfig) -> None:
    _check(*_inputs(triton_device, dtype, M, N, K, seed=M + N), cfg)


def test_row_scale(triton_device: str) -> None:
    """With ``row_ssq`` (the LM head on a NormedCarry): the row-scaled product and its partials."""
    x, w = _inputs(triton_device, torch.bfloat16, 10, 200, 96, seed=3)
    ssq = (torch.rand(2, 10, generator=torch.Generator().manual_seed(4)) * 50 + 1).to(triton_device)
    _check(x, w, CASES[0][2], ssq, 1e-5)


def test_ties_nan_and_inf(triton_device: str) -> None:
    """Equal maxima within and across tiles (the first column wins), rows of -inf (column 0), NaN
    columns (the first NaN wins): 0/1 weights make the product what the rows of x say."""
    K, N, cfg = 32, 200, SkinnyConfig(block_n=64, block_k=32, swap_ab=True)
    w = torch.zeros(N, K)
    w[:, 0] = 1.0                                     # out[m, n] = x[m, 0] for every n ...
    w[:, 1] = (torch.arange(N) % 7 == 3).float()      # ... plus x[m, 1] where n % 7 == 3 (3, 10, ..., in every tile)
    x = torch.zeros(4, K)
    x[1, 1] = 2.0                                      # ties across tiles: column 3
    x[2, 0] = float("-inf")                            # all -inf: column 0
    x[3, 0], x[3, 1] = 1.0, -1.0                       # 1.0 everywhere but the n % 7 == 3 columns: column 0
    _, pv, pi = _check(x.to(triton_device), w.to(triton_device), cfg)
    assert argmax_of_partials_triton(pv, pi).tolist() == [0, 3, 0, 0]
    w[[150, 170], 2] = float("nan")                    # 0 * NaN: NaN at columns 150 and 170 of every row
    x[1, 1] = 5.0
    _, pv, pi = _check(x.to(triton_device), w.to(triton_device), cfg)
    assert argmax_of_partials_triton(pv, pi).tolist() == [150] * 4


def test_argmax_of_partials_reference_matches_triton(triton_device: str) -> None:
    g = torch.Generator().manual_seed(5)
    pv = torch.randint(0, 4, (7, 37), generator=g).float()   # many equal maxima
    pv[2, 5] = float("nan")
    pv[2, 9] = float("nan")
    pi = (torch.arange(37) * 16 + torch.randint(0, 16, (7, 37), generator=g)).to(torch.int32)
    want = argmax_of_partials_reference(pv, pi)
    got = argmax_of_partials_triton(pv.to(triton_device), pi.to(triton_device))
    assert torch.equal(got.cpu(), want)
    assert want[2].item() == pi[2, 5].item()


def test_op_and_fake_shapes(triton_device: str) -> None:
    """The op's default launch: as many partials per row as ``argmax_tiles`` says, the same under
    FakeTensorMode (what torch.compile traces)."""
    x, w = _inputs(triton_device, torch.bfloat16, 9, 300, 64, seed=6)
    out, pv, pi = lfm.skinny_linear_argmax(x, w)
    tiles = argmax_tiles(x, w)
    assert tiles == -(-300 // head_argmax_config(x, w).block_n)
    assert out.shape == (9, 300) and pv.shape == pi.shape == (9, tiles)
    assert torch.equal(lfm.argmax_of_partials(pv, pi).cpu(), out.float().argmax(-1).cpu())
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fo, fv, fi = lfm.skinny_linear_argmax(mode.from_tensor(x), mode.from_tensor(w))
        assert fo.shape == out.shape and fv.shape == pv.shape and fi.dtype == torch.int32
        assert lfm.argmax_of_partials(fv, fi).shape == (9,)


def test_rejects_bad_inputs(triton_device: str) -> None:
    x, w = _inputs(triton_device, torch.float32, 4, 64, 32)
    with pytest.raises(ValueError, match="expected x"):
        lfm.skinny_linear_argmax(x, w[:, :16])
    with pytest.raises(ValueError, match="no rows"):
        lfm.skinny_linear_argmax(x, w[:0])
    with pytest.raises(ValueError, match="row_ssq"):
        lfm.skinny_linear_argmax(x, w, torch.ones(2, 3, device=triton_device))
    pv, pi = torch.zeros(4, 3, device=triton_device), torch.zeros(4, 3, dtype=torch.int32, device=triton_device)
    with pytest.raises(ValueError, match="int32"):
        lfm.argmax_of_partials(pv, pi.long())
    with pytest.raises(ValueError, match="one shape"):
        lfm.argmax_of_partials(pv, pi[:, :2])


def _opcheck_args() -> list[tuple]:
    x, w = _inputs("cpu", torch.float32, 9, 200, 64, seed=7)
    ssq = torch.rand(2, 9, generator=torch.Generator().manual_seed(8)) * 50 + 1
    return [(x, w), (x, w, ssq, 1e-5)]


@pytest.mark.parametrize("triton_on_cpu", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch: pytest.MonkeyPatch, triton_on_cpu: bool) -> None:
    """Both ops' registrations (schema, fake, autograd, dispatch) on the reference and, with
    ``LFMSPARK_TRITON_ON_CPU``, on the interpreted kernels."""
    if triton_on_cpu:
        monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    for args in _opcheck_args():
        torch.library.opcheck(lfm.skinny_linear_argmax, args)
        _, pv, pi = lfm.skinny_linear_argmax(*args)
        torch.library.opcheck(lfm.argmax_of_partials, (pv, pi))
