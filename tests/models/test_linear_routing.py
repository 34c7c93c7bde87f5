"""``models.layers.linear``: the LFMSPARK_SKINNY_LINEAR switch is validated; CPU always uses F.linear.
``models.layers.SwiGLU``: which fused or unfused kernels the gate/up product takes per mode and row count."""

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
    from lfmspark.models.layers import skinny_rows

    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    assert skinny_rows() == (1, 16)
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "gemv")
    assert skinny_rows() == (1, 1)


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


@pytest.mark.parametrize("mode, rows, want", [
    ("few", 1, "swiglu_gemv"), ("few", 2, "skinny_swiglu"), ("few", 10, "skinny_swiglu"), ("few", 16, "skinny_swiglu"),
    ("few", 17, "unfused"), ("gemv", 10, "unfused"), ("off", 1, "unfused"), ("verify", 1, "unfused"),
    ("verify", 9, "skinny_swiglu"), ("all", 17, "skinny_linear"), ("all", 64, "skinny_linear"),
], ids=lambda v: str(v))
def test_swiglu_routing(monkeypatch, mode, rows, want):
    """Which kernels a dense SwiGLU's gate/up product takes per LFMSPARK_SKINNY_LINEAR mode and row
    count, with the CUDA-only condition of the routing lifted (CPU): the fused one-row GEMV, the
    fused 2-16-row op, the unfused skinny product (routed counts above 16) or cuBLAS (not routed);
    the result is the unfused composition within rounding whichever it is."""
    import lfmspark.models.layers as layers

    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", mode)
    lo, hi = layers.skinny_rows()
    monkeypatch.setattr(layers, "_routed_to_skinny", lambda t: lo <= t.numel() // t.shape[-1] <= hi)
    calls = []

    class Spy:  # torch.ops.lfmspark, recording which ops the module calls
        def __getattr__(self, name):
            op = getattr(torch.ops.lfmspark, name)
            return lambda *args: calls.append(name) or op(*args)

    monkeypatch.setattr(layers, "lfm", Spy())
    mlp = layers.SwiGLU(16, 24)
    x = torch.randn(1, rows, 16)
    out = mlp(x)
    gate, up = F.linear(x, mlp.w13.weight).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.linear(F.silu(gate) * up, mlp.w2.weight), rtol=1e-5, atol=1e-6)
    # the gate/up product, then w2 (on the same route: same rows)
    expected = {"unfused": [], "skinny_linear": ["skinny_linear", "skinny_linear"]}
    assert calls == expected.get(want, [want, "skinny_linear"])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [9, 10, 16])
def test_gpu_few_row_swiglu_uses_the_fused_op(monkeypatch, rows):
    from lfmspark.models.layers import SwiGLU

    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    mlp = SwiGLU(2048, 8192).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(mlp.w13.weight, std=2048 ** -0.5)
    torch.nn.init.normal_(mlp.w2.weight, std=8192 ** -0.5)
    x = torch.randn(1, rows, 2048, device="cuda", dtype=torch.bfloat16)
    fused = torch.ops.lfmspark.skinny_swiglu(x.view(rows, 2048), mlp.w13.weight)
    out = mlp(x)
    assert torch.equal(out, torch.ops.lfmspark.skinny_linear(fused, mlp.w2.weight).view(1, rows, 2048))
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "off")    # cuBLAS and the unfused activation
    plain = mlp(x)
    assert ((out.float() - plain.float()).norm() / plain.float().norm()).item() < 2e-2


@pytest.mark.parametrize("mode, rows, routed", [
    ("few", 1, False), ("few", 2, True), ("few", 10, True), ("few", 16, True), ("few", 17, False),
    ("gemv", 10, False), ("off", 10, False), ("verify", 9, True), ("all", 17, False),
], ids=lambda v: str(v))
def test_linear_pair_routing(monkeypatch, mode, rows, routed):
    """``linear_pair`` runs ``lfmspark::skinny_linear_pair`` for 2-16 rows on the skinny route (the
    CUDA-only condition lifted, as above) and declines (None) otherwise: one row (the GEMV kernel
    has no pair variant), more than 16, rows not routed."""
    import lfmspark.models.layers as layers

    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", mode)
    lo, hi = layers.skinny_rows()
    monkeypatch.setattr(layers, "_routed_to_skinny", lambda t: lo <= t.numel() // t.shape[-1] <= hi)
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
    import lfmspark.models.layers as layers

    monkeypatch.setattr(layers, "_routed_to_skinny", lambda t: True)
    x, w_b = torch.randn(10, 16), torch.randn(8, 16)
    assert layers.linear_pair(x, torch.randn(24, 16), w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 16, dtype=torch.float64), w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 32)[:, :16], w_b) is None
    assert layers.linear_pair(x, torch.randn(32, 16), w_b) is not None
    monkeypatch.undo()
    assert layers.linear_pair(x, torch.randn(32, 16), w_b) is None      # CPU: never routed


@pytest.mark.gpu
def test_gpu_linear_pair_uses_the_pair_op(monkeypatch):
    import lfmspark.models.layers as layers

    monkeypatch.delenv("LFMSPARK_SKINNY_LINEAR", raising=False)
    x = torch.randn(1, 10, 2048, device="cuda", dtype=torch.bfloat16)
    w_a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    stack = torch.randn(4, 1024, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    want = torch.ops.lfmspark.skinny_linear_pair(x.view(10, 2048), w_a, stack[2]).view(1, 10, 3072)
    assert torch.equal(layers.linear_pair(x, w_a, stack[2]), want)
    assert layers.linear_pair(x[:, :1], w_a, stack[2]) is None
