"""Where an fp8 target's products run (models/layers.py ``fp8_linear``): ``skinny_linear_fp8`` where a
bf16 weight would take ``skinny_linear`` (1-16 rows on CUDA, and every product of a carried norm),
the dequantized weight elsewhere (``F.linear`` on more rows and on the CPU, ``exact_linear`` in exact
mode, and the reference for K-grouped scales); the fused norm + product kernels never see an fp8
weight. The CUDA routes are reached on CPU by patching ``routing.product_kernels`` (the ops then run
their references); the comparison is the plain CPU path, which the routes must match."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lfmspark.models.layers as layers
from lfmspark.models.layers import Fp8Linear, Linear, SwiGLU, fp8_linear
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2_moe import Fp8MoeExperts, Lfm2MoeBlock, quantize_target, target_projections
from lfmspark.models.quant import Fp8Weight, quantize_fp8
from lfmspark.ops import routing
from spec_fixtures import random_tiny_target, tiny_target_config
from verify_window import TOL, rel_err, verify_window

FUSED_BF16 = ("skinny_linear", "skinny_swiglu", "skinny_linear_add_norm", "add_rmsnorm_gemv", "skinny_linear_pair")


class Calls:
    """``torch.ops.lfmspark`` recording the name and positional arguments of every call."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        op = getattr(torch.ops.lfmspark, name)
        return lambda *args, **kw: self.calls.append((name, args)) or op(*args, **kw)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def calls(monkeypatch) -> Calls:
    spy = Calls()
    monkeypatch.setattr(layers, "lfm", spy)
    return spy


def _fp8(N: int = 24, K: int = 16, seed: int = 0) -> tuple[torch.Tensor, Fp8Weight]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    return w, quantize_fp8(w)


@pytest.mark.parametrize("rows, routed", [(1, True), (10, True), (16, True), (17, False)])
def test_fp8_products_take_the_fp8_kernel_for_up_to_16_rows(monkeypatch, calls, rows, routed):
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    _, w = _fp8()
    x = torch.randn(1, rows, 16)
    torch.testing.assert_close(fp8_linear(x, w), F.linear(x, w.dequantize()), rtol=1e-5, atol=1e-6)
    assert calls.names() == (["skinny_linear_fp8"] if routed else [])


def test_cpu_grouped_scales_and_exact_mode_use_the_dequantized_weight(monkeypatch, calls):
    _, w = _fp8()
    x = torch.randn(2, 3, 16)
    assert torch.equal(fp8_linear(x, w), F.linear(x, w.dequantize()))          # the CPU: the reference
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    grouped = Fp8Weight(w.weight, w.scale[:, None].repeat(1, 2), 8)
    assert torch.equal(fp8_linear(x, grouped), F.linear(x, w.dequantize()))   # no kernel reads K groups yet
    assert calls.names() == []
    with routing.exact_scope(True):
        torch.testing.assert_close(fp8_linear(x, w), F.linear(x, w.dequantize()), rtol=1e-5, atol=1e-6)
    assert calls.names() == ["exact_linear"]


def test_a_carried_norm_scales_the_fp8_product(calls):
    """A NormedCarry's product takes the fp8 kernel with the row scale; K-grouped scales the bf16 one
    on the dequantized weight."""
    _, w = _fp8()
    scaled, ssq = torch.randn(5, 16), torch.rand(2, 5) * 16
    want = F.linear(scaled, w.dequantize()) * torch.rsqrt(ssq.sum(0) / 16 + 1e-5)[:, None]
    torch.testing.assert_close(fp8_linear(scaled, w, ssq, 1e-5), want, rtol=1e-5, atol=1e-6)
    grouped = Fp8Weight(w.weight, w.scale[:, None].repeat(1, 2), 8)
    torch.testing.assert_close(fp8_linear(scaled, grouped, ssq, 1e-5), want, rtol=1e-5, atol=1e-6)
    assert calls.names() == ["skinny_linear_fp8", "skinny_linear"]


