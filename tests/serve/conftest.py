"""The server tests' checkpoint: a tiny target with a word-level tokenizer, and a DSpark draft."""

import pytest

from engine_fixtures import save_tiny_draft, save_tiny_target


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return save_tiny_target(root / "target"), save_tiny_draft(root / "draft")
