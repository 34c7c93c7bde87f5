"""ShortConv ops (gated prefill/decode, gated verify with a tape, commit): Triton kernels (interpreter
on CPU, native on CUDA) against the plain-PyTorch references, registration checks and torch.compile.

The prefill/verify ops take the in_proj output ``bcx [B, T, 3H]`` (B gate, C gate, x) and return
``C * conv(B * x)``. The references are themselves checked against ``F.conv1d`` with the gates
applied outside (HF's formulation), and both against the explicit ungated composition. Every
kernel run starts from poisoned outputs (NaN-filled state rows of unused slots, NaN tape) so
unwritten or wrongly written elements are caught. Under the interpreter fp32->bf16 casts truncate
instead of rounding (here: ``B * x``, the conv sum and ``C * z``), so bf16 results there may differ
from torch's by an ulp or so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.short_conv import (short_conv_commit_reference, short_conv_commit_triton,
                                     short_conv_prefill_reference, short_conv_prefill_triton,
                                     short_conv_verify_reference, short_conv_verify_triton)
from env_vars import interpret_triton

N_CONV, N_SLOTS = 3, 6


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, gated: bool = False) -> None:
    """``gated``: a gated output, three bf16 roundings deep (``B * x``, ``z``, ``C * z``)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    elif not gated:   # one bf16 ulp (interpreter truncation) on values of order 10
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=6e-2, equal_nan=True)
    else:   # up to about three ulps: each truncation can land on the other side of torch's rounding
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-1, equal_nan=True)


def truncate_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by truncation, as Triton's interpreter casts (exact: the dropped bits are zero)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def interpreter_bf16_output(bcx, weight, init):
    """The gated output as the kernels compute it under the interpreter, bit for bit: fp32 products
    and tap-order sums with each bf16 rounding a truncation (``init``: the initial state per row)."""
    b_gate, c_gate, x = bcx.float().chunk(3, dim=-1)
    x_ext = torch.cat([init.float(), truncate_bf16(b_gate * x).float()], dim=1)
    T, K = bcx.shape[1], weight.shape[1]
    acc = torch.zeros_like(c_gate)
    for j in range(K):
        acc = acc + weight[:, j].float() * x_ext[:, j:j + T]
    return truncate_bf16(c_gate * truncate_bf16(acc).float())


def inputs(device: str, dtype: torch.dtype, B: int, T: int, H: int, K: int = 3, seed: int = 0):
    """``bcx [B, T, 3H]`` (an in_proj output: B gate, C gate, x), ``weight [H, K]``, conv state."""
    g = torch.Generator().manual_seed(seed)
    bcx = torch.randn(B, T, 3 * H, generator=g).to(device, dtype)
    weight = torch.randn(H, K, generator=g).to(device, dtype)
    state = torch.randn(N_CONV, N_SLOTS, K - 1, H, generator=g).to(device, dtype)
    return bcx, weight, state


def gated_input(bcx: torch.Tensor) -> torch.Tensor:
    """``B * x``: what the conv state and the tape store."""
    b_gate, _, x = bcx.chunk(3, dim=-1)
    return b_gate * x


def ungated_composition(bcx, weight, init):
    """The unfused formulation, explicitly: ``bx = B * x``, ``z = F.conv1d([init ; bx])``, ``C * z``."""
    b_gate, c_gate, x = bcx.chunk(3, dim=-1)
    bx = b_gate * x
    x_ext = torch.cat([init, bx], dim=1)
    H = bx.shape[-1]
    z = F.conv1d(x_ext.transpose(1, 2), weight[:, None, :], groups=H).transpose(1, 2)
    return c_gate * z


