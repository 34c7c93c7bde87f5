"""The norm-statistics path of the target (``LFMSPARK_NORM_STATS=1``, models/layers.py and
models/lfm2.py): several-row forwards whose residual writers (``out_proj``, ``w2``) run
``lfmspark::skinny_linear_residual`` and whose norm consumers (``in_proj`` / ``qkv_proj``, ``w13``,
the LM head) run ``lfmspark::skinny_norm_linear``.

On CUDA 2-16 rows take that route; here it is forced on CPU by patching the routing predicate
(``_routed_to_skinny``: 1-16 rows go to the skinny kernels, CUDA's default), with the ops' PyTorch
references or, with ``interpreter``, every skinny_linear.py op on its Triton kernel under the
interpreter. The comparison is the same model and route with the switch off (the modules' add +
RMSNorm, then the skinny products), and the model without the route (the plain modules). Checked
for the dense and MoE targets, fp32 and bf16: verify logits and aux taps (the last layer's too),
how many calls of each op a forward makes, that one row, more than 16 rows and an unpatched CPU
never take the path, the several-row decode and the speculative round through the engine,
compiled and eager, and the switch's validation. A ``gpu`` test does the same with the real routing.
"""

from __future__ import annotations

import os

import pytest
import torch

import lfmspark.models.layers as layers
import lfmspark.ops.skinny_linear as skinny_module
from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from spec_fixtures import random_tiny_target

STATS_OPS = ("skinny_linear_residual", "skinny_norm_linear")


class _CountingOps:
    """Stands in for ``torch.ops.lfmspark`` in models/layers.py, counting the norm-statistics ops."""

    def __init__(self):
        self.calls = dict.fromkeys(STATS_OPS, 0)

    def __getattr__(self, name):
        op = getattr(torch.ops.lfmspark, name)
        if name not in STATS_OPS:
            return op

        def counted(*args):
            self.calls[name] += 1
            return op(*args)
        return counted


