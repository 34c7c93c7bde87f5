"""FP8 weights (models/quant.py): the per-output-channel layout, the round trip's error bounds, zero
rows, K-grouped scales (block-scaled checkpoints) and the fusing of weights into one product."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.quant import (FP8_DTYPE, FP8_MAX, Fp8Weight, cat_fp8, dequantize_fp8, quantize_fp8,
                                   relative_error, stack_fp8, with_groups)


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: each row's scale must follow its own
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-2])[:, None]


def test_layout_is_fp8_values_and_one_fp32_scale_per_output_channel():
    w = _weight(24, 40)
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8_DTYPE and q.weight.shape == (24, 40)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (24,) and q.per_channel
    torch.testing.assert_close(q.scale, w.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    assert torch.equal(q.weight.float().abs().amax(-1), torch.full((24,), FP8_MAX))   # each row spans the range


def test_round_trip_error_bounds():
    """Round to nearest: at most half an fp8 ulp, 2**-4 relative for normal fp8 values, ``scale *
    2**-10`` absolute in the subnormals; about 2.5% of the weight's norm for Gaussian rows."""
    w = _weight(64, 256, seed=1)
    q = quantize_fp8(w)
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, q.scale[:, None] * 2 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert 0.01 < relative_error(w, q) < 0.04
    g = torch.randn(32, 512, generator=torch.Generator().manual_seed(2))
    assert 0.015 < relative_error(g, quantize_fp8(g)) < 0.035


def test_zero_rows_get_scale_one_and_zero_values():
    w = _weight(6, 16)
    w[2] = 0.0
    q = quantize_fp8(w)
    assert q.scale[2].item() == 1.0 and not q.weight[2].float().any()
    assert not q.dequantize()[2].any() and bool(torch.isfinite(q.dequantize()).all())
    empty = quantize_fp8(torch.zeros(5, 0))
    assert empty.scale.tolist() == [1.0] * 5


def test_values_at_the_range_edge_do_not_overflow_to_nan():
    w = torch.tensor([[1.0, -1.0, 0.999999, 1e-30]])
    assert bool(torch.isfinite(quantize_fp8(w).dequantize()).all())


def test_non_finite_weights_are_refused():
    w = _weight(4, 8)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(w)


def test_any_input_dtype_and_stacked_experts():
    w = _weight(3, 10, 20)
    q = quantize_fp8(w.to(torch.bfloat16))
    assert q.weight.shape == (3, 10, 20) and q.scale.shape == (3, 10)
    ref = quantize_fp8(w.to(torch.bfloat16).float())
    assert torch.equal(q.weight.view(torch.uint8), ref.weight.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(q.dequantize()[1], quantize_fp8(w[1].to(torch.bfloat16)).dequantize(), rtol=0, atol=0)


def test_grouped_scales_dequantize_each_run_of_inputs():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4, 10, generator=g).to(FP8_DTYPE)
    scale = torch.rand(4, 3, generator=g) + 0.5                  # groups of 4, 4 and 2 inputs
    want = weight.float() * torch.cat([scale[:, :1].expand(4, 4), scale[:, 1:2].expand(4, 4),
                                       scale[:, 2:].expand(4, 2)], dim=1)
    assert torch.equal(dequantize_fp8(weight, scale, torch.float32, group_size=4), want)
    assert not Fp8Weight(weight, scale, 4).per_channel


def test_per_channel_scales_regroup_exactly():
    q = quantize_fp8(_weight(8, 50))
    grouped = with_groups(q, 16)
    assert grouped.scale.shape == (8, 4) and grouped.group_size == 16
    assert torch.equal(grouped.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="cannot be regrouped"):
        with_groups(grouped, 8)


def test_fusing_concatenates_output_channels_and_quantizes_float_parts():
    a, b = _weight(8, 32, seed=4), _weight(4, 32, seed=5)
    qa = quantize_fp8(a)
    fused = cat_fp8([qa, b])
    assert fused.weight.shape == (12, 32) and fused.scale.shape == (12,)
    assert torch.equal(fused.dequantize()[:8], qa.dequantize())               # the fp8 part is kept as it is
    assert torch.equal(fused.dequantize()[8:], quantize_fp8(b).dequantize())  # the float part quantized
    grouped = Fp8Weight(qa.weight, qa.scale[:, None].repeat(1, 2), 16)
    mixed = cat_fp8([grouped, quantize_fp8(b)])                               # per channel -> grouped, exactly
    assert mixed.group_size == 16 and torch.equal(mixed.dequantize()[8:], quantize_fp8(b).dequantize())
    with pytest.raises(ValueError, match="different input groups"):
        cat_fp8([grouped, Fp8Weight(qa.weight, qa.scale[:, None].repeat(1, 4), 8)])


def test_stacking_experts():
    parts = [_weight(6, 16, seed=s) for s in range(3)]
    stacked = stack_fp8([quantize_fp8(parts[0]), parts[1], parts[2]])
    assert stacked.weight.shape == (3, 6, 16) and stacked.scale.shape == (3, 6)
    for e, p in enumerate(parts):
        assert torch.equal(stacked.dequantize()[e], quantize_fp8(p).dequantize())
