"""Fixtures for the model tests (helpers live in ``lfm_testing.py``)."""

from __future__ import annotations

import pytest

from lfm_testing import TINY_DENSE, TINY_MOE, HFCheckpoint, make_checkpoint


# ---------------------------------------------------------------------------------------------
# session fixtures (built once; tests must not modify the directories)

@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory) -> HFCheckpoint:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "dense", TINY_DENSE, seed=0)


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory) -> HFCheckpoint:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "moe", TINY_MOE, seed=1)


@pytest.fixture(scope="session")
def moe_fixed_routing_ckpt(tmp_path_factory) -> HFCheckpoint:
    """The MoE model with an expert bias so large that selection never depends on the input:
    no routing near-ties, so bf16 can be held to the dense bound (the weights still do vary)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "moe_fixed", TINY_MOE, seed=1,
                           expert_bias=[0.0, 10.0, 20.0, 30.0])


@pytest.fixture(params=["dense", "moe"])
def ckpt(request) -> HFCheckpoint:
    return request.getfixturevalue(f"{request.param}_ckpt")


