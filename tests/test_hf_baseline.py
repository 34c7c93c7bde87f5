"""The benchmark's HF baseline runs transformers on exactly our weights (mapped back to HF names)."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime.hf_baseline import hf_model_like, time_hf_generate
from spec_fixtures import random_tiny_target


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


def test_a_baseline_child_past_its_time_limit_is_reported_as_failed():
    import time

    from lfmspark.runtime import bench

    # the child cannot even import torch in 0.3 s: the parent must stop waiting and say why
    cfg = bench.BenchConfig(prompt_len=4, output_len=2, runs=1, hf_compile=True, hf_compile_timeout_s=0.3)
    t0 = time.perf_counter()
    row = bench._hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert time.perf_counter() - t0 < 10
    assert row["error"].startswith("BaselineTimeout: did not finish within 0.3 s")
    assert "tpot_ms_p50" not in row


def test_a_crashing_baseline_child_is_reported_with_its_signal(monkeypatch):
    import sys

    from lfmspark.runtime import bench, hf_subprocess

    # a native crash: faulthandler's dump names the Python frame it happened in
    crash = ("import ctypes, sys; print('compiling...', file=sys.stderr)\n"
             "def compile_step(): ctypes.string_at(0)\n"
             "compile_step()")
    tried = []

    def command(cfg, batch, device, mode):
        tried.append(mode)
        return [sys.executable, "-X", "faulthandler", "-c", crash]

    monkeypatch.setattr(hf_subprocess, "child_command", command)
    cfg = bench.BenchConfig(prompt_len=4, output_len=2, runs=1, hf_compile=True, hf_compile_timeout_s=60)
    row = bench._hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert tried == list(hf_subprocess.COMPILE_MODES)          # every mode was tried before giving up
    assert row["error"].startswith("BaselineFailed: child process killed by SIGSEGV: Fatal Python error")
    assert "compile_step" in row["error"]
    assert row["error_reduce_overhead"].startswith("BaselineFailed: child process killed by SIGSEGV")
    assert "tpot_ms_p50" not in row


def test_a_compiled_baseline_falls_back_to_the_next_mode_and_says_so(monkeypatch):
    from lfmspark.runtime import bench, hf_subprocess

    def run(cfg, batch, device, compile_mode):
        if compile_mode == "reduce-overhead":
            raise hf_subprocess.BaselineFailed("child process killed by SIGSEGV: ...")
        return {"ttft_ms": 3.0, "tpot_ms": 2.0}

    monkeypatch.setattr(hf_subprocess, "run_baseline", run)
    cfg = bench.BenchConfig(prompt_len=4, output_len=2, runs=1, hf_compile=True)
    row = bench._hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert row["compile_mode"] == "default" and row["tpot_ms_p50"] == 2.0
    assert "SIGSEGV" in row["error_reduce_overhead"] and "error" not in row
    report = {"results": {"target_only": [], "speculative": [], "hf_eager": [], "hf_static_compile": [row]}}
    assert "mode=default (reduce_overhead failed)" in bench.table(report)


def test_a_baseline_child_rebuilds_the_benchmarked_weights_and_reports_its_timing():
    from lfmspark.runtime import bench, hf_subprocess

    # the eager baseline through the child (the compiled one needs a GPU-sized time budget)
    # 16 tokens, median of 3: decode time well above the noise of a busy 2-core machine (3 tokens, one
    # run read a negative TPOT there once; time_hf_generate now refuses such a timing)
    cfg = bench.BenchConfig(prompt_len=4, output_len=16, runs=3, hf_compile_timeout_s=300, seed=3)
    timing = hf_subprocess.run_baseline(cfg, 2, torch.device("cpu"), compile_mode=None)
    assert timing["tpot_ms"] > 0 and timing["ttft_ms"] > 0


def test_the_child_builds_the_same_target_as_the_benchmark():
    from lfmspark.runtime import bench

    cfg = bench.BenchConfig(seed=5, device="cpu")
    ours, _, _ = bench.build_models(cfg, torch.device("cpu"))
    again, _, _ = bench.build_models(bench.BenchConfig(seed=5, device="cpu", draft_preset=None), torch.device("cpu"))
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
