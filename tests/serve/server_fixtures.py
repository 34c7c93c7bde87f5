"""What the server tests share: an engine over the tiny checkpoint of conftest.py's ``ckpt``, and a
uvicorn server over loopback, in a daemon thread."""

from __future__ import annotations

import socket
import threading
import time

import openai
import pytest
import torch

from lfmspark.runtime import Engine

uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny-chat"


class Served:
    """A uvicorn server on a free loopback port, in a daemon thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.engine

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **({"timeout": 60} | kw))

    def async_client(self, api_key: str = "unused", **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **({"timeout": 60} | kw))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def load(ckpt, **kw) -> Engine:
    target, draft = ckpt
    return Engine.from_pretrained(target, draft, dtype=torch.float32, device="cpu", **({"max_seq_len": 128} | kw))
