"""The fused add + RMSNorm + GEMV path of the target (models/layers.py ``norm_linear`` /
``norm_feed_forward``, ops/routing.py ``NormRoute.GEMV``), exercised on CPU (the kernel itself is
checked natively on the GPU in tests/ops/test_add_rmsnorm_gemv.py; the tiny model's head_dim 8 is
below the CUDA attention kernel's minimum).

On CUDA a one-row DECODE forward runs each residual add, RMSNorm and the projection after it as
one ``lfmspark::add_rmsnorm_gemv``. Here the route is forced on CPU by patching the routing
predicate (``routing.product_kernels``: one row goes to the GEMV kernels, as on CUDA) and the
fused op runs its Triton kernel under the interpreter; the reference is the same model on the
plain module path (``product_kernels`` false, as on an unpatched CPU: the add, the norm and the
projection as separate modules). Checked for the dense and MoE targets, fp32 and bf16: decode
logits, caches and how many fused calls a step makes; that prefill, verify, several rows and an
unpatched CPU never take the fused path; the engine's decode loop; and the fused layer under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import os

import pytest
import torch

from lfmspark.ops import routing
import lfmspark.models.layers as layers
import lfmspark.ops.linear.add_rmsnorm_gemv as fused_op_module
from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from op_calls import OpCalls
from spec_fixtures import random_tiny_target


@pytest.fixture
def one_row_route(monkeypatch) -> OpCalls:
    """The CUDA routing on CPU: one row goes to the GEMV kernels (skinny_linear, skinny_swiglu and
    the fused op; their CPU implementations, the fused op's Triton kernel in the interpreter where
    it is on, i.e. on a machine without CUDA; its PyTorch reference otherwise)."""
    monkeypatch.setattr(routing, "product_kernels", lambda x: x.numel() == x.shape[-1])
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(fused_op_module, "use_triton", lambda t: interpreter)
    counting = OpCalls("add_rmsnorm_gemv")
    monkeypatch.setattr(layers, "lfm", counting)
    return counting


def _modules_route(monkeypatch) -> None:
    """The plain module path: no product on lfmspark's kernels (an unpatched CPU's routing)."""
    monkeypatch.setattr(routing, "product_kernels", lambda x: False)


def _model(moe: bool, dtype: torch.dtype):
    return random_tiny_target(moe, seed=11).to(dtype)


def _clone(c: TargetCache) -> TargetCache:
    return TargetCache(k=c.k.clone(), v=c.v.clone(), page_table=c.page_table, conv_state=c.conv_state.clone(), conv_tape=c.conv_tape.clone(),
                       rope=c.rope)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _decode(model, cache, tokens, slot, start) -> list[torch.Tensor]:
    """Logits ``[1, V]`` of one-row DECODE steps feeding ``tokens`` from position ``start``."""
    out = []
    with torch.no_grad():
        for i, t in enumerate(tokens):
            o = model(torch.tensor([[t]]), cache, torch.tensor([slot]), torch.tensor([start + i]),
                      mode=ForwardMode.DECODE, logits_index=torch.zeros(1, dtype=torch.long))
            out.append(o.logits)
    return out


# bounds on the relative logits error of the fused path against the modules: fp32 differs only
# in summation orders; in bf16 the interpreter truncates the kernel's roundings (to nearest on the
# GPU), and the differences travel through the layers and the decode steps
LOGITS_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fused_decode_matches_the_modules(monkeypatch, one_row_route, moe, dtype):
    model = _model(moe, dtype)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 2, 32, 4, dtype, "cpu")
    prompt, slot = [3, 14, 15, 9, 26], 1
    with torch.no_grad():                      # a prompt (several rows: the modules) fills the state
        model(torch.tensor([prompt]), cache, torch.tensor([slot]), torch.tensor([0]), mode=ForwardMode.PREFILL)
    assert one_row_route.calls == []
    ref_cache = _clone(cache)
    steps = [5, 35, 8, 9]
    fused = _decode(model, cache, steps, slot, len(prompt))
    # per step: operator_norm (every layer) + ffn_norm (dense SwiGLU layers only) + the final norm
    n_dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if moe else cfg.num_hidden_layers
    per_step = [False] * cfg.num_hidden_layers + [True] * n_dense + [False]
    assert sorted(args[5] for args in one_row_route.calls) == sorted(per_step * len(steps))   # the swiglu flags
    one_row_route.calls.clear()
    _modules_route(monkeypatch)
    modules = _decode(model, ref_cache, steps, slot, len(prompt))
    assert one_row_route.calls == []
    for a, b in zip(fused, modules, strict=True):
        assert a.dtype == dtype and a.shape == (1, cfg.vocab_size)
        assert _rel_err(a, b) < LOGITS_TOL[dtype]
    assert fused[-1].argmax() == modules[-1].argmax() or dtype == torch.bfloat16
    for x, y in ((cache.k, ref_cache.k), (cache.v, ref_cache.v), (cache.conv_state, ref_cache.conv_state)):
        assert _rel_err(x, y) < LOGITS_TOL[dtype]


def test_only_one_row_decode_is_fused(one_row_route):
    """Prefill (one token too), verify and a two-row decode take the modules; so does the
    compute_logits of prefill's last token."""
    model = _model(False, torch.float32)
    cache = TargetCache.allocate(model.config, 2, 32, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.tensor([[3]]), cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.PREFILL,
              logits_index=torch.zeros(1, dtype=torch.long))
        model(torch.tensor([[3, 4, 5]]), cache, torch.tensor([0]), torch.tensor([1]), mode=ForwardMode.VERIFY)
        model(torch.tensor([[3], [4]]), cache, torch.tensor([0, 1]), torch.tensor([1, 0]), mode=ForwardMode.DECODE)
        assert one_row_route.calls == []
        model(torch.tensor([[3]]), cache, torch.tensor([0]), torch.tensor([1]), mode=ForwardMode.DECODE)
        assert len(one_row_route.calls) == 2 * model.config.num_hidden_layers + 1


