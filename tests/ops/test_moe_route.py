"""``lfmspark::moe_route``: the one-launch router (interpreter on CPU, native on CUDA) against HF's
routing written out in eager PyTorch, and ``top_k_ids`` (the reference's selection) against
``torch.topk``. Random logits with and without the expert bias and a per-token selection bias,
normalised or not, every ``k`` from 1 to all experts, expert counts that are not powers of two,
token counts across program boundaries; ties broken by the lower index; one token's results alone
and inside a launch of many (exact mode relies on it); errors, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from env_vars import interpret_triton
from lfmspark.ops.moe_route import moe_route_reference, moe_route_triton, top_k_ids


def _hf_routing(logits, expert_bias, selection_bias, k, normalize, scale):
    """HF ``Lfm2MoeSparseMoeBlock``'s routing, step by step in the logits' dtype, with
    ``torch.topk`` on scores made distinct by the test's construction (the oracle)."""
    weights = logits.sigmoid()
    scores = (weights + expert_bias).float() if expert_bias is not None else weights.float()
    if selection_bias is not None:
        scores = scores + selection_bias
    ids = torch.topk(scores, k, dim=-1).indices
    chosen = torch.gather(weights, 1, ids)
    if normalize:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-6)
    return ids, chosen * scale


def _inputs(N, E, dtype, device, seed, bias=True, selection=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, E, generator=g) * 2).to(dtype)
    expert_bias = torch.randn(E, generator=g) * 0.1 if bias else None
    sel = None
    if selection:   # the routing-locality mode: a large negative bias outside a subset per token
        sel = torch.where(torch.rand(N, E, generator=g) < 0.5, -1e4, 0.0)
        sel[:, 0] = 0.0
    to = (lambda t: None if t is None else t.to(device))
    return logits.to(device), to(expert_bias), to(sel)


