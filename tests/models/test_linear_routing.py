"""``models.layers.linear``: the LFMSPARK_SKINNY_LINEAR switch is validated; CPU always uses F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lfmspark.models.layers import linear


def test_unknown_skinny_mode_is_refused(monkeypatch):
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "1")
    with pytest.raises(ValueError, match="LFMSPARK_SKINNY_LINEAR='1'.*'all'"):
        linear(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.parametrize("mode", ["off", "gemv", "all", "verify"])
def test_cpu_products_are_f_linear_in_every_mode(monkeypatch, mode):
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", mode)
    x, w = torch.randn(3, 5, 8), torch.randn(6, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_up_to_16_rows_take_the_skinny_kernels_by_default(monkeypatch):
    from lfmspark.models.layers import _skinny_rows

    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    assert _skinny_rows() == (1, 16)
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "gemv")
    assert _skinny_rows() == (1, 1)


@pytest.mark.gpu
def test_gpu_default_routing(monkeypatch):
    """On CUDA, up to 16 rows go through lfmspark::skinny_linear (bit-identical to calling it), more
    rows through cuBLAS (bit-identical to F.linear)."""
    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 10, 16):
        x = torch.randn(1, rows, 2048, device="cuda", dtype=torch.bfloat16)
        want = torch.ops.lfmspark.skinny_linear(x.view(rows, 2048), w).view(1, rows, 2048)
        assert torch.equal(linear(x, w), want)
    x = torch.randn(1, 17, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_cpu_swiglu_is_the_unfused_composition():
    from lfmspark.models.layers import SwiGLU

    mlp = SwiGLU(16, 24)
    torch.nn.init.normal_(mlp.w13.weight)
    torch.nn.init.normal_(mlp.w2.weight)
    x = torch.randn(1, 1, 16)
    gate, up = F.linear(x, mlp.w13.weight).chunk(2, dim=-1)
    assert torch.equal(mlp(x), F.linear(F.silu(gate) * up, mlp.w2.weight))


@pytest.mark.gpu
def test_gpu_one_row_swiglu_uses_the_fused_gemv(monkeypatch):
    from lfmspark.models.layers import SwiGLU

    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    mlp = SwiGLU(2048, 8192).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(mlp.w13.weight, std=2048 ** -0.5)
    torch.nn.init.normal_(mlp.w2.weight, std=8192 ** -0.5)
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    fused = torch.ops.lfmspark.swiglu_gemv(x.view(1, 2048), mlp.w13.weight)
    out = mlp(x)
    assert torch.equal(out, torch.ops.lfmspark.skinny_linear(fused, mlp.w2.weight).view(1, 1, 2048))
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "off")    # cuBLAS and the unfused activation
    plain = mlp(x)
    assert ((out.float() - plain.float()).norm() / plain.float().norm()).item() < 2e-2
