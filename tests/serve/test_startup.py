"""Time to healthy: the engine's startup phases (``Engine.startup``), the process's age, and the
server's one log line and ``lfmspark:startup_seconds`` gauge once the engine is ready."""

from __future__ import annotations

import asyncio
import inspect
import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lfmspark.runtime import Engine
from lfmspark.serve import make_server_app, process_age_s, ready_line, startup_phases
from server_fixtures import MODEL, load


def test_the_engine_times_its_load_build_and_warmup(ckpt):
    engine = load(ckpt, max_batch=2)
    assert engine.startup.load_s > 0 and engine.startup.build_s > 0 and engine.startup.warmup is None
    assert list(engine.startup.phases()) == ["load", "build"]
    report = engine.warmup(progress=False, sampling=False)
    assert engine.startup.warmup is report and report.seconds >= report.prefill_s + report.total_s > 0
    assert list(engine.startup.phases()) == ["load", "build", "warmup_prefill", "warmup_steps", "warmup_profile"]
    # built from models in memory: nothing loaded
    in_memory = Engine(engine.target, engine.draft, max_batch=2, max_seq_len=64)
    assert in_memory.startup.load_s is None and list(in_memory.startup.phases()) == ["build"]


def test_the_process_age_counts_from_the_process_start():
    """A child process that sleeps before it asks is at least that old, and no older than the parent saw
    it live."""
    source = textwrap.dedent(inspect.getsource(process_age_s))
    code = f"import os, time\n{source}\ntime.sleep(1.0)\nprint(process_age_s())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lived = time.monotonic() - t0
    assert 1.0 <= float(out.stdout) <= lived + 0.02           # /proc's clock ticks are 10 ms


def test_ready_line_and_phases_add_up_to_the_process_age(ckpt):
    engine = load(ckpt, max_batch=2)
    engine.warmup(progress=False, sampling=False)
    phases = startup_phases(engine, age_s=100.0)
    assert sum(phases.values()) == pytest.approx(100.0) and phases["other"] > 0
    line = ready_line(engine, phases, 100.0)
    assert line.startswith("ready 100.0 s after the process started: load ") and ", rounds " in line
    assert line.endswith(f", other {phases['other']:.1f} s")
    assert "other" not in startup_phases(engine, None)
    assert "(the process's start is unknown here)" in ready_line(engine, startup_phases(engine, None), None)
    fresh = Engine(engine.target, None, max_batch=2, max_seq_len=64)
    assert ", no warm-up" in ready_line(fresh, startup_phases(fresh, 5.0), 5.0)


def test_the_server_logs_and_exports_its_time_to_healthy(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="lfmspark.serve")
    app = make_server_app(load(ckpt, max_batch=2), MODEL, warmup=True)
    engine, metrics = app.state.engine, app.state.metrics
    try:
        asyncio.run(engine.wait_ready(120))
        samples = {s.labels["phase"]: s.value for family in text_string_to_metric_families(metrics.render().decode())
                   for s in family.samples if s.name == "lfmspark:startup_seconds"}
    finally:
        asyncio.run(engine.shutdown())
    assert set(samples) == {"load", "build", "warmup_prefill", "warmup_steps", "warmup_profile", "other"}
    age = process_age_s()
    assert all(v >= 0 for v in samples.values()) and samples["load"] > 0 and sum(samples.values()) <= age
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready ")]
    assert len(lines) == 1 and "after the process started: load " in lines[0] and "warm-up " in lines[0]
