"""``lfmspark::moe_decode``: one token's routing and experts in one launch, against HF's routing
written out (``torch.topk`` on distinct scores) followed by the experts evaluated in fp64.

On CPU the kernel runs under Triton's interpreter as its two task grids (the counters' wait cannot
run there: ops/moe_decode.py); the ``gpu`` tests run the single grid with its counters natively at
LFM2-8B-A1B shapes, eagerly and replayed from a CUDA graph many times (the counters must come back
to zero after every launch, or the next launch would start past its tasks).

Tolerances as tests/ops/test_moe.py (relative Frobenius error against the fp64 oracle).
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from env_vars import interpret_triton
from lfmspark.ops.linear.skinny_linear import counter_buffer
from lfmspark.ops.moe_decode import COUNTERS, DecodeConfig, moe_decode_reference, moe_decode_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
INTERPRETER_BF16_TOL = 1.5e-2


def _inputs(E: int, k: int, H: int, I: int, dtype: torch.dtype, device: str, seed: int,
            bias: str = "fp32", selection: bool = False):
    """``(x, logits, expert_bias, selection_bias, w13, w2)`` for one token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=g).to(dtype)
    logits = (torch.randn(1, E, generator=g) * 2).to(dtype)
    expert_bias = {"none": None, "fp32": torch.randn(E, generator=g) * 0.1,
                   "same-dtype": (torch.randn(E, generator=g) * 0.1).to(dtype)}[bias]
    sel = None
    if selection:   # the routing-locality mode: a large negative bias outside a subset
        sel = torch.where(torch.rand(1, E, generator=g) < 0.5, -1e4, 0.0)
        sel[:, :k] = 0.0
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    to = (lambda t: None if t is None else t.to(device))
    return x.to(device), logits.to(device), to(expert_bias), to(sel), w13.to(device), w2.to(device)


def _oracle(x, logits, expert_bias, sel, k, normalize, scale, w13, w2) -> torch.Tensor:
    """HF's routing (sigmoid in the logits' dtype, biased top-k, unbiased weights), then every
    chosen expert's SwiGLU in fp64, weighted and summed."""
    p = logits.sigmoid()
    scores = (p + expert_bias).float() if expert_bias is not None else p.float()
    if sel is not None:
        scores = scores + sel
    s = scores.sort(dim=-1, descending=True).values[0]
    assert k == s.numel() or s[k - 1] > s[k], "the test needs the k-th and next scores distinct (the chosen set)"
    ids = torch.topk(scores, k, dim=-1).indices[0]
    w = p[0, ids].double()
    if normalize:
        w = w / (w.sum() + 1e-6)
    out = torch.zeros(1, x.shape[1], dtype=torch.float64, device=x.device)
    for e, we in zip(ids.tolist(), (w * scale).tolist()):
        gate, up = (x.double() @ w13[e].double().T).chunk(2, dim=-1)
        out += we * ((torch.nn.functional.silu(gate) * up) @ w2[e].double().T)
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


def _tol(dtype: torch.dtype, device: str) -> float:
    return INTERPRETER_BF16_TOL if (dtype == torch.bfloat16 and device == "cpu") else TOL[dtype]


# ---------------------------------------------------------------------------------------------
# the kernel's task code (the interpreter on CPU, native on CUDA)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E, k, H, I, bias, normalize", [
    (8, 2, 64, 32, "fp32", True),
    (32, 4, 64, 48, "fp32", True),       # I not a power of two: masked columns and K steps
    (6, 1, 40, 24, "none", False),       # E, H not powers of two; one expert
    (5, 5, 32, 16, "same-dtype", True),  # every expert chosen
])
def test_matches_hf_routing_and_experts(triton_device, monkeypatch, dtype, E, k, H, I, bias, normalize):
    interpret_triton(monkeypatch)
    x, logits, eb, _, w13, w2 = _inputs(E, k, H, I, dtype, triton_device, seed=E * 10 + k, bias=bias)
    out = moe_decode_triton(x, logits, eb, None, k, normalize, 2.5, w13, w2)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, _oracle(x, logits, eb, None, k, normalize, 2.5, w13, w2)) < _tol(dtype, triton_device)


@pytest.mark.parametrize("config", [DecodeConfig(1, 1, 1), DecodeConfig(4, 8, 2), DecodeConfig(32, 16, 4)])
def test_tiles_that_do_not_divide_the_shapes(triton_device, monkeypatch, config):
    interpret_triton(monkeypatch)
    x, logits, eb, _, w13, w2 = _inputs(8, 3, 40, 24, torch.float32, triton_device, seed=5)
    out = moe_decode_triton(x, logits, eb, None, 3, True, 1.0, w13, w2, config=config)
    assert _rel_err(out, _oracle(x, logits, eb, None, 3, True, 1.0, w13, w2)) < TOL[torch.float32]


