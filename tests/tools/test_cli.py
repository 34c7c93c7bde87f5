"""The ``lfmspark`` command line: both commands end to end on tiny models, the JSON schema of the
benchmark report, and clear messages with a non-zero exit for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lfmspark.environment import VARIABLES
from lfmspark.tools.cli import main
from lfmspark.tools.cli import main


def lfmspark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lfmspark.tools.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_bench_runs_on_the_tiny_preset_and_writes_the_documented_json(tmp_path, monkeypatch):
    monkeypatch.setenv("LFMSPARK_TUNE", "gemv.block_k=1024")   # recorded, and harmless on a CPU
    out = tmp_path / "bench.json"
    code = main(["bench", "--preset", "tiny", "--batch-sizes", "1,2", "--prompt-len", "6", "--output-len", "11",
                 "--runs", "1", "--imposed-acceptance", "0.5", "--imposed-acceptance", "1", "--device", "cpu",
                 "--prefill-graph-tokens", "1024", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["schema"] == 2
    assert {"date", "command", "torch", "transformers", "lfmspark", "device"} <= set(report["environment"])
    variables = report["environment"]["variables"]       # every LFMSPARK_* variable set, e.g. a cache dir
    assert variables["LFMSPARK_TUNE"] == "gemv.block_k=1024" and set(variables) <= set(VARIABLES)
    assert report["environment"]["pdl"] is False  # CPU
    assert report["models"] == "preset tiny + tiny-dspark"
    assert report["imposed_acceptance"] == [[0.5] * 4, [1.0] * 4]
    res = report["results"]
    assert [r["batch"] for r in res["target_only"]] == [1, 2]
    assert [(r["batch"], r["imposed_profile"]) for r in res["speculative"]] == [
        (1, [0.5] * 4), (1, [1.0] * 4), (2, [0.5] * 4), (2, [1.0] * 4)]
    for r in res["target_only"] + res["speculative"]:
        for key in ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_warmup_request", "tpot_ms_p50", "tpot_ms_p99",
                    "tok_s_per_user", "tok_s_total", "step_ms", "loop_step_ms", "step_bytes", "step_gbps",
                    "prefill_ms", "prefill_tflops"):
            assert isinstance(r[key], float | int) and r[key] > 0, key
        assert r["prefill_bucket"] == [r["batch"], 16]          # 6-token prompts: the narrowest bucket
    for r in res["speculative"]:
        assert r["imposed_acceptance"] is True
        assert 1.0 <= r["tau"] <= 5.0 and len(r["acceptance_per_position"]) == 4
        assert r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["commit_ms"] > 0
        if r["imposed_profile"] == [1.0] * 4:         # 1 prefill token + two full rounds of 4 + bonus
            assert r["tau"] == 5.0 and r["acceptance_per_position"] == [1.0] * 4
            # every request: 10 decoded tokens in 2 rounds, so a loop round is 5 tokens' time
            assert r["loop_step_ms"] == pytest.approx(5 * r["tpot_ms_p50"], rel=1e-9)
    for r in res["target_only"]:                      # one decode step per token
        assert r["loop_step_ms"] == pytest.approx(r["tpot_ms_p50"], rel=1e-9)
    for r in res["hf_eager"]:
        assert "error" in r or r["tpot_ms_p50"] > 0
    assert "target_only" in report["warmup"] and "speculative" in report["warmup"]
    # docs/benchmarks.md's tables are rendered from rows of such reports (scripts/results_tables.py)
    import_bench = results_tables().import_bench
    table = {"import": ["tiny"], "columns": [{"key": k} for k in ("preset", "batch", "engine", "tpot_p50_ms", "tau")]}
    rows = import_bench(report, table, commit="abc1234")
    assert [(r["batch"], r["engine"]) for r in rows] == [
        ("1", "target-only"), ("2", "target-only"), ("1", "DSpark, imposed 0.5"), ("1", "DSpark, imposed 1"),
        ("2", "DSpark, imposed 0.5"), ("2", "DSpark, imposed 1")]
    assert all(r["preset"] == "TINY" and r["commit"] == "abc1234" and r["command"].startswith("lfmspark bench")
               for r in rows)
    assert [r["tpot_p50_ms"] for r in rows[:2]] == [f"{r['tpot_ms_p50']:.3f}" for r in res["target_only"]]


def results_tables():
    """scripts/results_tables.py as a module."""
    import importlib.util  # noqa: PLC0415

    path = Path(__file__).resolve().parents[2] / "scripts" / "results_tables.py"
    spec = importlib.util.spec_from_file_location("results_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_times_every_engine_row_before_the_phase_splits_and_hf(tmp_path, monkeypatch):
    # new small allocations slow every later step of a process (docs/decisions.md), so the work that
    # allocates (phase-split captures, HF) comes after the engine rows
    from lfmspark.tools import bench  # noqa: PLC0415

    calls: list[tuple[str, int]] = []

    def recorded(name, fn, batch_of):
        def wrapper(*args, **kwargs):
            calls.append((name, batch_of(*args)))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(bench, "measure_engine", recorded("row", bench.measure_engine, lambda e, cfg, b, *a: b))
    monkeypatch.setattr(bench, "time_round_phases", recorded("phases", bench.time_round_phases, lambda e, b, **kw: b))
    monkeypatch.setattr(bench, "hf_row", recorded("hf", bench.hf_row, lambda t, cfg, b, *a, **kw: b))
    code = main(["bench", "--preset", "tiny", "--batch-sizes", "1,2", "--prompt-len", "6", "--output-len", "5",
                 "--runs", "1", "--imposed-acceptance", "0.5", "--device", "cpu", "--json", str(tmp_path / "b.json")])
    assert code == 0
    assert calls == [("row", 1), ("row", 1), ("row", 2), ("row", 2), ("phases", 1), ("phases", 2), ("hf", 1), ("hf", 2)]


def test_generate_streams_text_from_a_checkpoint(tmp_path):
    from engine_fixtures import save_tiny_target  # noqa: PLC0415

    target_dir = save_tiny_target(tmp_path / "target", tokenizer=True)
    proc = lfmspark("generate", "--target", str(target_dir), "--prompt", "hello world", "--max-new-tokens", "5",
                    "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "tokens in" in proc.stderr and "finish:" in proc.stderr
    proc = lfmspark("generate", "--target", str(target_dir), "--token-ids", "3,4,5", "--max-new-tokens", "4",
                    "--device", "cpu", "--no-stream")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "--batch-sizes", "0"], "positive integers"),
    (["bench", "--batch-sizes", "a,b"], "comma-separated integers"),
    (["bench", "--prefill-graph-tokens", "-1"], "expected a non-negative integer, got '-1'"),
    (["bench", "--runs", "0"], "expected a positive integer, got '0'"),
    (["bench", "--imposed-acceptance", "1.5"], "in [0, 1]"),
    (["bench", "--preset", "tiny", "--device", "cpu", "--imposed-acceptance", "0.5", "--imposed-acceptance",
      "0.5,0.5"], "needs one rate or 4"),
    (["bench", "--preset", "tiny", "--device", "cpu", "--draft-preset", "none", "--imposed-acceptance", "0.8"],
     "needs a draft"),
    (["bench", "--preset", "nope"], "invalid choice"),
    (["bench", "--preset", "tiny", "--target", "x"], "not allowed with"),
    (["bench", "--draft", "somewhere"], "--draft needs --target"),
    (["generate", "--target", "/nonexistent", "--prompt", "hi"], "not a checkpoint directory, nor a Hugging Face Hub id"),
    (["generate", "--prompt", "hi"], "--target"),
    (["frobnicate"], "invalid choice"),
    (["serve"], "one of the arguments --target/--model --preset is required"),
    (["serve", "--preset", "tiny", "--draft", "x"], "--draft needs --target"),
    (["serve", "--target", "/nonexistent"], "'/nonexistent': not a checkpoint directory"),
    (["serve", "--preset", "tiny", "--draft-preset", "none", "--imposed-acceptance", "0.8"], "needs a draft"),
    (["serve", "--preset", "tiny", "--cuda-graph-sizes", "0"], "positive integers"),
    (["serve", "--preset", "tiny", "--reasoning-parser", "gpt"], "invalid choice: 'gpt'"),
])
def test_bad_arguments_fail_clearly(args, message, capsys):
    """In process (``main``, what the console script calls); the console script itself below."""
    said = ""
    try:
        code = main(list(args))
    except SystemExit as e:                  # argparse's refusals, or a message the interpreter prints
        code, said = e.code, e.code if isinstance(e.code, str) else ""
    assert code != 0
    assert message in capsys.readouterr().err + said


def test_the_console_script_exits_nonzero_with_the_message():
    proc = lfmspark("bench", "--batch-sizes", "0")
    assert proc.returncode == 2
    assert "positive integers" in proc.stderr


def test_serve_answers_on_its_port_and_stops_cleanly():
    """``lfmspark serve`` end to end: up, healthy, a completion, then SIGTERM shuts it down gracefully
    (uvicorn re-raises the signal once the app has shut down, so the exit status is the signal's)."""
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lfmspark.tools.cli", "serve", "--preset", "tiny", "--port",
                             str(port), "--max-batch", "2", "--max-seq-len", "128", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not healthy in time"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in proc.stdout.read()


def test_serve_passes_the_engine_flags(monkeypatch):
    """``serve --prefix-cache-outputs --exact`` builds the engine with them (the server itself is
    replaced: tests/serve/test_server.py runs it)."""
    import lfmspark.serve as serve_pkg
    from lfmspark.tools.cli import main

    built = {}
    monkeypatch.setattr(serve_pkg, "run_server", lambda engine, name, **kw: built.update(engine=engine, name=name, **kw))
    assert main(["serve", "--preset", "tiny", "--device", "cpu", "--no-warmup", "--prefix-cache-outputs",
                 "--exact", "--api-key", "k3y", "--allowed-origins", "http://a.example, http://b.example",
                 "--max-request-bytes", "1000", "--reasoning-parser", "qwen3", "--tool-call-parser", "lfm2",
                 "--enable-auto-tool-choice", "--port", str(free_port())]) == 0
    assert built["engine"].config.prefix_cache_outputs and built["engine"].exact and built["name"] == "tiny"
    assert (built["api_key"], built["allowed_origins"], built["max_request_bytes"]) == (
        "k3y", ["http://a.example", "http://b.example"], 1000)
    assert (built["reasoning_parser"], built["tool_call_parser"]) == ("qwen3", "lfm2")


def test_serve_checks_its_port_before_loading_the_engine(monkeypatch):
    """A port in use fails at once, before the model loads (which can take minutes)."""
    import socket

    from lfmspark.runtime import engine as engine_module
    from lfmspark.tools.cli import main

    monkeypatch.setattr(engine_module.Engine, "from_config", lambda *a, **kw: pytest.fail("the engine was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SystemExit, match="in use"):
            main(["serve", "--preset", "tiny", "--device", "cpu", "--port", str(busy.getsockname()[1])])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