def idx(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, H", [(1, 64), (5, 300), (9, 33), (37, 40)])   # 37: three time blocks
def test_prefill_matches_reference(triton_device, dtype, T, H):
    bcx, w, state = inputs(triton_device, dtype, 4, T, H, seed=T + H)
    slots = idx([3, -1, 0, 5], triton_device)
    start = idx([0, 7, 4, 9], triton_device)          # row 0 starts fresh (zero state), others continue
    lens = idx([T, T, max(T - 2, 0), 1], triton_device)
    s_kernel, s_ref = state.clone(), state.clone()
    out = short_conv_prefill_triton(bcx, w, s_kernel, 1, slots, start, lens)
    ref = short_conv_prefill_reference(bcx, w, s_ref, 1, slots, start, lens)
    assert out.shape == (4, T, H) and out.dtype == dtype and out.is_contiguous()
    close(out[[0, 2, 3]], ref[[0, 2, 3]], dtype, gated=True)
    if dtype == torch.bfloat16 and triton_device == "cpu":
        init = state[1, slots.clamp(min=0)] * (start > 0)[:, None, None]
        assert torch.equal(out[[0, 2, 3]], interpreter_bf16_output(bcx, w, init)[[0, 2, 3]])
    assert torch.equal(out[1], torch.zeros_like(out[1]))             # padding row
    close(s_kernel, s_ref, dtype)
    assert torch.equal(s_kernel[:, [1, 2, 4]], state[:, [1, 2, 4]])  # slots no row owns
    assert torch.equal(s_kernel[[0, 2]], state[[0, 2]])              # other layers
    if dtype == torch.float32:   # the state stores B * x (an fp32 product: exact under the interpreter too)
        bx = gated_input(bcx)
        assert torch.equal(s_kernel[1, 3, -1], bx[0, T - 1])       # row 0: lens T
        assert torch.equal(s_kernel[1, 5, 1], bx[3, 0])            # row 3: lens 1


def test_reference_prefill_equals_hf_conv1d():
    """The reference against HF's formulation: ``C * F.conv1d(B * x)`` on the left-zero-padded
    sequence, and the state = the last K-1 gated inputs; a second chunk continuing from the state
    equals one pass."""
    bcx, w, state = inputs("cpu", torch.float64, 1, 11, 16, seed=3)
    b_gate, c_gate, x = bcx.chunk(3, dim=-1)
    bx = b_gate * x
    slots, zero = idx([0], "cpu"), idx([0], "cpu")
    out = short_conv_prefill_reference(bcx, w, state, 0, slots, zero, idx([11], "cpu"))
    hf = c_gate * F.conv1d(bx.transpose(1, 2), w[:, None, :], padding=2, groups=16)[..., :11].transpose(1, 2)
    tol = dict(rtol=1e-6, atol=1e-5)   # the reference accumulates in fp32 (as the kernels do), fp64 inputs included
    torch.testing.assert_close(out, hf, **tol)
    torch.testing.assert_close(state[0, 0], bx[0, -2:])
    state2 = torch.zeros_like(state)
    first = short_conv_prefill_reference(bcx[:, :6], w, state2, 0, slots, zero, idx([6], "cpu"))
    second = short_conv_prefill_reference(bcx[:, 6:], w, state2, 0, slots, idx([6], "cpu"), idx([5], "cpu"))
    torch.testing.assert_close(torch.cat([first, second], dim=1), hf, **tol)


@pytest.mark.parametrize("impl, dtype", [("reference", torch.float64), ("reference", torch.float32),
                                         ("triton", torch.float32)])
def test_gated_ops_equal_ungated_composition(triton_device, impl, dtype):
    """Prefill (chunked, ragged, a padding row) and verify equal the explicit unfused composition
    ``bx = B * x``, ``z = F.conv1d([state ; bx])``, ``y = C * z`` (computed on the CPU); the
    state/tape hold ``bx``."""
    dev = triton_device if impl == "triton" else "cpu"
    prefill = short_conv_prefill_triton if impl == "triton" else short_conv_prefill_reference
    verify = short_conv_verify_triton if impl == "triton" else short_conv_verify_reference
    tol = dict(rtol=1e-5, atol=1e-5)   # the ops accumulate in fp32, fp64 inputs included
    T, H, K = 7, 20, 3
    bcx, w, state = inputs("cpu", dtype, 3, T, H, K, seed=21)
    state[:, 4] = float("nan")                                        # poisoned: a slot no row uses
    slots, lens = idx([2, -1, 0], "cpu"), idx([T, T, 4], "cpu")
    start = idx([5, 3, 0], "cpu")                                     # row 2 starts fresh
    init = state[1, slots.clamp(min=0)].clone()
    init[2] = 0
    expected = ungated_composition(bcx, w, init)
    bx = gated_input(bcx)
    x_ext = torch.cat([init, bx], dim=1)
    d_bcx, d_w, d_slots = bcx.to(dev), w.to(dev), slots.to(dev)
    s = state.to(dev, copy=True)
    out = prefill(d_bcx, d_w, s, 1, d_slots, start.to(dev), lens.to(dev)).cpu()
    s = s.cpu()
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], **tol)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(s[1, 2], x_ext[0, T:T + K - 1])               # the state holds bx exactly
    assert torch.equal(s[1, 0], x_ext[2, 4:4 + K - 1])
    assert s[1, 4].isnan().all()
    # chunked: the first 3 tokens, then the rest continuing from the stored state
    s2 = state.to(dev, copy=True)
    first = prefill(d_bcx[:, :3], d_w, s2, 1, d_slots, start.to(dev), idx([3, 3, 3], dev))
    second = prefill(d_bcx[:, 3:], d_w, s2, 1, d_slots, (start + 3).to(dev), (lens - 3).to(dev))
    torch.testing.assert_close(torch.cat([first, second], dim=1).cpu()[[0, 2]], expected[[0, 2]], **tol)
    # verify: from the committed state (no fresh start), the tape holds [state ; bx]
    tape = torch.full((N_CONV, 3, T + K - 1, H), float("nan"), dtype=dtype, device=dev)
    init_v = state[1, slots.clamp(min=0)]
    out_v = verify(d_bcx, d_w, state.to(dev), tape, 1, d_slots).cpu()
    tape = tape.cpu()
    torch.testing.assert_close(out_v[[0, 2]], ungated_composition(bcx, w, init_v)[[0, 2]], **tol)
    assert torch.equal(out_v[1], torch.zeros_like(out_v[1]))
    assert torch.equal(tape[1, [0, 2]], torch.cat([init_v, bx], dim=1)[[0, 2]])
    assert tape[1, 1].isnan().all()


