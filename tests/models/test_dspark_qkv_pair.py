"""The draft layer's fused q/K/V path (models/dspark.py ``DraftLayer.forward``): one
``lfmspark::skinny_linear_pair`` over ``q_proj`` and the layer's ``kv_proj`` slice, then one
``lfmspark::qkv_window_attention`` (or ``lfmspark::qkv_norm_rope_write`` and the attention, the
route of longer windows), against the unfused path it replaces (two products, the
``q_norm`` module, ``apply_rope``, ``lfmspark::kv_norm_rope_write``) and the cache-free oracle
(tests/reference_dspark.py): the block's hidden states, the K/V it writes to the draft cache, the
proposals, and which ops ran.

The fused path is taken on the skinny route (2-16 rows), which ops/routing.py grants on
CUDA only, so the CPU tests route rows as CUDA does by default (1-16 rows; the predicate
monkeypatched, as tests/models/test_fused_norm.py does); the unfused path is today's code, reached
by making ``linear_pair`` decline. With the ops' CPU references the two paths are bit-identical:
the products are the same ``F.linear`` calls, and the op's reference is the unfused RMSNorm and
RoPE. On the Triton kernels (interpreter; CUDA in the ``gpu`` tests) the products' summation order
and the kernel's reductions differ, so results agree to rounding. The norms between layers
(a ``NormedCarry``, which would feed the pair a carried norm) stay off here:
tests/models/test_norm_carry.py covers them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from eager_ops import EagerOpRecorder
from spec_fixtures import slots_view
from lfmspark.ops import routing
from lfmspark.models import dspark
from lfmspark.models.cache import DraftCache
from lfmspark.models.config import DraftConfig
from lfmspark.models.presets import random_draft
from reference_dspark import reference_block
from env_vars import interpret_triton

V, H, TAPS = 96, 32, 3
PAIR, QKV, KV = ("lfmspark.skinny_linear_pair.default", "lfmspark.qkv_norm_rope_write.default",
                 "lfmspark.kv_norm_rope_write.default")
WINDOW = "lfmspark.qkv_window_attention.default"


@pytest.fixture(autouse=True)
def _no_norm_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers hand on pending deltas, not carried norms (the next norm's weight withheld), so
    the two paths' outputs compare as tensors; tests/models/test_norm_carry.py covers the carry."""
    forward = dspark.DraftLayer.forward

    def without_next_norm(self, x, delta, kv_weight, k_norm_weight, k_cache, v_cache, page_table, rope, slots, start,
                          lens, next_norm=None):
        return forward(self, x, delta, kv_weight, k_norm_weight, k_cache, v_cache, page_table, rope, slots, start, lens)

    monkeypatch.setattr(dspark.DraftLayer, "forward", without_next_norm)


def _config(neox: bool = False, block: int = 5, heads: int = 4, head_dim: int = 8, hidden: int = H) -> DraftConfig:
    return DraftConfig(hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=2, head_dim=head_dim, block_size=block, target_layer_ids=tuple(range(TAPS)),
                       mask_token_id=V - 1, vocab_size=V, rms_norm_eps=1e-6, rope_theta=10_000.0,
                       rope_is_neox_style=neox, markov_rank=8, markov_head_type="vanilla",
                       enable_confidence_head=False, confidence_head_with_markov=False)


def _draft(cfg: DraftConfig, dtype: torch.dtype, device: str, seed: int = 0):
    """A random draft whose every part changes the output (as tests/models/test_dspark_draft.py's)."""
    torch.manual_seed(seed)
    draft = random_draft(cfg, cfg.hidden_size, dtype, device, seed=seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 1 or name == "k_norm":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3 * (32 / cfg.hidden_size) ** 0.5)
    embed = nn.Embedding(V, cfg.hidden_size).to(device, dtype)
    lm_head = nn.Linear(cfg.hidden_size, V, bias=False).to(device, dtype)
    nn.init.normal_(embed.weight, 0, 1.0)
    nn.init.normal_(lm_head.weight, 0, 0.3)
    draft.attach_target(embed, lm_head)
    return draft, embed, lm_head


