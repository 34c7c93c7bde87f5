"""``lfmspark bench serve`` end to end on the tiny preset: open-loop arrivals through
AsyncEngine, target-only and speculative on one trace, the documented JSON and vLLM-style table;
the same trace over HTTP (``--base-url``) against a real ``lfmspark serve`` on loopback, a server
that refuses the optional fields and one that is down; and each bench mode's own parser."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lfmspark.models.presets import target_preset
from lfmspark.runtime.config import EngineConfig
from lfmspark.tools.cli import main, with_bench_mode
from lfmspark.tools.serve_bench import ServeBenchConfig, format_report, make_trace, run_serve_bench

KEYS = {"successful_requests", "failed_requests", "errors", "duration_s", "total_input_tokens",
        "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms",
        "tpot_ms", "itl_ms", "e2el_ms", "tau_mean", "cached_input_tokens", "peak_memory_gb", "warmup_s", "kv_cache"}
KV_KEYS = {"page_size", "pages", "pages_in_use", "pages_in_use_peak", "bytes", "max_seq_len", "preemptions"}


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
        assert set(r["kv_cache"]) == KV_KEYS and 0 < r["kv_cache"]["pages_in_use_peak"] <= r["kv_cache"]["pages"]
        assert r["total_output_tokens"] == sum(trace.output_lens)      # ignore_eos: every length as drawn
        assert r["total_input_tokens"] == sum(len(p) for p in trace.prompts)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = r[key]
            assert set(s) == {"mean", "p50", "p90", "p99"} and 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert report["results"]["speculative"]["tau_mean"] > 1.0 == report["results"]["target_only"]["tau_mean"]
    text = format_report(report)
    assert "Serving Benchmark Result: speculative" in text and "Median TTFT (ms):" in text
    assert "KV pages in use at most / pool:" in text and "Preemptions:" in text


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


# -- an OpenAI-compatible server over HTTP (--base-url) -----------------------------------------

SERVER_KEYS = KEYS - {"kv_cache"} | {"token_counts"}       # a client does not see the pool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lfmspark_serve(log: Path, *args: str) -> Iterator[str]:
    """``lfmspark serve ARGS`` on a free loopback port, until the block ends; its URL."""
    import httpx

    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lfmspark.tools.cli", "serve", *args, "--port", str(port),
                                 "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not healthy in time:\n" + log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def preset_server(tmp_path_factory) -> Iterator[str]:
    """The tiny preset (vocabulary 256) with its default draft: completions of token-id prompts."""
    with lfmspark_serve(tmp_path_factory.mktemp("preset") / "serve.log", "--preset", "tiny", "--max-batch", "4",
                        "--max-seq-len", "128") as url:
        yield url


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory) -> Iterator[str]:
    """A tiny checkpoint with a word tokenizer and a chat template (a preset has none), and a draft."""
    from engine_fixtures import save_tiny_draft, save_tiny_target

    root = tmp_path_factory.mktemp("chat")
    target, draft = save_tiny_target(root / "target"), save_tiny_draft(root / "draft")
    with lfmspark_serve(root / "serve.log", "--target", str(target), "--draft", str(draft), "--max-batch", "4",
                        "--max-seq-len", "128") as url:
        yield url


def check_server_result(r: dict, n: int, output_tokens: int, counted: str = "usage") -> None:
    assert set(r) - {"request_rate"} == SERVER_KEYS         # request_rate: with --capacity-fraction
    assert r["successful_requests"] == n and r["failed_requests"] == 0, r["errors"]
    assert r["total_output_tokens"] == output_tokens          # ignore_eos + min_tokens: every length as drawn
    assert r["token_counts"] == counted and r["tau_mean"] is None and r["peak_memory_gb"] is None
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = r[key]
        assert set(s) == {"mean", "p50", "p90", "p99"} and 0 < s["p50"] <= s["p90"] <= s["p99"], key


def test_the_trace_over_http_against_lfmspark_serve(preset_server, tmp_path):
    """Completions of random token-id prompts, streamed: the in-process trace of the tiny preset
    (same seed, same vocabulary), every request at its length, counted from the server's usage."""
    shape = dict(num_prompts=8, input_len=10, output_len=6, range_ratio=0.5, request_rate=50.0)
    cfg = ServeBenchConfig(**shape, base_url=preset_server, vocab_size=target_preset("tiny").vocab_size,
                           api_key="sk-not-in-the-report", json_path=str(tmp_path / "r.json"))
    trace = make_trace(cfg, cfg.vocab_size)
    in_process = make_trace(ServeBenchConfig(EngineConfig(preset="tiny"), **shape), target_preset("tiny").vocab_size)
    assert (trace.prompts, trace.output_lens, trace.arrivals) == (
        in_process.prompts, in_process.output_lens, in_process.arrivals)
    returned = run_serve_bench(cfg)
    text = (tmp_path / "r.json").read_text()
    report = json.loads(text)
    assert report["results"] == json.loads(json.dumps(returned["results"])) and "sk-not" not in text
    assert report["schema"] == 1 and set(report["results"]) == {"server"}
    assert report["server"] == {"base_url": preset_server, "endpoint": "/v1/completions", "model": "tiny",
                                "refused_fields": []}
    r = report["results"]["server"]
    check_server_result(r, 8, sum(trace.output_lens))
    assert r["total_input_tokens"] == sum(len(p) for p in trace.prompts)
    table = format_report(report)
    assert "Serving Benchmark Result: server" in table and "the server's usage" in table
    assert f"{'Mean tau (tokens per round):':<44}n/a" in table