def test_selection_bias_chooses_the_experts(triton_device, monkeypatch):
    interpret_triton(monkeypatch)
    x, logits, eb, _, w13, w2 = _inputs(16, 4, 64, 32, torch.float32, triton_device, seed=9)
    # exclude the experts the token would choose without it
    free_ids = torch.topk(logits.sigmoid() + eb, 4, dim=-1).indices
    sel = torch.zeros(1, 16, device=triton_device).scatter_(1, free_ids, -1e4)
    out = moe_decode_triton(x, logits, eb, sel, 4, True, 1.0, w13, w2)
    want = _oracle(x, logits, eb, sel, 4, True, 1.0, w13, w2)
    assert _rel_err(out, want) < TOL[torch.float32]
    assert _rel_err(out, _oracle(x, logits, eb, None, 4, True, 1.0, w13, w2)) > 0.1


def test_equals_route_then_experts_on_cpu():
    """The op's CPU implementation is moe_route's reference followed by moe_experts' reference."""
    x, logits, eb, sel, w13, w2 = _inputs(16, 4, 64, 32, torch.float32, "cpu", seed=3, selection=True)
    got = torch.ops.lfmspark.moe_decode(x, logits, eb, sel, 4, True, 2.0, w13, w2)
    ids, w = torch.ops.lfmspark.moe_route(logits, eb, sel, 4, True, 2.0)
    assert torch.equal(got, torch.ops.lfmspark.moe_experts(x, ids, w, w13, w2))
    assert torch.equal(got, moe_decode_reference(x, logits, eb, sel, 4, True, 2.0, w13, w2))


def test_top_k_zero_gives_zeros(triton_device, monkeypatch):
    interpret_triton(monkeypatch)
    x, logits, eb, _, w13, w2 = _inputs(8, 1, 32, 16, torch.float32, triton_device, seed=1)
    out = moe_decode_triton(x, logits, eb, None, 0, True, 1.0, w13, w2)
    assert not out.any()


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.zeros(2, 32), logits=torch.zeros(2, 8)), "one token only"),
    (dict(x=torch.zeros(1, 30)), "shapes do not match"),
    (dict(top_k=9), "top_k=9"),
])
def test_errors_name_the_problem(bad, message):
    x, logits, eb, _, w13, w2 = _inputs(8, 2, 32, 16, torch.float32, "cpu", seed=1)
    args = dict(x=x, logits=logits, expert_bias=eb, selection_bias=None, top_k=2, normalize=True, scale=1.0,
                w13=w13, w2=w2)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        torch.ops.lfmspark.moe_decode(**args)


def test_opcheck_and_compile(monkeypatch):
    x, logits, eb, sel, w13, w2 = _inputs(8, 2, 32, 16, torch.float32, "cpu", seed=2, selection=True)
    torch.library.opcheck(torch.ops.lfmspark.moe_decode.default, (x, logits, eb, sel, 2, True, 2.0, w13, w2))
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.moe_decode.default, (x, logits, None, None, 2, False, 1.0, w13, w2))

    def f(x, logits):
        return torch.ops.lfmspark.moe_decode(x * 2.0, logits, eb, None, 2, True, 2.0, w13, w2) + x

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, logits), f(x, logits), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GPU: the single grid with its counters, at LFM2-8B-A1B shapes (H 2048, I 1792, E 32, k 4)

@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, DecodeConfig(1, 1, 4), DecodeConfig(4, 4, 8)])
def test_cuda_a1b_parity_and_counters_reset(config):
    args = _inputs(32, 4, 2048, 1792, torch.bfloat16, "cuda", seed=11)
    x, logits, eb, _, w13, w2 = args
    want = _oracle(x, logits, eb, None, 4, True, 1.0, w13, w2)
    for _ in range(3):
        out = moe_decode_triton(x, logits, eb, None, 4, True, 1.0, w13, w2, config=config)
        assert _rel_err(out, want) < TOL[torch.bfloat16]
        assert not counter_buffer(x.device, COUNTERS)[:3].any()


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_inputs():
    x, logits, eb, sel, w13, w2 = _inputs(32, 4, 2048, 1792, torch.bfloat16, "cuda", seed=12, selection=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.lfmspark.moe_decode(x, logits, eb, sel, 4, True, 1.0, w13, w2)   # compiles, creates the counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.lfmspark.moe_decode(x, logits, eb, sel, 4, True, 1.0, w13, w2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x.copy_(torch.randn(1, 2048, generator=gen).to(x))
        logits.copy_((torch.randn(1, 32, generator=gen) * 2).to(logits))
        sel.copy_(torch.where(torch.rand(1, 32, generator=gen) < 0.5, -1e4, 0.0).to(sel))
        sel[:, :4] = 0.0
        graph.replay()
        assert _rel_err(out, _oracle(x, logits, eb, sel, 4, True, 1.0, w13, w2)) < TOL[torch.bfloat16]
    torch.cuda.synchronize()
    assert not counter_buffer(x.device, COUNTERS)[:3].any()