def _force_route(monkeypatch, interpreter: bool = False, count: bool = True) -> _CountingOps:
    """The CUDA routing on CPU; ``count``: count the ops' calls (not under compile, where Dynamo
    would guard on the counts and recompile at every call)."""
    monkeypatch.setattr(layers, "_routed_to_skinny", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    if interpreter:
        monkeypatch.setattr(skinny_module, "use_triton", lambda t: os.environ.get("TRITON_INTERPRET") == "1")
    counting = _CountingOps()
    if count:
        monkeypatch.setattr(layers, "lfm", counting)
    return counting


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# the relative error bound of the statistics path against the modules: fp32 differs only in
# summation orders; bf16 in the mean of squares' order (an ulp of the normalised values here and
# there: the references agreed bit for bit on these inputs) and, on the interpreter, in truncated
# instead of rounded roundings through every layer (as test_fused_norm.py's bound; the switch off
# on the interpreter is already 2-3% from the plain modules there)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
INTERPRETER_BF16_TOL = 5e-2
TAPS = (-1, 0, 2, 4)          # the embeddings, two inner layers and the last layer


def _verify(model, stats: bool, monkeypatch, T: int = 10, B: int = 1):
    """Logits ``[B, T, V]`` and aux taps of a VERIFY forward of ``B x T`` rows after a short prefill."""
    monkeypatch.setenv("LFMSPARK_NORM_STATS", "1" if stats else "0")
    cfg = model.config
    dtype = model.dtype
    cache = TargetCache.allocate(cfg, 2, 64, T, dtype, "cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        prompt = torch.randint(0, cfg.vocab_size, (B, 20), generator=gen)   # > 16 rows: not on the route
        slots = torch.arange(B)
        model(prompt, cache, slots, torch.zeros(B, dtype=torch.long), mode=ForwardMode.PREFILL)
        window = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
        out = model(window, cache, slots, torch.full((B,), 20), mode=ForwardMode.VERIFY, aux_layer_ids=TAPS)
    return out.logits, out.aux


@pytest.mark.parametrize("tune", ["", "tile.block_n=16"], ids=["one_tile", "two_tiles"])
@pytest.mark.parametrize("interpreter", [False, True], ids=["reference", "interpreter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_matches_the_modules(monkeypatch, dtype, interpreter, tune):
    """10 rows, the dense target: logits and every tap against the switch off and the plain model;
    ``two_tiles``: 16-wide column tiles, so each row's statistics are two partial sums (H = 32)."""
    monkeypatch.setenv("LFMSPARK_TUNE", tune)
    model = random_tiny_target(seed=3).to(dtype)
    L = model.config.num_hidden_layers
    plain_logits, plain_aux = _verify(model, False, monkeypatch)
    counting = _force_route(monkeypatch, interpreter)
    off_logits, off_aux = _verify(model, False, monkeypatch)
    assert counting.calls == dict.fromkeys(STATS_OPS, 0)
    on_logits, on_aux = _verify(model, True, monkeypatch)
    # two residual writers per layer; norm consumers: every ffn_norm, the operator_norm of every
    # layer but the first (the embeddings come without statistics), the final norm
    assert counting.calls == {"skinny_linear_residual": 2 * L, "skinny_norm_linear": 2 * L}
    tol = INTERPRETER_BF16_TOL if interpreter and dtype == torch.bfloat16 else TOL[dtype]
    for on, off, plain in ((on_logits, off_logits, plain_logits), (on_aux, off_aux, plain_aux)):
        assert on.dtype == dtype and on.shape == off.shape
        assert _rel_err(on, off) < tol
        assert _rel_err(on, plain) < tol
    if dtype == torch.float32:
        assert torch.equal(on_logits.argmax(-1), off_logits.argmax(-1))
        H = model.config.hidden_size
        assert torch.equal(on_aux[..., :H], off_aux[..., :H])      # the embeddings: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_target_converts_at_its_boundaries(monkeypatch, dtype):
    """The MoE target (one dense layer, then MoE layers): the dense layer produces statistics, the
    next layer's input product consumes them, the MoE layers add as before."""
    model = random_tiny_target(moe=True, seed=4).to(dtype)
    counting = _force_route(monkeypatch)
    off_logits, off_aux = _verify(model, False, monkeypatch, T=6, B=2)
    on_logits, on_aux = _verify(model, True, monkeypatch, T=6, B=2)
    assert counting.calls == {"skinny_linear_residual": 2, "skinny_norm_linear": 2}
    assert _rel_err(on_logits, off_logits) < TOL[dtype] and _rel_err(on_aux, off_aux) < TOL[dtype]


def test_one_row_many_rows_and_plain_cpu_keep_the_modules(monkeypatch):
    model = random_tiny_target(seed=3)
    counting = _force_route(monkeypatch)
    monkeypatch.setenv("LFMSPARK_NORM_STATS", "1")
    cache = TargetCache.allocate(model.config, 2, 64, 10, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 17)), cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.PREFILL)
        model(torch.tensor([[3]]), cache, torch.tensor([0]), torch.tensor([17]), mode=ForwardMode.DECODE)
        assert counting.calls == dict.fromkeys(STATS_OPS, 0)
        monkeypatch.undo()                                 # the unpatched CPU route
        monkeypatch.setenv("LFMSPARK_NORM_STATS", "1")
        monkeypatch.setattr(layers, "lfm", counting)
        model(torch.randint(0, 64, (1, 10)), cache, torch.tensor([0]), torch.tensor([18]), mode=ForwardMode.VERIFY)
        assert counting.calls == dict.fromkeys(STATS_OPS, 0)


def test_prefill_logits_index_drops_the_statistics(monkeypatch):
    """A short prefill (5 rows) on the route with ``logits_index``: the picked rows are normalised
    by the module (the statistics describe all rows), logits as with the switch off."""
    model = random_tiny_target(seed=3)
    counting = _force_route(monkeypatch)
    logits = {}
    for stats in (False, True):
        monkeypatch.setenv("LFMSPARK_NORM_STATS", "1" if stats else "0")
        cache = TargetCache.allocate(model.config, 1, 64, 4, torch.float32, "cpu")
        with torch.no_grad():
            logits[stats] = model(torch.tensor([[3, 1, 4, 1, 5]]), cache, torch.tensor([0]), torch.tensor([0]),
                                  mode=ForwardMode.PREFILL, logits_index=torch.tensor([4])).logits
    L = model.config.num_hidden_layers
    assert counting.calls == {"skinny_linear_residual": 2 * L, "skinny_norm_linear": 2 * L - 1}
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_switch_is_validated(monkeypatch):
    monkeypatch.setenv("LFMSPARK_NORM_STATS", "on")
    with pytest.raises(ValueError, match="LFMSPARK_NORM_STATS='on'"):
        layers.norm_stats_requested()
    from lfmspark.runtime.switches import check_switches
    with pytest.raises(ValueError, match="LFMSPARK_NORM_STATS"):
        check_switches()
    monkeypatch.delenv("LFMSPARK_NORM_STATS")
    assert not layers.norm_stats_requested()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_engine_round_and_decode_match_the_switch_off(monkeypatch, compile):
    """The tiny preset's speculative rounds (verify: 2 x 5 rows) and several-row decode (two
    requests, one left after the other finishes) on the route: the tokens of the switch off, and
    compiled the same seven graphs (the statistics ride where the pending delta did)."""
    from torch._dynamo.utils import counters

    from lfmspark.runtime import Engine, SamplingParams

    _force_route(monkeypatch, count=False)
    # the producer op's CPU implementation runs inside the compiled graphs too: count its calls there
    produced = []
    reference = skinny_module.skinny_linear_residual_reference
    monkeypatch.setattr(skinny_module, "skinny_linear_residual_reference",
                        lambda *args: produced.append(1) or reference(*args))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = [SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=14)]
    tokens, graphs = {}, {}
    for stats in (False, True):
        monkeypatch.setenv("LFMSPARK_NORM_STATS", "1" if stats else "0")
        torch._dynamo.reset()
        counters.clear()
        for draft in ("tiny-dspark", None):
            produced.clear()
            engine = Engine.from_preset("tiny", draft, dtype=torch.float32, device="cpu", max_batch=2,
                                        max_seq_len=128, compile=compile)
            tokens[stats, draft] = [o.token_ids for o in engine.generate(prompts, params)]
            assert bool(produced) == stats
        graphs[stats] = counters["stats"]["unique_graphs"]
    assert tokens[True, "tiny-dspark"] == tokens[False, "tiny-dspark"]
    assert tokens[True, None] == tokens[False, None]
    assert graphs[True] == graphs[False]


def test_layer_compiles_with_statistics(monkeypatch):
    """A decoder layer taking and returning NormStats under torch.compile(fullgraph=True) (the ops'
    fakes, the carry as a NamedTuple) matches the eager layer."""
    from lfmspark.models.lfm2 import Rows

    _force_route(monkeypatch)
    monkeypatch.setenv("LFMSPARK_NORM_STATS", "1")
    model = random_tiny_target(seed=3)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 10, cfg.hidden_size, generator=g)
    stats = layers.NormStats(skinny_module.skinny_linear_residual_reference(
        torch.zeros(10, 1), torch.zeros(cfg.hidden_size, 1), h[0], cfg.hidden_size)[1])
    rows = Rows(torch.tensor([0]), torch.tensor([3]), torch.tensor([10]))
    for i in (0, 1):                                   # a ShortConv and an attention layer
        layer = model.model.layers[i]
        results = []
        for run in (layer, torch.compile(layer, fullgraph=True)):
            cache = TargetCache.allocate(cfg, 1, 32, 10, torch.float32, "cpu")
            with torch.no_grad():
                results.append(run(h, stats, cache.layer_caches(cfg)[i], rows, ForwardMode.VERIFY, cache.rope))
        (want_in, want_h, want_stats), (got_in, got_h, got_stats) = results
        assert isinstance(got_stats, layers.NormStats) and isinstance(want_stats, layers.NormStats)
        assert torch.equal(got_in, h) and torch.equal(want_in, h)
        torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_stats.sumsq, want_stats.sumsq, rtol=1e-6, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_verify_with_real_routing(monkeypatch, dtype):
    """CUDA, the default routing (no patch): a 10-row verify of a head_dim-64 random target, switch
    on against off; logits and taps."""
    from lfmspark.models.config import ATTENTION, CONV, TargetConfig
    from lfmspark.models.presets import random_target

    types = (CONV, ATTENTION, CONV, CONV, ATTENTION, CONV)
    cfg = TargetConfig(model_type="lfm2", vocab_size=512, hidden_size=256, num_hidden_layers=len(types),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, layer_types=types,
                       intermediate_size=512, eos_token_ids=())
    model = random_target(cfg, dtype, "cuda", seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "norm" not in name:
                p.normal_(0, 2.0 / p.shape[-1] ** 0.5)
    counting = _CountingOps()
    monkeypatch.setattr(layers, "lfm", counting)
    out = {}
    for stats in (False, True):
        monkeypatch.setenv("LFMSPARK_NORM_STATS", "1" if stats else "0")
        cache = TargetCache.allocate(cfg, 2, 64, 10, dtype, "cuda")
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            model(torch.randint(0, 512, (1, 20), generator=gen).cuda(), cache, torch.tensor([0], device="cuda"),
                  torch.tensor([0], device="cuda"), mode=ForwardMode.PREFILL)
            o = model(torch.randint(0, 512, (1, 10), generator=gen).cuda(), cache, torch.tensor([0], device="cuda"),
                      torch.tensor([20], device="cuda"), mode=ForwardMode.VERIFY, aux_layer_ids=(0, 2, 5))
        out[stats] = o
    L = cfg.num_hidden_layers
    assert counting.calls == {"skinny_linear_residual": 2 * L, "skinny_norm_linear": 2 * L}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel_err(out[True].logits, out[False].logits) < tol
    assert _rel_err(out[True].aux, out[False].aux) < tol


@pytest.mark.gpu
def test_gpu_captured_rounds_match_the_switch_off(monkeypatch):
    """CUDA graphs of the compiled speculative round and decode at several batch sizes (verify: B x 6
    rows, 2-16 of them on the statistics path), fp32: the tokens of the switch off."""
    from lfmspark.models.config import ATTENTION, CONV, DraftConfig, TargetConfig
    from lfmspark.models.presets import random_draft, random_target
    from lfmspark.runtime import Engine, SamplingParams

    types = (CONV, ATTENTION, CONV, CONV, ATTENTION, CONV)
    tcfg = TargetConfig(model_type="lfm2", vocab_size=512, hidden_size=256, num_hidden_layers=len(types),
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, layer_types=types,
                        intermediate_size=512, eos_token_ids=())
    dcfg = DraftConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, block_size=5, target_layer_ids=(0, 2, 4),
                       mask_token_id=511, vocab_size=512, rms_norm_eps=1e-6, rope_is_neox_style=False, markov_rank=32,
                       enable_confidence_head=True, confidence_head_with_markov=True)
    target = random_target(tcfg, torch.float32, "cuda", seed=0)
    draft = random_draft(dcfg, 256, torch.float32, "cuda", seed=1)
    with torch.no_grad():
        for module in (target, draft):
            for name, p in module.named_parameters():
                if p.dim() > 1 and "norm" not in name:
                    p.normal_(0, 2.0 / p.shape[-1] ** 0.5)
    prompts = [[7 + i, 3, 9 + 2 * i, 11] * (i + 1) for i in range(3)]
    params = SamplingParams(max_new_tokens=24)
    tokens = {}
    for stats in (False, True):
        monkeypatch.setenv("LFMSPARK_NORM_STATS", "1" if stats else "0")
        torch._dynamo.reset()
        for d in (draft, None):
            engine = Engine(target, d, max_batch=4, max_seq_len=256, batch_sizes=[1, 2, 4])
            tokens[stats, d is None] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens[True, False] == tokens[False, False]
    assert tokens[True, True] == tokens[False, True]