def test_cpu_without_the_route_is_unfused(monkeypatch):
    """On CPU (the routing unpatched) a one-row decode step takes the modules: the op is never called."""
    counting = OpCalls("add_rmsnorm_gemv")
    monkeypatch.setattr(layers, "lfm", counting)
    model = _model(False, torch.float32)
    cache = TargetCache.allocate(model.config, 1, 32, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.tensor([[3]]), cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.DECODE)
    assert counting.calls == []


def test_engine_decode_takes_the_fused_path(monkeypatch, one_row_route):
    """Batch-1 greedy generation (the runtime's decode step and its compute_logits) emits the same
    tokens on the fused route as on the modules, and only the fused run calls the op."""
    from lfmspark.runtime import Engine, SamplingParams

    model = _model(False, torch.float32)
    params = SamplingParams(max_new_tokens=5)
    tokens = {}
    for fused in (True, False):
        if not fused:
            _modules_route(monkeypatch)
        one_row_route.calls.clear()
        tokens[fused] = Engine(model, None, max_batch=1, max_seq_len=64).generate([[3, 1, 4, 1, 5]], params)
        tokens[fused] = tokens[fused][0].token_ids
        assert bool(one_row_route.calls) == fused
    assert tokens[True] == tokens[False]


def test_fused_layer_compiles(monkeypatch):
    """A fused decoder layer under torch.compile(fullgraph=True) (the op's fake registration, the
    helpers traced by Dynamo) holds the fused op and matches the eager layer; the op's CPU
    implementation runs inside."""
    from torch._inductor.compile_fx import compile_fx

    from lfmspark.models.lfm2 import Rows

    monkeypatch.setattr(routing, "product_kernels", lambda x: x.numel() == x.shape[-1])
    model = _model(False, torch.float32)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 1, 32, 4, torch.float32, "cpu")
    slots, start = torch.tensor([0]), torch.tensor([2])
    rows = Rows(slots, start, torch.ones(1, dtype=torch.long))
    g = torch.Generator().manual_seed(0)
    h, delta = torch.randn(1, 1, cfg.hidden_size, generator=g), torch.randn(1, 1, cfg.hidden_size, generator=g)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    for i in (0, 1):                                   # a ShortConv and an attention layer
        layer = model.model.layers[i]
        ref_cache = _clone(cache)
        with torch.no_grad():
            want = layer(h, delta, cache.layer_caches(cfg)[i], rows, ForwardMode.DECODE, cache.rope)
            torch._dynamo.reset()
            graphs.clear()
            got = torch.compile(layer, fullgraph=True, dynamic=False, backend=backend)(
                h, delta, ref_cache.layer_caches(cfg)[i], rows, ForwardMode.DECODE, ref_cache.rope)
        fused_calls = [n for gm in graphs for n in gm.graph.nodes if "add_rmsnorm_gemv" in str(n.target)]
        assert len(fused_calls) == 2                   # operator_norm + in_proj/qkv, ffn_norm + SwiGLU
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
