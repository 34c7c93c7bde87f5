"""``runtime.transfer.to_device``: the values and dtype arrive; on CUDA through pinned memory, so the
copy is queued behind a long kernel instead of waiting for it."""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime.transfer import to_device


def test_values_and_dtype_on_cpu():
    t = to_device([3, 1, 2], torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_copy_does_not_wait_for_the_stream():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    for _ in range(20):           # a few hundred ms of queued work
        a = a @ a / 64
    t = to_device(list(range(1000)), dev)
    assert not torch.cuda.current_stream().query()     # the host got here while the products still run
    assert t.tolist() == list(range(1000))
