"""The engine's prefill warm-up: after ``Engine.warmup()``, no prompt shape compiles a kernel.

A Triton variant compiled by a first request costs it 0.3-0.95 s of TTFT on a GPU
(docs/decisions.md, "Prefill, warm-up and the allocator": a first 128-token request 577 -> 22.9 ms
with the warm-up, an MoE target's 950 -> 48 ms). The CPU tests check the shape list against the
launch plans of the attention and of the MoE experts, and that the MoE's variant names everything
its kernels are compiled for (the launches' constexprs, compile options and specialized integers);
the GPU test checks the property itself: prompts of new shapes compile nothing, dense and MoE.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops.moe as moe
from lfmspark.ops.attention.cache_attention import plan_launch
import lfmspark.ops.attention.window_attention as window_attention_module
from lfmspark.ops.attention.window_attention import launch_variant, window_block
from lfmspark.ops.routing import window_attention
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.models.presets import target_preset
from lfmspark.runtime.prefill_warmup import prefill_variants, prefill_warm_shapes

# (n_heads, n_kv, head_dim): LFM2.5-1.2B / LFM2-8B-A1B, a group of 3, a long head
_ATTENTION = [(32, 8, 64), (24, 8, 64), (16, 4, 128)]


@pytest.mark.parametrize("heads", _ATTENTION, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("max_batch,cache_len", [(1, 4096), (4, 300), (16, 1024)])
def test_every_prefill_shape_uses_an_attention_variant_the_warmup_compiled(heads, sms, max_batch, cache_len):
    n_heads, n_kv, hd = heads
    longest = min(2048, cache_len)

    def variant(rows: int, length: int):
        return launch_variant(rows, length, n_heads, n_kv, hd, cache_len, 2, sms)

    shapes = prefill_warm_shapes(max_batch, longest, [variant])
    warmed = {variant(r, n) for r, n in shapes}
    for rows in range(1, max_batch + 1):
        for length in range(1, longest + 1, 7 if max_batch > 4 else 1):
            assert variant(rows, length) in warmed, (rows, length)


@pytest.mark.parametrize("window", ["1", "0"])
def test_the_attention_variant_names_the_kernel_and_its_window_block(monkeypatch: pytest.MonkeyPatch, window: str):
    """A group of 3: 9-row windows of 11-16 and 17-21 tokens share a launch plan but not the window
    kernel's token block, so the warm-up must tell them apart (and cover both)."""
    if window == "0":   # every window on the two launches: no window kernel to tell apart
        monkeypatch.setattr(window_attention_module, "window_attention", lambda *args: False)
    H, n_kv, hd, cache, sms = 24, 8, 64, 1024, 132
    plan = lambda r, n: plan_launch(r, n, H, n_kv, hd, cache, 2, sms).variant      # noqa: E731
    variant = lambda r, n: launch_variant(r, n, H, n_kv, hd, cache, 2, sms)        # noqa: E731
    assert plan(9, 16) == plan(9, 17) and window_attention(17, H, n_kv) and window_block(16) != window_block(17)
    assert (variant(9, 16) != variant(9, 17)) == (window == "1")
    assert variant(9, 30) == ("cache", plan(9, 30))                               # past one row tile
    warmed = {variant(r, n) for r, n in prefill_warm_shapes(16, cache, [variant])}
    assert variant(9, 17) in warmed and variant(9, 16) in warmed


def test_warm_shapes_cover_row_counts_and_length_classes_and_fit_the_cache():
    shapes = prefill_warm_shapes(6, 40)
    assert {r for r, n in shapes if n == 16} == set(range(1, 7))       # LM head / argmax row tiles
    assert (1, 1) in shapes and (1, 17) in shapes                      # Triton's "== 1" / "% 16" classes
    assert len(shapes) == len(set(shapes))
    assert all(n <= 12 for _, n in prefill_warm_shapes(3, 12, [lambda r, n: (r > 1, n > 5)]))
    # one shape per variant of each kernel, the one with the fewest tokens
    shapes = prefill_warm_shapes(2, 12, [lambda r, n: n > 5, lambda r, n: r * n > 10])
    assert {(1, 1), (1, 6), (1, 11)} <= set(shapes)


# (experts, top_k): LFM2-8B-A1B, the GPU tests' small MoE
_MOE = [(32, 4), (8, 2)]


@pytest.mark.parametrize("experts,top_k", _MOE)
@pytest.mark.parametrize("elem_size", [2, 4], ids=["bf16", "fp32"])
@pytest.mark.parametrize("max_batch", [1, 4, 16])
def test_every_prefill_shape_uses_an_moe_variant_the_warmup_compiled(experts, top_k, elem_size, max_batch):
    def variant(rows: int, length: int):
        return moe.launch_variant(rows * length * top_k, experts, elem_size)

    shapes = prefill_warm_shapes(max_batch, 2048, [variant])
    warmed = {variant(r, n) for r, n in shapes}
    assert len(warmed) > 3                                   # tiles and plan chunking both vary
    for rows in range(1, max_batch + 1):
        for length in range(1, 2049, 3 if max_batch > 1 else 1):
            assert variant(rows, length) in warmed, (rows, length)


