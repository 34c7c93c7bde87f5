"""The graphs package on CPU: capture sizes, and the compiled (non-graph) path matching eager."""

from __future__ import annotations

import os

import pytest
import torch

from lfmspark.graphs.runner import default_batch_sizes
from lfmspark.runtime import Engine, SamplingParams
from env_vars import set_env
from spec_fixtures import random_tiny_target


def test_default_batch_sizes_are_dense_at_the_small_end():
    assert default_batch_sizes(16) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert default_batch_sizes(5) == [1, 2, 3, 4, 5]
    sizes = default_batch_sizes(50)
    assert sizes[-1] == 50 and sizes == sorted(set(sizes))


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["model-dtype", "fp8"])
def test_compiled_decode_step_matches_eager_on_cpu(quantization):
    """Without CUDA the same API runs the compiled path: torch.compile(fullgraph=True) of the
    decode step (the ops run their CPU implementations inside the compiled graph; an fp8 target's
    products are traced as the GPU's are)."""
    target = random_tiny_target(seed=2)
    params = SamplingParams(max_new_tokens=6)
    kw = dict(max_batch=1, max_seq_len=64, quantization=quantization)
    eager = Engine(target, None, **kw).generate([[3, 1, 4, 1, 5]], params)
    engine = Engine(target, None, compile=True, **kw)
    report = engine.warmup(progress=False, sampling=False)
    assert report.mode == "compiled" and report.entries[0].compile_s > 0
    torch._dynamo.config.error_on_recompile = True
    try:
        out = engine.generate([[3, 1, 4, 1, 5]], params)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert out[0].token_ids == eager[0].token_ids


def test_compiled_round_reuses_one_graph_per_layer_kind_and_matches_eager():
    """Regional compilation: a greedy speculative round at one batch size compiles eight graphs,
    whatever the depth (one ShortConv layer, one attention layer, one draft layer, the draft's LM
    head + Markov walk, acceptance + commit, the draft context injection, which runs beside the
    verify's last layers and the commit (runtime/steps.py), and the verify's and the draft's step heads:
    the glue before the first layer with that layer, which has no pending residual add to start
    with, models/lfm2.py; graphs/compile.py), then runs without recompiling and emits exactly the
    eager engine's tokens."""
    from torch._dynamo.utils import counters

    def engine(compile: bool) -> Engine:
        return Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=2,
                                  max_seq_len=128, compile=compile)

    torch._dynamo.reset()
    counters.clear()
    prompts, params = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_new_tokens=14)
    compiled = engine(True)
    first = compiled.generate(prompts, params)
    assert counters["stats"]["unique_graphs"] == 8
    torch._dynamo.config.error_on_recompile = True
    try:
        again = compiled.generate(prompts, params)
    finally:
        torch._dynamo.config.error_on_recompile = False
    expected = [o.token_ids for o in engine(False).generate(prompts, params)]
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="the CPU backend keeps these roundings from torch 2.13 on (the CI's); on CUDA the GPU "
                           "tests check the served consequence")
def test_compiled_regions_keep_eager_bf16_roundings():
    """graphs/compile.py keeps the bf16 roundings Inductor would elide between fused ops, so a
    compiled unfused layer computes what the fused decode kernels (which round there, as HF eager
    does) compute: the residual add before its RMSNorm, silu(gate) before the product. (Checked on
    the CPU backend of the CI's PyTorch, 2.13; the CPU backend of 2.11 does not keep them; on CUDA
    the GPU tests check the served consequence.)"""
    import torch.nn.functional as F

    from lfmspark.graphs.compile import configure_compile

    def swiglu_and_add_norm(gate, up, h, delta):
        s = h + delta
        x32 = s.float()
        return F.silu(gate) * up, (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(s.dtype)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, n, generator=g).bfloat16() for n in (1024, 1024, 512, 512)]
    torch._dynamo.reset()
    configure_compile(n_variants=1)
    got = torch.compile(swiglu_and_add_norm, fullgraph=True, dynamic=False)(*args)
    for a, b in zip(got, swiglu_and_add_norm(*args), strict=True):
        assert torch.equal(a, b)


def test_profile_replays_writes_its_tables_without_a_gpu(tmp_path):
    """The per-kernel profile of ``lfmspark bench --profile-dir`` on CPU: no device kernels to list,
    each table says so, and the file is written (the profiler export and its parsing run)."""
    from lfmspark.tools.bench import profile_replays

    engine = Engine(random_tiny_target(seed=3), None, max_batch=1, max_seq_len=64)
    engine.generate([[3, 1, 4]], SamplingParams(max_new_tokens=2))
    path = tmp_path / "profile.txt"
    profile_replays(engine, 1, path, iters=2)
    text = path.read_text()
    assert text.startswith("decode replay, batch 1: 0.0 us of kernel time per replay")
    assert text.rstrip().endswith("(no kernel launches in the trace)")