def test_the_chat_endpoint_from_the_command_line(chat_server, tmp_path, capsys):
    """--endpoint chat: each text prompt of a dataset as one user message; --model and the base URL
    with /v1 as given; the capacity, then a fraction of it."""
    dataset = tmp_path / "chats.jsonl"
    lens = [5, 7, 4, 6]
    dataset.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (i + j) % 17}" for j in range(6 + i)),
                                           "output_len": n}) + "\n" for i, n in enumerate(lens)))
    out = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", chat_server + "/v1", "--endpoint", "chat", "--model", "target",
                 "--dataset", str(dataset), "--capacity-fraction", "0.8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["server"]["endpoint"] == "/v1/chat/completions" and report["server"]["model"] == "target"
    assert set(report["results"]) == {"server_saturation", "server"}
    for r in report["results"].values():
        check_server_result(r, len(lens), sum(lens))
        assert r["total_input_tokens"] > sum(6 + i for i in range(len(lens)))      # the chat template's tokens
    assert report["results"]["server"]["request_rate"] == pytest.approx(
        0.8 * report["results"]["server_saturation"]["request_throughput"])
    assert "Serving Benchmark Result: server_saturation" in capsys.readouterr().out


class Refusing:
    """A stand-in OpenAI server on loopback (uvicorn in a daemon thread) that refuses every field
    beyond OpenAI's by name, one per answer, and streams one token a chunk with no usage."""

    OPTIONAL = ("ignore_eos", "min_tokens", "stream_options")

    def __init__(self):
        uvicorn = pytest.importorskip("uvicorn")
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.bodies: list[dict] = []
        self.headers: list[str | None] = []

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

        async def completions(request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(request.headers.get("authorization"))
            refused = [k for k in self.OPTIONAL if k in body]
            if refused:
                return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: {refused[0]}"}},
                                    status_code=400)

            async def chunks():
                for i in range(body["max_tokens"]):
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
                    yield "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_a_server_that_refuses_the_optional_fields_and_returns_no_usage(tmp_path, monkeypatch):
    """The warm-up request finds the refused fields, which no request then carries; the tokens are
    counted one per chunk, and the report says so; OPENAI_API_KEY is sent, not written."""
    server = Refusing()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    try:
        out = tmp_path / "r.json"
        assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "5", "--prompt-len", "4",
                     "--output-len", "3", "--range-ratio", "0.5", "--request-rate", "100", "--json", str(out)]) == 0
    finally:
        server.stop()
    report = json.loads(out.read_text())
    assert report["server"]["refused_fields"] == list(Refusing.OPTIONAL) and report["server"]["model"] == "stand-in"
    trace = make_trace(ServeBenchConfig(num_prompts=5, input_len=4, output_len=3, range_ratio=0.5,
                                        request_rate=100.0), vocab=65536)      # --vocab-size's default
    timed = server.bodies[-5:]
    assert sorted(b["prompt"] for b in timed) == sorted(trace.prompts)
    assert all(not set(Refusing.OPTIONAL) & set(b) and b["stream"] and b["model"] == "stand-in" for b in timed)
    assert set(server.headers) == {"Bearer sk-from-the-environment"} and "sk-from" not in out.read_text()
    r = report["results"]["server"]
    check_server_result(r, 5, sum(trace.output_lens), counted="chunks")
    assert r["total_input_tokens"] == sum(len(p) for p in trace.prompts)
    assert "one token each (no usage returned)" in format_report(report)


