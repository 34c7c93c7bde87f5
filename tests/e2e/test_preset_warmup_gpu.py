"""What a user runs (GPU only; skipped on CPU): the real presets' shapes at their default ``max_batch``,
warmed with sampling on, then serving a sampled batch from the captured graphs.

The small models of test_graphs_gpu.py do not reach the compiler paths of a 65536-entry vocabulary
at several rows, where Inductor fails to generate a whole-row scan fused into the sampling tail
(why runtime/distributions.py has ``row_prefix_sums``). Slow: each engine compiles and captures its
step for every batch size in each mode.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.graphs.runner import default_batch_sizes
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.distributions import SamplingMode, filter_rows
from lfmspark.runtime.randomness import draw_key

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("speculative", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("preset", ["lfm2.5-1.2b", "lfm2-8b-a1b"])
def test_default_engine_warms_and_samples_at_every_batch_size(preset: str, speculative: bool):
    engine = Engine.from_preset(preset, **({} if speculative else {"draft": None}))
    report = engine.warmup(progress=False)
    sizes = default_batch_sizes(engine.max_batch)
    warmed = {(e.mode, e.batch_size) for e in report.entries if not e.kind.startswith("prefill")}
    assert warmed >= {(mode.value, b) for mode in SamplingMode for b in sizes}, warmed

    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(5 + i)] for i in range(engine.max_batch)]
    params = [SamplingParams(temperature=0.8, top_k=50 * (i % 2), top_p=0.9, max_new_tokens=24, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    for out in outputs:
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        assert all(0 <= t < vocab for t in out.token_ids)
    assert engine.idle
    torch.cuda.synchronize()


@pytest.mark.parametrize("mode", [SamplingMode.THRESHOLD, SamplingMode.FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_compiled_sampling_tail_at_a_full_vocabulary_equals_eager(rows: int, mode: SamplingMode):
    """The sampling tail alone, compiled (module doc): LM head, filtering and the draw over 65536 entries."""
    def tail(h, w, temperature, top_k, top_p, seed, position):
        p = filter_rows((h @ w.t()).float(), temperature, top_k, top_p, torch.zeros_like(top_p), mode)
        return p.sample(draw_key(seed, position, stream=3))

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    h = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    args = (h, w, torch.linspace(0.5, 1.2, rows, device="cuda"),
            torch.tensor([0, 50, 7, 1, 0][:rows], device="cuda"), torch.tensor([0.9, 1.0, 0.5, 1.0, 0.2][:rows], device="cuda"),
            torch.arange(rows, device="cuda"), torch.full((rows,), 3, device="cuda"))
    compiled = torch.compile(tail, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(*args), tail(*args))
