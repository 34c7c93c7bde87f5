"""``lfmspark bench serve`` end to end on the tiny preset: open-loop arrivals through
AsyncEngine, target-only and speculative on one trace, the documented JSON and vLLM-style table."""

from __future__ import annotations

import json
import math

import pytest

from lfmspark.models.presets import target_preset
from lfmspark.runtime.config import EngineConfig
from lfmspark.tools.cli import main
from lfmspark.tools.serve_bench import ServeBenchConfig, format_report, make_trace, run_serve_bench

KEYS = {"successful_requests", "failed_requests", "errors", "duration_s", "total_input_tokens",
        "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms",
        "tpot_ms", "itl_ms", "e2el_ms", "tau_mean", "cached_input_tokens", "peak_memory_gb", "warmup_s"}


def test_both_engines_serve_the_same_trace_and_the_json_is_documented(tmp_path):
    engine = EngineConfig(preset="tiny", device="cpu", max_batch=4, max_seq_len=128, imposed_acceptance=[0.7])
    cfg = ServeBenchConfig(engine, num_prompts=10, input_len=12, output_len=8, range_ratio=0.5, request_rate=50.0,
                           json_path=str(tmp_path / "r.json"))
    trace = make_trace(cfg, vocab=target_preset("tiny").vocab_size)     # what the run draws (same seed)
    returned = run_serve_bench(cfg)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["results"] == json.loads(json.dumps(returned["results"]))
    assert report["schema"] == 1 and set(report["results"]) == {"target_only", "speculative"}
    for kind, r in report["results"].items():
        assert set(r) == KEYS, kind
        assert r["successful_requests"] == 10 and r["failed_requests"] == 0
        assert r["total_output_tokens"] == sum(trace.output_lens)      # ignore_eos: every length as drawn
        assert r["total_input_tokens"] == sum(len(p) for p in trace.prompts)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = r[key]
            assert set(s) == {"mean", "p50", "p90", "p99"} and 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert report["results"]["speculative"]["tau_mean"] > 1.0 == report["results"]["target_only"]["tau_mean"]
    text = format_report(report)
    assert "Serving Benchmark Result: speculative" in text and "Median TTFT (ms):" in text


def test_a_fraction_of_the_measured_capacity(tmp_path):
    """--capacity-fraction: each engine serves the trace all at once (its capacity), then at the given
    fraction of that rate; both runs reported, the rate with them."""
    cfg = ServeBenchConfig(EngineConfig(preset="tiny", draft_preset=None, device="cpu", max_batch=4, max_seq_len=128),
                           num_prompts=8, input_len=10, output_len=6, capacity_fraction=0.5)
    results = run_serve_bench(cfg)["results"]
    assert set(results) == {"target_only_saturation", "target_only"}
    saturation, served = results["target_only_saturation"], results["target_only"]
    assert saturation["successful_requests"] == served["successful_requests"] == 8
    assert served["request_rate"] == pytest.approx(0.5 * saturation["request_throughput"])
    assert "Request rate (req/s):" in format_report({"results": results})
    with pytest.raises(ValueError, match="capacity_fraction"):
        run_serve_bench(ServeBenchConfig(EngineConfig(preset="tiny", device="cpu"), capacity_fraction=1.5))


def test_arrivals_are_poisson_at_the_rate_or_all_at_once():
    cfg = ServeBenchConfig(num_prompts=4000, input_len=4, output_len=4, request_rate=20.0)
    arrivals = make_trace(cfg, vocab=64).arrivals
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 20) < 0.005
    assert make_trace(ServeBenchConfig(num_prompts=5, input_len=4, output_len=4, request_rate=math.inf),
                      vocab=64).arrivals == [0.0] * 5


def test_a_jsonl_dataset_and_a_bad_one(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": [1, 2, 3], "output_len": 5}\n\n{"prompt": [4, 5]}\n')
    trace = make_trace(ServeBenchConfig(dataset=str(good), output_len=7), vocab=64)
    assert trace.prompts == [[1, 2, 3], [4, 5]] and trace.output_lens == [5, 7]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: each line must be a JSON object with a 'prompt'"):
        make_trace(ServeBenchConfig(dataset=str(bad)), vocab=64)


def test_the_command_line(tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--preset", "tiny", "--draft-preset", "none", "--num-prompts", "6",
                 "--prompt-len", "8", "--output-len", "5", "--max-batch", "2", "--max-concurrency", "3",
                 "--device", "cpu", "--json", str(out)])
    assert code == 0
    assert set(json.loads(out.read_text())["results"]) == {"target_only"}
    assert "Serving Benchmark Result: target_only" in capsys.readouterr().out