@pytest.mark.parametrize("op", ["prefill", "verify"])
def test_strided_bcx(triton_device, op):
    """A view of bcx with strided rows/tokens (channels contiguous) or with strided channels equals
    the contiguous input."""
    T, H = 5, 24
    big, w, state = inputs(triton_device, torch.float32, 4, 2 * T, 3 * H + 6, seed=8)
    w = w[:H].contiguous()
    state = state[..., :H].contiguous()
    views = [big[::2, ::2, 3:3 + 3 * H],                               # rows/tokens strided
             big[::2, ::2, :6 * H:2]]                                  # channels strided
    slots, start, lens = idx([1, 3], triton_device), idx([2, 0], triton_device), idx([T, 3], triton_device)
    for view in views:
        dense = view.contiguous()
        if op == "prefill":
            s1, s2 = state.clone(), state.clone()
            y1 = short_conv_prefill_triton(view, w, s1, 0, slots, start, lens)
            y2 = short_conv_prefill_triton(dense, w, s2, 0, slots, start, lens)
            assert torch.equal(s1, s2)
        else:
            tape1 = torch.full((N_CONV, 2, T + 2, H), float("nan"), device=triton_device)
            tape2 = tape1.clone()
            y1 = short_conv_verify_triton(view, w, state, tape1, 0, slots)
            y2 = short_conv_verify_triton(dense, w, state, tape2, 0, slots)
            assert torch.equal(tape1.nan_to_num(), tape2.nan_to_num())
        assert torch.equal(y1, y2)