def test_a_server_that_is_down_gives_failed_requests():
    cfg = ServeBenchConfig(num_prompts=3, input_len=4, output_len=3, base_url=f"http://127.0.0.1:{free_port()}",
                           capacity_fraction=0.5)
    results = run_serve_bench(cfg)["results"]
    assert set(results) == {"server_saturation", "server"}
    for r in results.values():
        assert r["successful_requests"] == 0 and r["failed_requests"] == 3
        assert r["errors"] and all(e.startswith("ConnectError") for e in r["errors"])
    assert "First error:" in format_report({"results": results})


@pytest.mark.parametrize("args, message", [
    (["--base-url", "http://127.0.0.1:1", "--preset", "tiny", "--max-num-seqs", "4", "--imposed-acceptance", "0.8"],
     "--preset, --max-batch, --imposed-acceptance configure the in-process engines, which --base-url does not build"),
    (["--base-url", "http://127.0.0.1:1", "--target", "somewhere"], "--target configures the in-process engines"),
    (["--base-url", "http://127.0.0.1:1", "--endpoint", "chat"], "give a --dataset of text prompts"),
    (["--endpoint", "chat", "--api-key", "k"], "--endpoint, --api-key go with --base-url"),
    (["--model", "somewhere", "--preset", "tiny"], "--model (the target, without --base-url) is not allowed with"),
    (["--no-phase-split", "--batch-sizes", "1"],
     "--batch-sizes, --no-phase-split do not apply to lfmspark bench serve"),
])
def test_flags_bench_serve_does_not_use_are_refused(args, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", *args])
    assert message in str(e.value)


# -- each bench mode's own parser ----------------------------------------------------------------

def help_of(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["bench", *args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_each_bench_mode_has_its_own_help(capsys):
    serve = help_of(capsys, "serve")
    assert "usage: lfmspark bench serve" in serve
    for flag in ("--request-rate", "--base-url", "--endpoint", "--api-key", "--model NAME", "--max-batch"):
        assert flag in serve, flag
    assert "--no-phase-split" not in serve and "--batch-sizes" not in serve and "--settings" not in serve
    assert "requests in the trace (default: 64)" in serve
    latency = help_of(capsys, "--preset", "tiny")                  # no mode: the latency benchmark's
    assert "usage: lfmspark bench latency" in latency and "--no-phase-split" in latency
    assert "--request-rate" not in latency and "--batch-sizes BATCH_SIZES" in latency
    sampling = help_of(capsys, "sampling")
    assert "--settings" in sampling and "--request-rate" not in sampling and "--no-hf" not in sampling
    assert "comma-separated batch sizes measured (default: 1,8)" in sampling
    overview = help_of(capsys)
    assert all(mode in overview for mode in ("latency", "serve", "sampling", "warmup", "multiturn", "exact"))
    assert "exact: --batch-sizes 1,8 --prompt-len 128 --output-len 256 --runs 2 --num-prompts 200" in overview


def test_bench_without_a_mode_is_still_the_latency_benchmark(monkeypatch, capsys):
    from lfmspark.tools import bench

    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda cfg: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr(bench, "table", lambda report: "")
    assert main(["bench", "--batch-sizes", "1", "--preset", "tiny", "--device", "cpu", "--no-hf", "--runs", "1"]) == 0
    cfg = seen["cfg"]
    assert (cfg.batch_sizes, cfg.prompt_len, cfg.output_len, cfg.runs, cfg.hf) == ([1], 128, 128, 1, False)
    assert cfg.command == "lfmspark bench --batch-sizes 1 --preset tiny --device cpu --no-hf --runs 1"
    assert with_bench_mode(["-v", "bench"]) == ["-v", "bench", "latency"]
    assert with_bench_mode(["bench", "exact", "--json", "x"]) == ["bench", "exact", "--json", "x"]
    assert with_bench_mode(["bench", "--help"]) == ["bench", "--help"]
    assert with_bench_mode(["serve", "--preset", "tiny"]) == ["serve", "--preset", "tiny"]
