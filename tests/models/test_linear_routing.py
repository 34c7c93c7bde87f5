"""Where the models' products run (ops/routing.py, applied by models/layers.py): ``linear`` takes
``lfmspark::skinny_linear`` for 1-16 rows on CUDA and ``F.linear`` otherwise; a dense ``SwiGLU``'s
gate/up product takes ``skinny_swiglu`` (the activation in its epilogue) for 1-16 rows; ``linear_pair``
takes ``skinny_linear_pair`` for 2-16 rows. On CPU the CUDA-only condition is lifted by patching
``routing.product_kernels``, so the row-count rules are checked here; the GPU tests check the real
routes against the ops they name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lfmspark.models.layers as layers
from lfmspark.ops import routing
from lfmspark.models.layers import SwiGLU, linear


class Spy:
    """``torch.ops.lfmspark``, recording which ops a module calls."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def __getattr__(self, name):
        op = getattr(torch.ops.lfmspark, name)
        return lambda *args, **kw: self.calls.append(name) or op(*args, **kw)


def test_cpu_products_are_f_linear():
    x, w = torch.randn(3, 5, 8), torch.randn(6, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert not routing.skinny_product(torch.randn(1, 8))          # CPU: never the product kernels


@pytest.mark.parametrize("rows, routed", [(1, True), (10, True), (16, True), (17, False), (64, False)])
def test_linear_takes_the_skinny_op_for_up_to_16_rows(monkeypatch, rows, routed):
    calls: list[str] = []
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    monkeypatch.setattr(layers, "lfm", Spy(calls))
    x, w = torch.randn(1, rows, 16), torch.randn(24, 16)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)
    assert calls == (["skinny_linear"] if routed else [])


@pytest.mark.gpu
def test_gpu_default_routing():
    """On CUDA, up to 16 rows go through lfmspark::skinny_linear (bit-identical to calling it), more
    rows through cuBLAS (bit-identical to F.linear)."""
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 10, 16):
        x = torch.randn(1, rows, 2048, device="cuda", dtype=torch.bfloat16)
        want = torch.ops.lfmspark.skinny_linear(x.view(rows, 2048), w).view(1, rows, 2048)
        assert torch.equal(linear(x, w), want)
    x = torch.randn(1, 17, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_cpu_swiglu_is_the_unfused_composition():
    mlp = SwiGLU(16, 24)
    torch.nn.init.normal_(mlp.w13.weight)
    torch.nn.init.normal_(mlp.w2.weight)
    x = torch.randn(1, 1, 16)
    gate, up = F.linear(x, mlp.w13.weight).chunk(2, dim=-1)
    assert torch.equal(mlp(x), F.linear(F.silu(gate) * up, mlp.w2.weight))


@pytest.mark.parametrize("rows, fused", [(1, True), (2, True), (10, True), (16, True), (17, False)])
def test_swiglu_routing(monkeypatch, rows, fused):
    """1-16 rows: the fused gate/up op and w2 on the skinny product; more: cuBLAS and the unfused
    activation. The result is the unfused composition within rounding whichever runs."""
    calls: list[str] = []
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    monkeypatch.setattr(layers, "lfm", Spy(calls))
    mlp = layers.SwiGLU(16, 24)
    x = torch.randn(1, rows, 16)
    out = mlp(x)
    gate, up = F.linear(x, mlp.w13.weight).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.linear(F.silu(gate) * up, mlp.w2.weight), rtol=1e-5, atol=1e-6)
    assert calls == (["skinny_swiglu", "skinny_linear"] if fused else [])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 9, 10, 16])
def test_gpu_few_row_swiglu_uses_the_fused_op(rows):
    mlp = SwiGLU(2048, 8192).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(mlp.w13.weight, std=2048 ** -0.5)
    torch.nn.init.normal_(mlp.w2.weight, std=8192 ** -0.5)
    x = torch.randn(1, rows, 2048, device="cuda", dtype=torch.bfloat16)
    fused = torch.ops.lfmspark.skinny_swiglu(x.view(rows, 2048), mlp.w13.weight)
    out = mlp(x)
    assert torch.equal(out, torch.ops.lfmspark.skinny_linear(fused, mlp.w2.weight).view(1, rows, 2048))
    gate, up = F.linear(x, mlp.w13.weight).chunk(2, dim=-1)          # cuBLAS and the unfused activation
    plain = F.linear(F.silu(gate) * up, mlp.w2.weight)
    assert ((out.float() - plain.float()).norm() / plain.float().norm()).item() < 2e-2


@pytest.mark.parametrize("rows, routed", [(1, False), (2, True), (10, True), (16, True), (17, False)])
def test_linear_pair_routing(monkeypatch, rows, routed):
    """``linear_pair`` runs ``lfmspark::skinny_linear_pair`` for 2-16 rows and declines (None)
    otherwise: one row (the GEMV kernel has no pair variant), more than 16."""
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    x, w_a, stack = torch.randn(1, rows, 16), torch.randn(32, 16), torch.randn(2, 24, 16)
    out = layers.linear_pair(x, w_a, stack[1])
    if not routed:
        assert out is None
        return
    assert out.shape == (1, rows, 56)
    assert torch.equal(out, torch.cat([F.linear(x, w_a), F.linear(x, stack[1])], dim=-1))


def test_linear_pair_declines_weights_the_op_does_not_take(monkeypatch):
    """A first weight that is not whole 16-row tiles, mixed dtypes, different row strides: None
    (the caller's unfused products), never an error."""
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    x, w_b = torch.randn(10, 16), torch.randn(8, 16)
    assert layers.linear_pair(x, torch.randn(24, 16), w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 16, dtype=torch.float64), w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 32)[:, :16], w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 16), w_b) is not None
    monkeypatch.undo()
    assert layers.linear_pair(x, torch.randn(32, 16), w_b) is None      # CPU: never routed


def test_norm_routes():
    """ops/routing.py ``norm_route`` (CUDA-only condition aside): one-row decode in the GEMV's
    prologue (hidden sizes up to 8192), 2-16 rows outside decode in the epilogues, else modules."""
    route = routing.norm_route
    with pytest.MonkeyPatch.context() as m:
        m.setattr(routing, "product_kernels", lambda t: True)
        assert route(torch.empty(1, 1, 2048), decode=True) is routing.NormRoute.GEMV
        assert route(torch.empty(1, 1, 16384), decode=True) is routing.NormRoute.MODULES
        assert route(torch.empty(4, 1, 2048), decode=True) is routing.NormRoute.MODULES
        assert route(torch.empty(1, 10, 2048), decode=False) is routing.NormRoute.EPILOGUE
        assert route(torch.empty(1, 1, 2048), decode=False) is routing.NormRoute.MODULES
        assert route(torch.empty(1, 17, 2048), decode=False) is routing.NormRoute.MODULES
    assert route(torch.empty(1, 10, 2048), decode=False) is routing.NormRoute.MODULES      # CPU


@pytest.mark.gpu
def test_gpu_linear_pair_uses_the_pair_op():
    x = torch.randn(1, 10, 2048, device="cuda", dtype=torch.bfloat16)
    w_a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    stack = torch.randn(4, 1024, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    want = torch.ops.lfmspark.skinny_linear_pair(x.view(10, 2048), w_a, stack[2]).view(1, 10, 3072)
    assert torch.equal(layers.linear_pair(x, w_a, stack[2]), want)
    assert layers.linear_pair(x[:, :1], w_a, stack[2]) is None