def _with_context(draft, cfg: DraftConfig, dtype: torch.dtype, device: str, lengths: list[int], slots: list[int]):
    """A draft cache with each row's context injected; returns it, the rows' features (for the
    oracle), the slots and the block starts (the context lengths)."""
    cache = DraftCache.allocate(cfg, 4, 64, dtype, device)
    g = torch.Generator().manual_seed(len(lengths))
    feats = [torch.randn(n, TAPS * cfg.hidden_size, generator=g).to(device, dtype) for n in lengths]
    aux = torch.zeros(len(lengths), max(lengths), TAPS * cfg.hidden_size, dtype=dtype, device=device)
    for i, f in enumerate(feats):
        aux[i, :len(f)] = f
    slots_t = torch.tensor(slots, device=device)
    start = torch.tensor(lengths, device=device)
    with torch.no_grad():
        draft.inject_context(aux, cache, slots_t, torch.zeros_like(start), start)
    return cache, feats, slots_t, start


def _route_windows(m: pytest.MonkeyPatch, window: str) -> None:
    """``window == "0"``: every attention window on the two launches (qkv_norm_rope_write +
    cache_attention), the path longer windows take."""
    if window == "0":
        m.setattr(dspark, "window_attention", lambda *args: False)


def _route_few_rows(m: pytest.MonkeyPatch) -> None:
    """CUDA's default routing on the CPU: 1-16 rows on the skinny ops (their CPU implementations)."""
    m.setattr(routing, "product_kernels", lambda x: True)


def _block(draft, cache: DraftCache, anchors, slots, start, fused: bool, monkeypatch: pytest.MonkeyPatch,
           route: bool = True):
    """The block's ``(x, delta)``, the draft cache after it (a copy), and the ops it dispatched."""
    c = DraftCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table, rope=cache.rope)
    with monkeypatch.context() as m:
        if route:
            _route_few_rows(m)
        if not fused:
            m.setattr(dspark, "linear_pair", lambda *args: None)   # today's unfused path
        recorder = EagerOpRecorder()
        with torch.no_grad(), recorder:
            x, delta = draft.block_hidden(anchors, c, slots, start)
    ops = recorder.ops.compute + recorder.ops.inside
    return x, delta, c.k, c.v, ops


def _check_ops(ops, fused: bool, n_layers: int, window: bool = True) -> None:
    """Fused: one pair product and one qkv op per layer (the window attention, which includes it,
    unless ``window`` is off), no K/V write of its own; unfused the reverse. Either way the block's
    ``lens`` is made once, not per layer."""
    window = fused and window
    assert ops[PAIR] == (n_layers if fused else 0)
    assert ops[WINDOW] == (n_layers if window else 0)
    assert ops[QKV] == (n_layers if fused and not window else 0)
    assert ops[KV] == (0 if fused else n_layers)
    assert ops["aten.full_like.default"] == 1


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _rows(device: str, B: int):
    lengths, slots = [7, 12, 3][:B], [2, 0, 3][:B]
    return lengths, slots, torch.tensor([5, 17, 40][:B], device=device)