def _distinct(logits, expert_bias, selection_bias) -> bool:
    """Whether every token's selection scores are distinct (then torch.topk's order is defined)."""
    scores = logits.sigmoid().float() + (expert_bias if expert_bias is not None else 0.0)
    if selection_bias is not None:
        scores = scores + selection_bias
    s = scores.sort(dim=-1).values
    return bool((s[:, 1:] > s[:, :-1]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k", [(1, 32, 4), (10, 32, 4), (17, 32, 4), (40, 8, 2), (5, 5, 1), (3, 6, 6),
                                     (33, 64, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_routes_as_hf(triton_device, monkeypatch, dtype, N, E, k, normalize):
    interpret_triton(monkeypatch)
    logits, expert_bias, _ = _inputs(N, E, dtype, triton_device, seed=N * 100 + E + k)
    assert _distinct(logits, expert_bias, None)
    ids, w = moe_route_triton(logits, expert_bias, None, k, normalize, 2.5)
    want_ids, want_w = _hf_routing(logits, expert_bias, None, k, normalize, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == dtype and ids.shape == w.shape == (N, k)
    assert torch.equal(ids, want_ids)
    # the kernel normalises and scales in fp32 and rounds once; HF rounds after each of 3 steps
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -6, "atol": 0.0}
    torch.testing.assert_close(w, want_w, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_bias_selects_but_does_not_weigh(triton_device, monkeypatch, dtype):
    interpret_triton(monkeypatch)
    logits, expert_bias, sel = _inputs(20, 32, dtype, triton_device, seed=7, selection=True)
    ids, w = moe_route_triton(logits, expert_bias, sel, 4, True, 1.0)
    want_ids, want_w = _hf_routing(logits, expert_bias, sel, 4, True, 1.0)
    assert torch.equal(ids, want_ids)
    assert bool((sel.gather(1, ids) == 0).all())        # only experts of each token's subset
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -6, "atol": 0.0}
    torch.testing.assert_close(w, want_w, **tol)


def test_a_bias_in_the_logits_dtype_adds_in_that_dtype(triton_device, monkeypatch):
    """A model cast whole to bf16 (as tests do) holds a bf16 expert bias: the scores then round."""
    interpret_triton(monkeypatch)
    logits, expert_bias, _ = _inputs(64, 32, torch.bfloat16, triton_device, seed=5)
    expert_bias = expert_bias.to(torch.bfloat16)
    ids, _ = moe_route_triton(logits, expert_bias, None, 4, True, 1.0)
    want_ids, _ = moe_route_reference(logits, expert_bias, None, 4, True, 1.0)
    assert torch.equal(ids, want_ids)


def test_no_expert_bias_and_ties_go_to_the_lower_index(triton_device, monkeypatch):
    interpret_triton(monkeypatch)
    # sigmoid(0) ties: experts 1 and 3 above, then 0, 2, 4 tied; a row of five equal logits
    logits = torch.tensor([[0.0, 3.0, 0.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]], device=triton_device)
    ids, w = moe_route_triton(logits, None, None, 3, True, 1.0)
    assert ids.tolist() == [[1, 3, 0], [0, 1, 2]]
    assert torch.equal(ids, top_k_ids(logits.sigmoid(), 3))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, device=triton_device), rtol=1e-5, atol=0)


def test_a_token_routes_the_same_bits_alone_and_among_many(triton_device, monkeypatch):
    interpret_triton(monkeypatch)
    logits, expert_bias, _ = _inputs(40, 32, torch.bfloat16, triton_device, seed=3)
    ids, w = moe_route_triton(logits, expert_bias, None, 4, True, 1.7)
    for t in (0, 15, 16, 39):
        one_ids, one_w = moe_route_triton(logits[t:t + 1].clone(), expert_bias, None, 4, True, 1.7)
        assert torch.equal(one_ids[0], ids[t]) and torch.equal(one_w[0], w[t])


def test_empty_launches(triton_device, monkeypatch):
    interpret_triton(monkeypatch)
    ids, w = moe_route_triton(torch.zeros(0, 8, device=triton_device), None, None, 2, True, 1.0)
    assert ids.shape == w.shape == (0, 2)
    ids, w = moe_route_triton(torch.zeros(3, 8, device=triton_device), None, None, 0, True, 1.0)
    assert ids.shape == w.shape == (3, 0)


def test_the_op_on_cpu_is_the_reference():
    logits, expert_bias, sel = _inputs(6, 32, torch.bfloat16, "cpu", seed=11, selection=True)
    got = torch.ops.lfmspark.moe_route(logits, expert_bias, sel, 4, True, 2.0)
    want = moe_route_reference(logits, expert_bias, sel, 4, True, 2.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=9), "top_k=9"),
    (dict(expert_bias=torch.zeros(7)), "expert_bias must be a float"),
    (dict(expert_bias=torch.zeros(8, dtype=torch.int64)), "expert_bias must be a float"),
    (dict(selection_bias=torch.zeros(3, 8)), "selection_bias must be fp32"),
    (dict(logits=torch.zeros(2, 8, dtype=torch.int32)), "float"),
])
def test_errors_name_the_argument(bad, message):
    args = dict(logits=torch.zeros(2, 8), expert_bias=None, selection_bias=None, top_k=2, normalize=True, scale=1.0)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        torch.ops.lfmspark.moe_route(**args)


def test_opcheck_and_compile():
    logits, expert_bias, sel = _inputs(5, 16, torch.float32, "cpu", seed=2, selection=True)
    torch.library.opcheck(torch.ops.lfmspark.moe_route.default, (logits, expert_bias, sel, 4, True, 2.0))
    torch.library.opcheck(torch.ops.lfmspark.moe_route.default, (logits, None, None, 2, False, 1.0))
    route = torch.compile(lambda x, b: torch.ops.lfmspark.moe_route(x, b, None, 4, True, 2.0), fullgraph=True)
    got = route(logits, expert_bias)
    want = moe_route_reference(logits, expert_bias, None, 4, True, 2.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("k", [1, 4, 8])
def test_top_k_ids_equals_torch_topk_on_distinct_scores(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.rand(64, 32, generator=gen) + torch.randn(32, generator=gen) * 0.1   # fp32, like the router
    assert torch.equal(top_k_ids(scores, k), torch.topk(scores, k).indices)


def test_top_k_ids_breaks_ties_by_lower_index_and_is_compilable():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    expected = torch.tensor([[1, 3, 0], [0, 1, 2]])
    assert torch.equal(top_k_ids(scores, 3), expected)
    assert torch.equal(torch.compile(top_k_ids, fullgraph=True)(scores, 3), expected)