@pytest.mark.parametrize("preset,n_variants", [("lfm2.5-1.2b", 1), ("lfm2-8b-a1b", 2), ("lfm2.5-8b-a1b", 2)])
def test_engine_warms_the_attention_and_moe_variants_of_its_target(preset, n_variants):
    """The engine's variant functions for a served target: attention, plus the experts for an MoE
    target (without its experts' variants in the warm-up, a first request compiles a plan variant:
    950 ms against 48 ms warmed, docs/decisions.md)."""
    cfg = target_preset(preset)
    variants = prefill_variants(cfg, 4096, 2, 132)
    assert len(variants) == n_variants
    shapes = prefill_warm_shapes(4, 2048, variants)
    for variant in variants:
        warmed = {variant(r, n) for r, n in shapes}
        for rows in range(1, 5):
            for length in range(1, 2049, 5):
                assert variant(rows, length) in warmed, (preset, rows, length)
    if n_variants == 2:   # the benchmark's case: one row, a 128-token prompt is an experts variant
        moe_variant = variants[1]                     # that the attention's warm shapes do not reach
        assert moe_variant(1, 128) not in {moe_variant(r, n) for r, n in prefill_warm_shapes(1, 2048, variants[:1])}


class _LaunchRecorder:
    """Stands in for one of ops/moe.py's kernels: records what a launch is compiled for (its
    keyword arguments: constexprs and compile options, and the specialization class of every
    integer argument Triton specializes) instead of launching it."""

    def __init__(self, name: str, kernel, log: list):
        self.name, self.kernel, self.log = name, kernel, log
        # a JITFunction keeps its decorator's do_not_specialize; the interpreter's stand-in its kwargs
        if hasattr(kernel, "do_not_specialize"):
            names = kernel.do_not_specialize or ()
        else:
            names = kernel.kwargs.get("do_not_specialize") or ()
        unspecialized = {kernel.arg_names[i] if isinstance(i, int) else i for i in names}
        self.specialized = [i for i, a in enumerate(kernel.arg_names) if a not in unspecialized]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            ints = tuple((i, args[i] == 1, args[i] % 16 == 0) for i in self.specialized
                         if i < len(args) and isinstance(args[i], int))
            self.log.append((self.name, tuple(sorted(kwargs.items())), ints))
        return launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_launch_variant_names_everything_its_kernels_compile_for(monkeypatch, dtype):
    """Launches of equal :func:`moe.launch_variant` compile to the same kernels; so warming one
    shape per variant covers every pair count."""
    log: list = []
    for name in ("_moe_count_kernel", "_moe_plan_kernel", "_moe_gate_up_kernel", "_moe_down_kernel",
                 "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, _LaunchRecorder(name, getattr(moe, name), log))
    E, k, H, I = 32, 4, 64, 32
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=dtype), torch.zeros(E, H, I, dtype=dtype)
    seen: dict = {}
    for n_tokens in [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 100, 127, 128, 129, 300, 512, 513, 1000, 2048, 4100]:
        x = torch.zeros(n_tokens, H, dtype=dtype)
        ids = (torch.arange(n_tokens * k) % E).view(n_tokens, k)
        log.clear()
        moe.moe_experts_triton(x, ids, torch.ones(n_tokens, k, dtype=dtype), w13, w2)
        key = tuple(log)
        variant = moe.launch_variant(n_tokens * k, E, x.element_size())
        assert seen.setdefault(variant, key) == key, (n_tokens, variant)
    assert len(seen) > 3


def test_cpu_engine_warms_one_short_prefill():
    engine = Engine.from_preset("tiny", None, dtype=torch.float32, device="cpu", max_batch=3, max_seq_len=64)
    assert engine.model_runner.prefill_warm_shapes() == [(1, 16)]
    engine.warmup(progress=False, sampling=True)       # runs them (greedy and sampling) without error
    assert engine.scheduler.pool.in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("graph_tokens", [1024, 0], ids=["buckets", "eager"])
@pytest.mark.parametrize("moe_target", [False, True], ids=["dense", "moe"])
def test_after_warmup_new_prompt_shapes_compile_no_triton_kernel(moe_target, graph_tokens):
    """With prefill buckets (graphs/prefill.py: replays, and 4 x 300 past the budget, eager at its
    own shape) and without (every chunk eager at its own shape)."""
    import triton

    from test_graphs_gpu import small_models

    target, draft = small_models(moe=moe_target, dtype=torch.bfloat16)
    engine = Engine(target, draft, max_batch=4, max_seq_len=320, batch_sizes=[1, 2, 4], stop_token_ids=(),
                    prefill_graph_tokens=graph_tokens)
    engine.warmup(progress=False, sampling=True)
    compiled: list[str] = []

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append(repr)
        return None

    triton.knobs.runtime.jit_cache_hook = record
    try:
        for rows, length in [(1, 3), (1, 40), (3, 100), (4, 7), (2, 200), (1, 250), (4, 130), (4, 300)]:
            prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(length)] for i in range(rows)]
            params = SamplingParams(max_new_tokens=3, temperature=0.7 if rows == 3 else 0.0, seed=1)
            engine.generate(prompts, params)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert compiled == []