@pytest.mark.parametrize("triton_cpu", [False, True], ids=["reference", "triton"])
def test_shape_validation(monkeypatch, triton_cpu):
    if triton_cpu:
        interpret_triton(monkeypatch)
    ops = torch.ops.lfmspark
    bcx, w, state = inputs("cpu", torch.float32, 2, 3, 8, seed=1)
    tape = torch.zeros(N_CONV, 2, 5, 8)
    slots, start, lens = idx([0, 1], "cpu"), idx([0, 0], "cpu"), idx([3, 3], "cpu")
    with pytest.raises(ValueError, match="3 \\* H"):
        ops.short_conv_prefill(bcx[..., :-1], w, state, 0, slots, start, lens)
    with pytest.raises(ValueError, match="3 \\* H"):
        ops.short_conv_verify(bcx[..., :-1], w, state, tape, 0, slots)
    with pytest.raises(ValueError, match="H = bcx.shape"):
        ops.short_conv_prefill(bcx[..., :21], w, state, 0, slots, start, lens)
    with pytest.raises(ValueError, match="H = bcx.shape"):
        ops.short_conv_verify(bcx, w[:7], state, tape, 0, slots)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fb, fw = mode.from_tensor(bcx), mode.from_tensor(w)
        fs, ft = mode.from_tensor(state), mode.from_tensor(tape)
        out = ops.short_conv_verify(fb, fw, fs, ft, 0, mode.from_tensor(slots))
        assert out.shape == (2, 3, 8)
        with pytest.raises(ValueError, match="3 \\* H"):
            ops.short_conv_verify(fb[..., :-1], fw, fs, ft, 0, mode.from_tensor(slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("W, H", [(1, 64), (10, 300), (4, 17)])
def test_verify_and_commit_match_reference(triton_device, dtype, W, H):
    bcx, w, state = inputs(triton_device, dtype, 4, W, H, seed=W * H)
    slots = idx([2, 0, -1, 5], triton_device)
    tape_shape = (N_CONV, 4, W + 2 + 1, H)                           # one spare column: a wider tape
    t_kernel = torch.full(tape_shape, float("nan"), dtype=dtype, device=triton_device)
    t_ref = t_kernel.clone()
    s_before = state.clone()
    out = short_conv_verify_triton(bcx, w, state, t_kernel, 2, slots)
    ref = short_conv_verify_reference(bcx, w, state, t_ref, 2, slots)
    assert torch.equal(state, s_before)                              # verify never touches the state
    assert out.shape == (4, W, H) and out.dtype == dtype
    close(out[[0, 1, 3]], ref[[0, 1, 3]], dtype, gated=True)
    if dtype == torch.bfloat16 and triton_device == "cpu":
        init = state[2, slots.clamp(min=0)]
        assert torch.equal(out[[0, 1, 3]], interpreter_bf16_output(bcx, w, init)[[0, 1, 3]])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    close(t_kernel, t_ref, dtype)
    assert t_kernel[2, [0, 1, 3], : W + 2].isfinite().all()          # every tape column of real rows written
    assert t_kernel[2, 2].isnan().all() and t_kernel[:2].isnan().all() and t_kernel[2, :, W + 2:].isnan().all()
    # the tape holds [state ; B * x]: exactly, except bf16 under the interpreter (truncated product)
    bx = gated_input(bcx)
    exact = dtype == torch.float32 or triton_device == "cuda"
    for row, slot in ((0, 2), (1, 0), (3, 5)):
        assert torch.equal(t_kernel[2, row, :2], state[2, slot])
        if exact:
            assert torch.equal(t_kernel[2, row, 2:W + 2], bx[row])
        else:
            close(t_kernel[2, row, 2:W + 2], bx[row], dtype)

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
    bcx, w, state = inputs("cpu", torch.float64, 1, W, H, seed=11)
    slots = idx([1], "cpu")
    tape = torch.zeros(N_CONV, 1, W + 2, H, dtype=torch.float64)
    verify_out = torch.ops.lfmspark.short_conv_verify(bcx, w, state, tape, 0, slots)
    for c in range(W + 1):
        s_seq, s_commit = state.clone(), state.clone()
        outs = [torch.ops.lfmspark.short_conv_prefill(bcx[:, t:t + 1], w, s_seq, 0, slots, idx([5 + t], "cpu"),
                                                      idx([1], "cpu")) for t in range(c)]
        torch.ops.lfmspark.short_conv_commit(s_commit, tape, slots, idx([c], "cpu"))
        torch.testing.assert_close(s_commit[0], s_seq[0])
        if outs:
            torch.testing.assert_close(torch.cat(outs, dim=1), verify_out[:, :c])


def _op_args(device: str):
    bcx, w, state = inputs(device, torch.float32, 3, 4, 32, seed=5)
    slots, start, lens = idx([1, -1, 4], device), idx([0, 3, 8], device), idx([4, 4, 2], device)
    tape = torch.zeros(N_CONV, 3, 6, 32, device=device)
    return bcx, w, state, tape, slots, start, lens


@pytest.mark.parametrize("triton_cpu", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch, triton_cpu):
    if triton_cpu:
        interpret_triton(monkeypatch)
    bcx, w, state, tape, slots, start, lens = _op_args("cpu")
    ops = torch.ops.lfmspark
    torch.library.opcheck(ops.short_conv_prefill, (bcx, w, state, 1, slots, start, lens))
    torch.library.opcheck(ops.short_conv_verify, (bcx, w, state, tape, 1, slots))
    torch.library.opcheck(ops.short_conv_commit, (state, tape, slots, idx([2, 0, 4], "cpu")))


def test_torch_compile_matches_eager(monkeypatch):
    interpret_triton(monkeypatch)
    ops = torch.ops.lfmspark

    def step(bcx, w, state, tape, slots, start, lens, accepted):
        a = ops.short_conv_prefill(bcx, w, state, 0, slots, start, lens)
        b = ops.short_conv_verify(bcx, w, state, tape, 1, slots)
        ops.short_conv_commit(state, tape, slots, accepted)
        return a + b

    bcx, w, state, tape, slots, start, lens = _op_args("cpu")
    accepted = idx([3, 1, 4], "cpu")
    s_eager, t_eager = state.clone(), tape.clone()
    expected = step(bcx, w, s_eager, t_eager, slots, start, lens, accepted)
    got = torch.compile(step, fullgraph=True, dynamic=False)(bcx, w, state, tape, slots, start, lens, accepted)
    assert got.shape == (3, 4, 32)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(state, s_eager)
    torch.testing.assert_close(tape, t_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 10])
def test_cuda_bf16_exact_at_lfm2_shapes(W):
    """Native bf16 at LFM2.5-1.2B shapes (H 2048, 10 conv layers): the kernels equal the references
    (and so the unfused bf16 composition ``C * conv(B * x)``) bit for bit."""
    bcx, w, _ = inputs("cuda", torch.bfloat16, 16, W, 2048, seed=W)
    state = torch.randn(10, 32, 2, 2048, device="cuda").bfloat16()
    slots = torch.randperm(32, device="cuda")[:16]
    slots[3] = -1
    start = torch.randint(1, 500, (16,), device="cuda")
    s1, s2 = state.clone(), state.clone()
    torch.testing.assert_close(short_conv_prefill_triton(bcx, w, s1, 4, slots, start, torch.full_like(slots, W)),
                               short_conv_prefill_reference(bcx, w, s2, 4, slots, start, torch.full_like(slots, W)),
                               rtol=0, atol=0)
    assert torch.equal(s1, s2)
    t1 = torch.zeros(10, 16, W + 2, 2048, device="cuda", dtype=torch.bfloat16)
    t2 = t1.clone()
    assert torch.equal(short_conv_verify_triton(bcx, w, state, t1, 4, slots),
                       short_conv_verify_reference(bcx, w, state, t2, 4, slots))
    assert torch.equal(t1, t2)
    acc = torch.randint(0, W + 1, (16,), device="cuda")
    short_conv_commit_triton(s1, t1, slots, acc)
    short_conv_commit_reference(s2, t2, slots, acc)
    assert torch.equal(s1, s2)
