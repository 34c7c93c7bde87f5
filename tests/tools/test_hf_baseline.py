"""The benchmark's HF baseline runs transformers on exactly our weights (mapped back to HF names)."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime.config import EngineConfig
from lfmspark.tools.hf_baseline import hf_model_like, time_hf_generate
from spec_fixtures import random_tiny_target

CPU = EngineConfig(device="cpu")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_model_shares_our_weights_and_matches_our_logits(moe):
    model = random_tiny_target(moe=moe, seed=1)
    hf = hf_model_like(model)
    assert hf.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = TargetCache.allocate(model.config, 2, 32, 2, torch.float32, "cpu")
    zero = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        ours = model(ids, cache, torch.arange(2), zero, None, ForwardMode.PREFILL).logits
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    timing = time_hf_generate(hf, ids, 4, runs=1)
    assert timing["tpot_ms"] > 0 and timing["ttft_ms"] > 0


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_an_fp8_target_runs_in_hf_with_its_dequantized_weights(moe):
    from lfmspark.models.lfm2_moe import quantize_target

    model = random_tiny_target(moe=moe, seed=2)
    quantize_target(model)
    hf = hf_model_like(model)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    cache = TargetCache.allocate(model.config, 1, 32, 2, torch.float32, "cpu")
    zero = torch.zeros(1, dtype=torch.int64)
    with torch.no_grad():
        ours = model(ids, cache, zero, zero, None, ForwardMode.PREFILL).logits
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_baseline_child_past_its_time_limit_is_reported_as_failed():
    import time

    from lfmspark.tools import bench

    # the child cannot even import torch in 0.3 s: the parent must stop waiting and say why
    cfg = bench.BenchConfig(CPU, prompt_len=4, output_len=2, runs=1, hf_compile=True, hf_compile_timeout_s=0.3)
    t0 = time.perf_counter()
    row = bench.hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert time.perf_counter() - t0 < 10
    assert row["error"].startswith("BaselineTimeout: did not finish within 0.3 s")
    assert "tpot_ms_p50" not in row


def test_a_crashing_baseline_child_is_reported_with_its_signal(monkeypatch):
    import sys

    from lfmspark.tools import bench, hf_baseline

    # a native crash: faulthandler's dump names the Python frame it happened in
    crash = ("import ctypes, sys; print('compiling...', file=sys.stderr)\n"
             "def compile_step(): ctypes.string_at(0)\n"
             "compile_step()")
    tried = []

    def command(config, shape, mode):
        tried.append(mode)
        return [sys.executable, "-X", "faulthandler", "-c", crash]

    monkeypatch.setattr(hf_baseline, "child_command", command)
    cfg = bench.BenchConfig(CPU, prompt_len=4, output_len=2, runs=1, hf_compile=True, hf_compile_timeout_s=60)
    row = bench.hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert tried == list(hf_baseline.COMPILE_MODES)          # every mode was tried before giving up
    assert row["error"].startswith("BaselineFailed: child process killed by SIGSEGV: Fatal Python error")
    assert "compile_step" in row["error"]
    assert row["error_reduce_overhead"].startswith("BaselineFailed: child process killed by SIGSEGV")
    assert "tpot_ms_p50" not in row


def test_a_compiled_baseline_falls_back_to_the_next_mode_and_says_so(monkeypatch):
    from lfmspark.tools import bench, hf_baseline

    def run(config, shape, compile_mode, timeout_s):
        if compile_mode == "reduce-overhead":
            raise hf_baseline.BaselineFailed("child process killed by SIGSEGV: ...")
        return {"ttft_ms": 3.0, "tpot_ms": 2.0}

    monkeypatch.setattr(bench, "run_baseline", run)
    cfg = bench.BenchConfig(CPU, prompt_len=4, output_len=2, runs=1, hf_compile=True)
    row = bench.hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert row["compile_mode"] == "default" and row["tpot_ms_p50"] == 2.0
    assert "SIGSEGV" in row["error_reduce_overhead"] and "error" not in row
    report = {"results": {"target_only": [], "speculative": [], "hf_eager": [], "hf_static_compile": [row]}}
    assert "mode=default (reduce_overhead failed)" in bench.table(report)


def test_a_baseline_child_rebuilds_the_benchmarked_weights_and_reports_its_timing():
    from lfmspark.tools import hf_baseline

    # the eager baseline through the child (the compiled one needs a GPU-sized time budget)
    # 16 tokens, median of 3: decode time well above the noise of a busy 2-core machine (3 tokens and
    # one run can read a negative TPOT there; time_hf_generate refuses such a timing)
    shape = hf_baseline.BaselineShape(batch=2, prompt_len=4, output_len=16, runs=3, seed=3)
    timing = hf_baseline.run_baseline(EngineConfig(device="cpu", seed=3), shape, None, timeout_s=300)
    assert timing["tpot_ms"] > 0 and timing["ttft_ms"] > 0


def test_the_child_builds_the_same_target_as_the_benchmark():
    from lfmspark.runtime.loader import load_models

    ours = load_models(EngineConfig(seed=5, device="cpu")).target
    again = load_models(EngineConfig(seed=5, device="cpu", draft_preset=None)).target     # as the child does
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
