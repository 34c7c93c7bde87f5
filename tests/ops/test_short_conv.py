"""ShortConv ops (prefill/decode, verify with a tape, commit): Triton kernels (interpreter on CPU,
native on CUDA) against the plain-PyTorch references, registration checks and torch.compile.

The references are themselves checked against ``F.conv1d`` (HF's formulation). Every kernel run
starts from poisoned outputs (NaN-filled state rows of unused slots, NaN tape) so unwritten or
wrongly written elements are caught. Under the interpreter fp32->bf16 casts truncate instead of
rounding, so bf16 results there may differ from torch's by one ulp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.short_conv import (short_conv_commit_reference, short_conv_commit_triton,
                                     short_conv_prefill_reference, short_conv_prefill_triton,
                                     short_conv_verify_reference, short_conv_verify_triton)

N_CONV, N_SLOTS = 3, 6


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    else:   # one bf16 ulp (interpreter truncation) on values of order 10
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=6e-2, equal_nan=True)


def inputs(device: str, dtype: torch.dtype, B: int, T: int, H: int, K: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bx = torch.randn(B, T, H, generator=g).to(device, dtype)
    weight = torch.randn(H, K, generator=g).to(device, dtype)
    state = torch.randn(N_CONV, N_SLOTS, K - 1, H, generator=g).to(device, dtype)
    return bx, weight, state


def idx(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, H", [(1, 64), (5, 300), (9, 33), (37, 40)])   # 37: three time blocks
def test_prefill_matches_reference(triton_device, dtype, T, H):
    bx, w, state = inputs(triton_device, dtype, 4, T, H, seed=T + H)
    slots = idx([3, -1, 0, 5], triton_device)
    start = idx([0, 7, 4, 9], triton_device)          # row 0 starts fresh (zero state), others continue
    lens = idx([T, T, max(T - 2, 0), 1], triton_device)
    s_kernel, s_ref = state.clone(), state.clone()
    out = short_conv_prefill_triton(bx, w, s_kernel, 1, slots, start, lens)
    ref = short_conv_prefill_reference(bx, w, s_ref, 1, slots, start, lens)
    close(out[[0, 2, 3]], ref[[0, 2, 3]], dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1]))             # padding row
    close(s_kernel, s_ref, dtype)
    assert torch.equal(s_kernel[:, [1, 2, 4]], state[:, [1, 2, 4]])  # slots no row owns
    assert torch.equal(s_kernel[[0, 2]], state[[0, 2]])              # other layers


def test_reference_prefill_equals_hf_conv1d():
    """The reference against HF's formulation: F.conv1d on the left-zero-padded sequence, and the
    state = the last K-1 inputs; a second chunk continuing from the state equals one pass."""
    bx, w, state = inputs("cpu", torch.float64, 1, 11, 16, seed=3)
    slots, zero = idx([0], "cpu"), idx([0], "cpu")
    out = short_conv_prefill_reference(bx, w, state, 0, slots, zero, idx([11], "cpu"))
    hf = F.conv1d(bx.transpose(1, 2), w[:, None, :], padding=2, groups=16)[..., :11].transpose(1, 2)
    torch.testing.assert_close(out, hf)
    torch.testing.assert_close(state[0, 0], bx[0, -2:])
    state2 = torch.zeros_like(state)
    first = short_conv_prefill_reference(bx[:, :6], w, state2, 0, slots, zero, idx([6], "cpu"))
    second = short_conv_prefill_reference(bx[:, 6:], w, state2, 0, slots, idx([6], "cpu"), idx([5], "cpu"))
    torch.testing.assert_close(torch.cat([first, second], dim=1), hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("W, H", [(1, 64), (10, 300), (4, 17)])
def test_verify_and_commit_match_reference(triton_device, dtype, W, H):
    bx, w, state = inputs(triton_device, dtype, 4, W, H, seed=W * H)
    slots = idx([2, 0, -1, 5], triton_device)
    tape_shape = (N_CONV, 4, W + 2 + 1, H)                           # one spare column: a wider tape
    t_kernel = torch.full(tape_shape, float("nan"), dtype=dtype, device=triton_device)
    t_ref = t_kernel.clone()
    s_before = state.clone()
    out = short_conv_verify_triton(bx, w, state, t_kernel, 2, slots)
    ref = short_conv_verify_reference(bx, w, state, t_ref, 2, slots)
    assert torch.equal(state, s_before)                              # verify never touches the state
    close(out[[0, 1, 3]], ref[[0, 1, 3]], dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    close(t_kernel, t_ref, dtype)
    assert t_kernel[2, [0, 1, 3], : W + 2].isfinite().all()          # every tape column of real rows written
    assert t_kernel[2, 2].isnan().all() and t_kernel[:2].isnan().all() and t_kernel[2, :, W + 2:].isnan().all()
    # the tape holds [state ; bx] exactly
    for row, slot in ((0, 2), (1, 0), (3, 5)):
        assert torch.equal(t_kernel[2, row, :2], state[2, slot])
        assert torch.equal(t_kernel[2, row, 2:W + 2], bx[row])

    for accepted in ([W, 1, 0, W // 2], [1, W, 3, 0]):
        tape = torch.randn(tape_shape, dtype=torch.float32).to(triton_device, dtype)   # all layers real
        acc = idx([min(a, W) for a in accepted], triton_device)
        s_kernel, s_ref = state.clone(), state.clone()
        short_conv_commit_triton(s_kernel, tape, slots, acc)
        short_conv_commit_reference(s_ref, tape, slots, acc)
        assert torch.equal(s_kernel, s_ref)
        for row, slot in ((0, 2), (1, 0), (3, 5)):
            a = int(acc[row])
            assert torch.equal(s_kernel[:, slot], tape[:, row, a:a + 2])
        assert torch.equal(s_kernel[:, [1, 3, 4]], state[:, [1, 3, 4]])


def test_verify_then_commit_equals_sequential_decode():
    """Through the ops: verify W tokens + commit c equals decoding the first c tokens one by one."""
    W, H = 6, 40
    bx, w, state = inputs("cpu", torch.float64, 1, W, H, seed=11)
    slots = idx([1], "cpu")
    tape = torch.zeros(N_CONV, 1, W + 2, H, dtype=torch.float64)
    verify_out = torch.ops.lfmspark.short_conv_verify(bx, w, state, tape, 0, slots)
    for c in range(W + 1):
        s_seq, s_commit = state.clone(), state.clone()
        outs = [torch.ops.lfmspark.short_conv_prefill(bx[:, t:t + 1], w, s_seq, 0, slots, idx([5 + t], "cpu"),
                                                      idx([1], "cpu")) for t in range(c)]
        torch.ops.lfmspark.short_conv_commit(s_commit, tape, slots, idx([c], "cpu"))
        torch.testing.assert_close(s_commit[0], s_seq[0])
        if outs:
            torch.testing.assert_close(torch.cat(outs, dim=1), verify_out[:, :c])


def _op_args(device: str):
    bx, w, state = inputs(device, torch.float32, 3, 4, 32, seed=5)
    slots, start, lens = idx([1, -1, 4], device), idx([0, 3, 8], device), idx([4, 4, 2], device)
    tape = torch.zeros(N_CONV, 3, 6, 32, device=device)
    return bx, w, state, tape, slots, start, lens


@pytest.mark.parametrize("triton_cpu", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch, triton_cpu):
    if triton_cpu:
        monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    bx, w, state, tape, slots, start, lens = _op_args("cpu")
    ops = torch.ops.lfmspark
    torch.library.opcheck(ops.short_conv_prefill, (bx, w, state, 1, slots, start, lens))
    torch.library.opcheck(ops.short_conv_verify, (bx, w, state, tape, 1, slots))
    torch.library.opcheck(ops.short_conv_commit, (state, tape, slots, idx([2, 0, 4], "cpu")))


def test_torch_compile_matches_eager(monkeypatch):
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    ops = torch.ops.lfmspark

    def step(bx, w, state, tape, slots, start, lens, accepted):
        a = ops.short_conv_prefill(bx, w, state, 0, slots, start, lens)
        b = ops.short_conv_verify(bx, w, state, tape, 1, slots)
        ops.short_conv_commit(state, tape, slots, accepted)
        return a + b

    bx, w, state, tape, slots, start, lens = _op_args("cpu")
    accepted = idx([3, 1, 4], "cpu")
    s_eager, t_eager = state.clone(), tape.clone()
    expected = step(bx, w, s_eager, t_eager, slots, start, lens, accepted)
    got = torch.compile(step, fullgraph=True, dynamic=False)(bx, w, state, tape, slots, start, lens, accepted)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(state, s_eager)
    torch.testing.assert_close(tape, t_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 10])
def test_cuda_bf16_exact_at_lfm2_shapes(W):
    """Native bf16 at LFM2.5-1.2B shapes (H 2048, 10 conv layers): the kernels equal the references."""
    bx, w, _ = inputs("cuda", torch.bfloat16, 16, W, 2048, seed=W)
    state = torch.randn(10, 32, 2, 2048, device="cuda").bfloat16()
    slots = torch.randperm(32, device="cuda")[:16]
    slots[3] = -1
    start = torch.randint(1, 500, (16,), device="cuda")
    s1, s2 = state.clone(), state.clone()
    torch.testing.assert_close(short_conv_prefill_triton(bx, w, s1, 4, slots, start, torch.full_like(slots, W)),
                               short_conv_prefill_reference(bx, w, s2, 4, slots, start, torch.full_like(slots, W)),
                               rtol=0, atol=0)
    assert torch.equal(s1, s2)
    t1 = torch.zeros(10, 16, W + 2, 2048, device="cuda", dtype=torch.bfloat16)
    t2 = t1.clone()
    assert torch.equal(short_conv_verify_triton(bx, w, state, t1, 4, slots),
                       short_conv_verify_reference(bx, w, state, t2, 4, slots))
    assert torch.equal(t1, t2)
    acc = torch.randint(0, W + 1, (16,), device="cuda")
    short_conv_commit_triton(s1, t1, slots, acc)
    short_conv_commit_reference(s2, t2, slots, acc)
    assert torch.equal(s1, s2)