def test_inductor_cache_key_follows_the_variables_and_the_ops(monkeypatch):
    """A compiled region caches the ops' output shapes of its compile (e.g. skinny_linear_add_norm's ssq
    tiles, which follow LFMSPARK_TUNE block_n): the FX-graph cache key must change with every
    variable that reaches the kernels (not the cache directory) and with the source of every op and
    model file, those in the family folders included; configure_compile installs it."""
    import lfmspark.graphs.compile as compile_module
    from lfmspark.graphs.compile import CacheKeyOfOps, configure_compile

    for name in [k for k in os.environ if k.startswith("LFMSPARK_")]:
        monkeypatch.delenv(name)
    set_env(monkeypatch)
    hashed: list[tuple[str, ...]] = []
    real_hash = compile_module.get_hash_for_files
    monkeypatch.setattr(compile_module, "get_hash_for_files", lambda files: hashed.append(files) or real_hash(files))
    base = CacheKeyOfOps().uuid()
    assert any(f.endswith("ops/linear/skinny_linear.py") for f in hashed[0])
    assert any(f.endswith("ops/markov_walk/jacobi.py") for f in hashed[0])
    assert any(f.endswith("models/lfm2.py") for f in hashed[0])
    set_env(monkeypatch, CACHE_DIR="/elsewhere")
    assert CacheKeyOfOps().uuid() == base
    set_env(monkeypatch, PDL="0")
    no_pdl = CacheKeyOfOps().uuid()
    set_env(monkeypatch, TUNE="tile.block_n=128")
    assert len({base, no_pdl, CacheKeyOfOps().uuid()}) == 3
    with torch._inductor.config.patch(post_grad_custom_post_pass=None):
        configure_compile(n_variants=1)
        installed = torch._inductor.config.post_grad_custom_post_pass
        assert isinstance(installed, CacheKeyOfOps) and installed.inner is None
        configure_compile(n_variants=1)
        assert torch._inductor.config.post_grad_custom_post_pass is installed   # not wrapped twice


def test_inductor_cache_key_keeps_a_pass_the_process_installed():
    """A post-grad pass set before lfmspark compiles still runs, and its uuid joins the key; one without
    a uuid turns caching off (uuid None), as Inductor would for it alone."""
    from lfmspark.graphs.compile import CacheKeyOfOps, configure_compile

    class Counting:
        def __init__(self, uuid: str | None) -> None:
            self.calls, self._uuid = 0, uuid

        def __call__(self, graph) -> None:
            self.calls += 1

        def uuid(self) -> str | None:
            return self._uuid

    user = Counting("mine-1")
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        configure_compile(n_variants=1)
        wrapped = torch._inductor.config.post_grad_custom_post_pass
    assert isinstance(wrapped, CacheKeyOfOps) and wrapped.inner is user
    wrapped(torch.fx.Graph())
    assert user.calls == 1
    first = wrapped.uuid()
    user._uuid = "mine-2"
    assert wrapped.uuid() not in (None, first)
    assert CacheKeyOfOps(Counting(None)).uuid() is None
    assert CacheKeyOfOps(lambda graph: None).uuid() is None



@pytest.mark.slow
def test_one_compile_serves_every_batch_size_and_matches_the_per_size_compile(monkeypatch):
    """graphs/compile.py compiles a region at batch 1 and once more for every larger size (the batch
    dimension symbolic from the second size on): a speculative engine run at batch 1, 3 and 2 compiles
    two graphs per region (batch 1's and the symbolic one) and nothing at the third size, and at
    sizes 3 and 2 emits the tokens and log-probabilities of a compile specialised to each size
    (``dynamic=False``, one compile per size)."""
    import lfmspark.graphs.compile as compile_module
    from torch._dynamo.utils import counters

    def run(dynamic: bool, sizes: tuple[int, ...]) -> tuple[dict, list[int]]:
        monkeypatch.setattr(compile_module, "COMPILE_OPTIONS", dict(fullgraph=True, dynamic=None if dynamic else False))
        torch._dynamo.reset()
        counters.clear()
        engine = Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=3,
                                    max_seq_len=96, compile=True)
        outputs, graphs = {}, []
        for n in sizes:
            prompts = [[7 * i + 1, 2, 30 + i, 4, 5 + i] for i in range(n)]
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, logprobs=2, ignore_eos=True))
            outputs[n] = [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs]) for o in outs]
            graphs.append(counters["stats"]["unique_graphs"])
        return outputs, graphs

    dynamic, dynamic_graphs = run(True, (1, 3, 2))
    static, static_graphs = run(False, (3, 2))
    per_size = dynamic_graphs[0]
    assert dynamic_graphs == [per_size, 2 * per_size, 2 * per_size]       # size 2 compiled nothing
    assert static_graphs == [per_size, 2 * per_size]                      # the per-size compile did
    assert dynamic[3] == static[3] and dynamic[2] == static[2]
