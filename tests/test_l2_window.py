"""The L2 access policy window of the round graphs (graphs/l2_window.py).

CPU: the window arithmetic, the switch, and that nothing reaches the CUDA driver off CUDA. GPU:
the window is set on the stream inside the block and cleared after it, and round graphs captured
with it generate exactly what the eager engine does.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.graphs import l2_window
from lfmspark.graphs.l2_window import l2_persist_requested, persisting, stream_window, window_plan

MiB = 2**20


@pytest.mark.parametrize("num_bytes, max_window, max_persisting, expected", [
    (32 * MiB, 128 * MiB, 40 * MiB, (32 * MiB, 32 * MiB, 1.0)),      # fits: every line persists
    (32 * MiB, 128 * MiB, 16 * MiB, (32 * MiB, 16 * MiB, 0.5)),      # half the window fits the set-aside
    (256 * MiB, 128 * MiB, 64 * MiB, (128 * MiB, 64 * MiB, 0.5)),    # capped by the largest window
    (32 * MiB, 128 * MiB, 0, (32 * MiB, 0, 0.0)),                    # no persisting L2 on this device
])
def test_window_plan(num_bytes, max_window, max_persisting, expected):
    assert window_plan(num_bytes, max_window, max_persisting) == expected


def test_switch_values(monkeypatch):
    monkeypatch.delenv("LFMSPARK_L2_PERSIST", raising=False)
    assert not l2_persist_requested()
    monkeypatch.setenv("LFMSPARK_L2_PERSIST", "1")
    assert l2_persist_requested()
    monkeypatch.setenv("LFMSPARK_L2_PERSIST", "yes")
    with pytest.raises(ValueError, match="LFMSPARK_L2_PERSIST='yes'.*use 1"):
        l2_persist_requested()


def test_no_driver_call_without_a_cuda_tensor(monkeypatch):
    def no_driver():
        raise AssertionError("the CUDA driver was called")

    monkeypatch.setattr(l2_window, "_driver", no_driver)
    for tensor in (None, torch.zeros(4)):
        with persisting(None, tensor):
            pass


@pytest.mark.gpu
def test_window_is_set_inside_the_block_and_cleared_after():
    stream = torch.cuda.Stream()
    weight = torch.randn(4 * MiB // 2, dtype=torch.bfloat16, device="cuda")
    with persisting(stream, weight):
        base, num_bytes, hit_ratio = stream_window(stream)
        if num_bytes:   # 0: the device sets no L2 aside (logged), nothing to check; the driver may align the window
            assert base <= weight.data_ptr() < base + num_bytes and num_bytes >= 4 * MiB - 4096 and 0 < hit_ratio <= 1
    assert stream_window(stream)[1] == 0


@pytest.mark.gpu
def test_round_graphs_with_the_window_generate_what_eager_does(monkeypatch):
    from test_graphs_gpu import small_models

    from lfmspark.runtime import Engine, SamplingParams

    monkeypatch.setenv("LFMSPARK_L2_PERSIST", "1")
    target, draft = small_models()
    prompts = [[5, 6, 7, 8], [9], [10, 11]]
    params = SamplingParams(max_new_tokens=32)
    graphs = Engine(target, draft, max_batch=4, max_seq_len=128, batch_sizes=[1, 2, 4])
    graphs.warmup(progress=False, sampling=False)
    eager = Engine(target, draft, max_batch=4, max_seq_len=128, cuda_graphs=False)
    for a, b in zip(graphs.generate(prompts, params), eager.generate(prompts, params)):
        assert a.token_ids == b.token_ids
