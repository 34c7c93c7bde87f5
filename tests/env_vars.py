"""Changing lfmspark's ``LFMSPARK_*`` variables inside a test (lfmspark/environment.py reads them once)."""

from __future__ import annotations

import pytest

from lfmspark import environment


def set_env(monkeypatch: pytest.MonkeyPatch, **values: str | None) -> None:
    """Set ``LFMSPARK_<NAME>=value`` for each keyword (None: unset) for this test, and have lfmspark
    read its variables again (raises ``ValueError`` for a value it refuses)."""
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(f"LFMSPARK_{name}", raising=False)
        else:
            monkeypatch.setenv(f"LFMSPARK_{name}", value)
    environment.reload()


def interpret_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' CPU calls run their Triton kernels under the interpreter (``LFMSPARK_TRITON_ON_CPU=1``;
    tests/conftest.py sets ``TRITON_INTERPRET`` on a machine without CUDA)."""
    set_env(monkeypatch, TRITON_ON_CPU="1")
