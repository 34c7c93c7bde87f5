"""What the HTTP server adds to the engine (issue 33's figures), measured by a client on loopback.

Starts ``lfmspark serve`` in a subprocess (a preset with its draft, imposed acceptance), waits for
``/health``, then:

1. batch 1: sequential streaming completions (token-id prompt, ``ignore_eos``); the client's TPOT
   per request, (last chunk - first chunk) / (tokens - 1), against the engine's own TPOT for the
   same requests, read from the server's ``lfmspark:time_per_output_token_seconds`` histogram;
2. ``--clients`` concurrent streaming clients: errors, tokens, client TPOT and throughput.

    python scripts/serve_probe.py --preset lfm2.5-1.2b --json out.json
    python scripts/serve_probe.py --preset lfm2.5-1.2b --replicas 1 --json ray.json   # the same on Ray Serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            n = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
            if n:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                tokens += n
    return {"tokens": tokens, "ttft_s": first - t0, "tpot_s": (last - first) / max(tokens - 1, 1)}


async def run_phase(url: str, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if concurrent:
            return list(await asyncio.gather(*(stream_one(client, url, p, max_tokens) for p in prompts)))
        return [await stream_one(client, url, p, max_tokens) for p in prompts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--imposed-acceptance", default="0.8")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--sequential", type=int, default=5)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cuda-graph-sizes", default="1,8,64")
    ap.add_argument("--ready-timeout", type=float, default=480)
    ap.add_argument("--json")
    ap.add_argument("--server-log", default="serve.log")
    ap.add_argument("--replicas", type=int, help="start the server as this many Ray Serve replicas "
                    "(lfmspark serve --replicas; the ray extra)")
    args = ap.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "lfmspark.tools.cli", "serve", "--preset", args.preset, "--port", str(args.port),
           "--max-batch", str(args.clients), "--cuda-graph-sizes", args.cuda_graph_sizes,
           "--imposed-acceptance", args.imposed_acceptance, "--max-seq-len", "2048"]
    if args.replicas:
        cmd += ["--replicas", str(args.replicas)]
    # replicas post their metrics to the ingress every second (serve/ray_app.py): read them after that
    settle = lambda: time.sleep(2.5 if args.replicas else 0.0)  # noqa: E731
    t0 = time.perf_counter()
    with open(args.server_log, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    report: dict = {"command": " ".join(cmd)}
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}; see {args.server_log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > args.ready_timeout:
                raise SystemExit(f"not healthy within {args.ready_timeout} s")
            time.sleep(0.5)
        report["time_to_healthy_s"] = time.perf_counter() - t0
        rng = random.Random(0)
        prompt = lambda: [rng.randrange(1, 200) for _ in range(args.prompt_len)]  # noqa: E731
        asyncio.run(run_phase(url, [prompt()], 16, concurrent=False))             # first-request effects

        name_sum = "lfmspark:time_per_output_token_seconds_sum"
        name_count = "lfmspark:time_per_output_token_seconds_count"
        for phase, n, concurrent, out_len in (("batch1", args.sequential, False, args.output_len),
                                              (f"concurrent{args.clients}", args.clients, True, 128)):
            settle()
            s0, c0 = metric(url, name_sum), metric(url, name_count)
            t = time.perf_counter()
            rows = asyncio.run(run_phase(url, [prompt() for _ in range(n)], out_len, concurrent))
            wall = time.perf_counter() - t
            settle()
            engine_tpot = (metric(url, name_sum) - s0) / max(metric(url, name_count) - c0, 1)
            ok = [r for r in rows if "error" not in r]
            client_tpot = statistics.median(r["tpot_s"] for r in ok) if ok else float("nan")
            report[phase] = {
                "requests": n, "errors": [r["error"] for r in rows if "error" in r],
                "tokens_each": sorted({r["tokens"] for r in ok}), "wall_s": wall,
                "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
                "client_tpot_ms_p50": client_tpot * 1e3, "engine_tpot_ms_mean": engine_tpot * 1e3,
                "client_over_engine": client_tpot / engine_tpot if engine_tpot else float("nan"),
                "client_ttft_ms_p50": statistics.median(r["ttft_s"] for r in ok) * 1e3 if ok else float("nan"),
            }
            print(phase, json.dumps(report[phase]), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
