"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET``
must be set before Triton is imported, so it is set here, before any ``lfmspark`` import.
PyTorch runs single-threaded (see below). Tests marked ``gpu`` are skipped when no CUDA device is present.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs thousands of tiny ops; on the 2-core CI machines PyTorch's intra-op thread pool
# makes each of them ~100x slower (8 ms per [4, 40] softmax with 2 threads, 5 us with 1).
torch.set_num_threads(1)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device() -> str:
    """Where the Triton kernels run in this test run: ``cuda`` if present, else the interpreter on CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def target():
    """The engine tests' tiny target (spec_fixtures), one per module: engines take it read-only."""
    from spec_fixtures import random_tiny_target

    return random_tiny_target(seed=3)


@pytest.fixture(scope="module")
def draft():
    """The DSpark draft paired with :func:`target` in the engine tests."""
    from spec_fixtures import random_tiny_draft

    return random_tiny_draft(seed=4)


@pytest.fixture(autouse=True)
def _environment_read_fresh():
    """lfmspark reads its ``LFMSPARK_*`` variables once (lfmspark/environment.py): a test that changes
    them calls ``environment.reload()`` (``set_env`` in env_vars.py), and the next test, whose
    monkeypatch has undone the change, reads them afresh."""
    yield
    from lfmspark import environment

    environment.environment.cache_clear()