@pytest.mark.parametrize("window", ["1", "0"], ids=["window", "qkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
def test_fused_path_is_the_unfused_path_on_the_references(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                          neox: bool, window: str) -> None:
    """Two rows of a 5-token block (10 rows: the skinny route): hidden states and both caches
    bit-identical, the block's K/V really written, the ops as expected; with and without the window
    attention (the two-launch path forced by patching the route)."""
    _route_windows(monkeypatch, window)
    cfg = _config(neox=neox)
    draft, _, _ = _draft(cfg, dtype, "cpu", seed=3 + neox)
    lengths, slots, anchors = _rows("cpu", 2)
    cache, _, slots_t, start = _with_context(draft, cfg, dtype, "cpu", lengths, slots)
    x_f, d_f, k_f, v_f, ops_f = _block(draft, cache, anchors, slots_t, start, True, monkeypatch)
    x_u, d_u, k_u, v_u, ops_u = _block(draft, cache, anchors, slots_t, start, False, monkeypatch)
    _check_ops(ops_f, True, cfg.num_hidden_layers, window == "1")
    _check_ops(ops_u, False, cfg.num_hidden_layers)
    assert torch.equal(x_f, x_u) and torch.equal(d_f, d_u)
    assert torch.equal(k_f, k_u) and torch.equal(v_f, v_u)
    for b, (slot, s) in enumerate(zip(slots, lengths)):       # the block's own entries were written
        block = slice(s, s + cfg.block_size)
        assert (slots_view(cache, k_f)[:, slot, block] != slots_view(cache, cache.k)[:, slot, block]).all(dim=-1).any()
        assert (slots_view(cache, v_f)[:, slot, block] != slots_view(cache, cache.v)[:, slot, block]).all(dim=-1).any()
    assert torch.equal(slots_view(cache, k_f)[:, :, :min(lengths)], slots_view(cache, cache.k)[:, :, :min(lengths)])   # the context untouched


def test_routing_decides_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the patched predicate (CPU: never routed) and with 3 rows of 6 tokens (18 rows: past
    the pair's 16), the layer runs the unfused path."""
    cfg = _config(block=6)
    draft, _, _ = _draft(cfg, torch.float32, "cpu")
    lengths, slots, anchors = _rows("cpu", 3)
    cache, _, slots_t, start = _with_context(draft, cfg, torch.float32, "cpu", lengths, slots)
    _check_ops(_block(draft, cache, anchors[:2], slots_t[:2], start[:2], True, monkeypatch, route=False)[4], False, 2)
    _check_ops(_block(draft, cache, anchors, slots_t, start, True, monkeypatch)[4], False, 2)


@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
@pytest.mark.parametrize("heads, head_dim, window", [(2, 16, "1"), (4, 16, "1"), (4, 16, "0")],
                         ids=["q32", "q64", "q64-qkv"])
def test_fused_path_on_the_triton_kernels(monkeypatch: pytest.MonkeyPatch, neox: bool, heads: int,
                                          head_dim: int, window: str) -> None:
    """The ops on their Triton kernels (interpreter), fp32: the fused block agrees with the unfused
    one to rounding (hidden states, written K/V), and its proposals with the cache-free oracle.
    q widths of 32 (the pair's tiles narrowed to 32 columns) and 64; the 64 also without the window
    attention."""
    interpret_triton(monkeypatch)
    _route_windows(monkeypatch, window)
    cfg = _config(neox=neox, heads=heads, head_dim=head_dim)
    draft, embed, lm_head = _draft(cfg, torch.float32, "cpu", seed=5)
    lengths, slots, anchors = _rows("cpu", 2)
    cache, feats, slots_t, start = _with_context(draft, cfg, torch.float32, "cpu", lengths, slots)
    x_f, d_f, k_f, v_f, ops_f = _block(draft, cache, anchors, slots_t, start, True, monkeypatch)
    x_u, d_u, k_u, v_u, _ = _block(draft, cache, anchors, slots_t, start, False, monkeypatch)
    _check_ops(ops_f, True, cfg.num_hidden_layers, window == "1")
    for got, want in ((x_f, x_u), (d_f, d_u), (k_f, k_u), (v_f, v_u)):
        assert _rel_err(got, want) < 1e-5, _rel_err(got, want)
    with monkeypatch.context() as m, torch.no_grad():
        _route_few_rows(m)
        proposal = draft.propose(anchors, cache, slots_t, start, logits=True)
    for i in range(2):
        tokens, logits, _ = reference_block(draft, feats[i], int(anchors[i]), embed.weight, lm_head.weight)
        torch.testing.assert_close(proposal.logits[i], logits, rtol=1e-4, atol=1e-4)
        assert proposal.tokens[i].tolist() == tokens.tolist()


def test_fused_path_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """``block_hidden`` compiled with ``fullgraph`` (as the runtime's draft regions) takes the fused
    path, inside the compiled graph, and computes what eager does."""
    from lfmspark.graphs.compile import COMPILE_OPTIONS, configure_compile

    cfg = _config()
    draft, _, _ = _draft(cfg, torch.float32, "cpu", seed=7)
    lengths, slots, anchors = _rows("cpu", 2)
    cache, _, slots_t, start = _with_context(draft, cfg, torch.float32, "cpu", lengths, slots)
    x_e, d_e, k_e, v_e, _ = _block(draft, cache, anchors, slots_t, start, True, monkeypatch)
    configure_compile(n_variants=4)
    torch._dynamo.reset()
    compiled = torch.compile(draft.block_hidden, **COMPILE_OPTIONS)
    c = DraftCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table, rope=cache.rope)
    with monkeypatch.context() as m:
        _route_few_rows(m)
        with torch.no_grad():
            compiled(anchors, c, slots_t, start)                  # compiles (the recorder stays off)
        c = DraftCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table, rope=cache.rope)
        recorder = EagerOpRecorder()
        with torch.no_grad(), recorder:
            x_c, d_c = compiled(anchors, c, slots_t, start)
    torch._dynamo.reset()
    assert recorder.ops.inside[PAIR] == cfg.num_hidden_layers and recorder.ops.inside[WINDOW] == cfg.num_hidden_layers
    assert not recorder.ops.compute                                 # everything ran in the compiled graph
    for got, want in ((x_c, x_e), (d_c, d_e), (c.k, k_e), (c.v, v_e)):
        assert _rel_err(got, want) < 1e-6, _rel_err(got, want)


# ---------------------------------------------------------------------------------------------
# CUDA: the real routing, the Triton kernels

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B, block", [(1, 10), (2, 5)])
def test_gpu_fused_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, B: int, block: int) -> None:
    """A draft with 2048-wide q (32 heads of 64) and 8 K/V heads, at the round's 10 rows: the
    fused path is taken by default, agrees with the unfused one to rounding (the pair's split-K
    differs from the two products'), and in fp32 its proposals match the cache-free oracle."""
    cfg = dataclasses.replace(_config(block=block), hidden_size=512, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=64, intermediate_size=1024)
    draft, embed, lm_head = _draft(cfg, dtype, "cuda", seed=11)
    lengths, slots, anchors = _rows("cuda", B)
    cache, feats, slots_t, start = _with_context(draft, cfg, dtype, "cuda", lengths, slots)
    x_f, d_f, k_f, v_f, ops_f = _block(draft, cache, anchors, slots_t, start, True, monkeypatch, route=False)
    x_u, d_u, k_u, v_u, ops_u = _block(draft, cache, anchors, slots_t, start, False, monkeypatch, route=False)
    _check_ops(ops_f, True, cfg.num_hidden_layers)
    _check_ops(ops_u, False, cfg.num_hidden_layers)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((x_f, x_u), (d_f, d_u), (k_f, k_u), (v_f, v_u)):
        assert _rel_err(got, want) < tol, _rel_err(got, want)
    if dtype == torch.float32:
        with torch.no_grad():
            proposal = draft.propose(anchors, cache, slots_t, start, logits=True)
        oracle = copy.deepcopy(draft).cpu()
        for i in range(B):
            _, logits, _ = reference_block(oracle, feats[i].cpu(), int(anchors[i]), embed.weight.cpu(),
                                           lm_head.weight.cpu())
            torch.testing.assert_close(proposal.logits[i].cpu(), logits, rtol=1e-3, atol=1e-3)