def test_fp8_linear_module():
    linear = Linear(16, 24)
    torch.nn.init.normal_(linear.weight)
    fp8 = Fp8Linear.quantize(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (24,)
    assert not fp8.weight.requires_grad and (fp8.in_features, fp8.out_features) == (16, 24)
    x = torch.randn(3, 16)
    assert torch.equal(fp8(x), F.linear(x, quantize_fp8(linear.weight.detach()).dequantize()))
    assert "fp8 e4m3fn" in repr(fp8)


@pytest.mark.parametrize("rows", [1, 10, 17])
def test_an_fp8_swiglu_applies_its_activation_after_the_product(monkeypatch, calls, rows):
    monkeypatch.setattr(routing, "product_kernels", lambda t: True)
    mlp = SwiGLU(16, 24)
    torch.nn.init.normal_(mlp.w13.weight)
    torch.nn.init.normal_(mlp.w2.weight)
    mlp.w13, mlp.w2 = Fp8Linear.quantize(mlp.w13), Fp8Linear.quantize(mlp.w2)
    x = torch.randn(1, rows, 16)
    gate, up = F.linear(x, mlp.w13.fp8.dequantize()).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), F.linear(F.silu(gate) * up, mlp.w2.fp8.dequantize()), rtol=1e-5, atol=1e-6)
    assert not set(calls.names()) & set(FUSED_BF16)
    assert calls.names() == (["skinny_linear_fp8"] * 2 if rows <= 16 else [])


def test_fp8_experts_serve_their_dequantized_weights():
    cfg = tiny_target_config(moe=True)
    block = Lfm2MoeBlock(cfg)
    g = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    fp8 = copy.deepcopy(block)
    fp8.experts = Fp8MoeExperts.quantize(block.experts)
    w13, w2 = fp8.experts.stacks(torch.float32)
    block.experts.w13.data, block.experts.w2.data = w13, w2
    x = torch.randn(2, 5, cfg.hidden_size, generator=g)
    assert torch.equal(fp8(x), block(x))


def test_quantize_target_names_what_it_quantizes():
    target = random_tiny_target(moe=True, seed=1)
    names = set(target_projections(target))
    assert quantize_target(target) == len(names) and quantize_target(target) == 0    # idempotent
    kinds = {type(target.get_submodule(n)) for n in names}
    assert kinds == {Fp8Linear, Fp8MoeExperts}
    assert isinstance(target.lm_head, Linear) and all(
        isinstance(b.gate, Linear) for b in target.modules() if isinstance(b, Lfm2MoeBlock))


def _decode_logits(model, dtype: torch.dtype) -> torch.Tensor:
    """Prefill 5 tokens, then decode 3 one row at a time (the GEMV route's row count)."""
    cache = TargetCache.allocate(model.config, 2, 64, 8, dtype, "cpu")
    slot, out = torch.tensor([1]), []
    with torch.no_grad():
        model(torch.tensor([[3, 9, 27, 4, 5]]), cache, slot, torch.tensor([0]))
        for i, tok in enumerate((7, 11, 13)):
            out.append(model(torch.tensor([[tok]]), cache, slot, torch.tensor([5 + i]), mode=ForwardMode.DECODE).logits)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_an_fp8_target_on_the_cuda_routes_matches_the_plain_path(monkeypatch, calls, dtype, moe):
    """Decode (one row: the norms unfused, the fp8 GEMV) and VERIFY (6 rows: carried norms whose
    products take the row scale) of an fp8 target on the CUDA routes agree with the CPU's plain
    path; no fused bf16 kernel is handed an fp8 weight."""
    target = random_tiny_target(moe=moe, seed=2).to(dtype)
    quantize_target(target)
    want_decode, (want_verify, _) = _decode_logits(target, dtype), verify_window(target, dtype)
    assert calls.names() == []
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    got_decode, (got_verify, _) = _decode_logits(target, dtype), verify_window(target, dtype)
    assert rel_err(got_decode, want_decode) < TOL[dtype] and rel_err(got_verify.logits, want_verify.logits) < TOL[dtype]
    fp8_ids = {id(p) for n, p in target.named_parameters() if p.dtype == torch.float8_e4m3fn}
    for name, args in calls.calls:
        if name in FUSED_BF16:
            assert not any(id(a) in fp8_ids for a in args if isinstance(a, torch.Tensor)), name
    fp8_calls = [args for name, args in calls.calls if name == "skinny_linear_fp8"]
    assert fp8_calls and any(args[3] is not None for args in fp8_calls if len(args) > 3)   # carried norms too
