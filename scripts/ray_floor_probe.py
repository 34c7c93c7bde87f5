"""Ray Serve's own time to first byte on this machine, against plain uvicorn (issue 40's bound).

Both serve one trivial FastAPI route that streams an SSE event at once; the client (httpx, loopback)
times the first body byte, median of 40 requests after 5. The difference is what Ray Serve's HTTP
proxy and one replica call add before any lfmspark code runs.

    python scripts/ray_floor_probe.py
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve


async def events():
    yield b"data: 1\n\n"
    await asyncio.sleep(0.01)
    yield b"data: 2\n\n"


def first_byte_ms(url: str, n: int = 40, skip: int = 5) -> float:
    times = []
    with httpx.Client() as client:
        for _ in range(n + skip):
            t0 = time.perf_counter()
            with client.stream("POST", url, content=b"{}") as response:
                next(response.iter_bytes())
                times.append(time.perf_counter() - t0)
    return statistics.median(times[skip:]) * 1e3


app = FastAPI()


@app.post("/")
async def stream() -> StreamingResponse:
    return StreamingResponse(events(), media_type="text/event-stream")


@serve.deployment
@serve.ingress(app)
class Streamer:
    pass


def main() -> None:
    threading.Thread(target=uvicorn.run, args=(app,), kwargs=dict(port=8411, log_level="warning"), daemon=True).start()
    time.sleep(2)
    plain = first_byte_ms("http://127.0.0.1:8411/")
    serve.start(http_options={"port": 8412})
    serve.run(Streamer.bind(), name="floor", route_prefix="/floor")
    ray = first_byte_ms("http://127.0.0.1:8412/floor/")
    serve.shutdown()
    print(f"first byte p50: uvicorn {plain:.2f} ms, Ray Serve (proxy + one replica) {ray:.2f} ms, "
          f"difference {ray - plain:.2f} ms")


if __name__ == "__main__":
    main()
