"""The MoE routing-locality benchmark mode (models/lfm2_moe.py ``impose_routing_locality``,
``Engine(routing_locality=...)``, ``lfmspark bench --routing-locality``): each slot's tokens choose
among their own subset of experts per layer, the routing weights stay the unbiased ones, speculation
stays lossless under it, the benchmark counts the distinct experts a verify reads, and bad settings
are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from lfmspark.models.lfm2_moe import Lfm2MoeBlock, impose_routing_locality, routing_locality
from lfmspark.models.presets import random_target, target_preset
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.tools.cli import main


def tiny_moe():
    return random_target(target_preset("tiny-moe"), torch.float32, torch.device("cpu"), seed=3)


def test_each_slot_routes_within_its_own_subset_with_the_unbiased_weights():
    target = tiny_moe()
    impose_routing_locality(target, 3, slots=4, seed=1)
    blocks = [m for m in target.modules() if isinstance(m, Lfm2MoeBlock)]
    subsets = [[set((b.routing_bias[s] == 0).nonzero().flatten().tolist()) for s in range(4)] for b in blocks]
    assert all(len(sub) == 3 for layer in subsets for sub in layer)
    assert len({frozenset(sub) for layer in subsets for sub in layer}) > 1      # drawn per slot and layer
    block, subset = blocks[0], subsets[0]
    recorded = []
    route = block.route
    block.route = lambda x, bias=None: recorded.append(route(x, bias)) or recorded[-1]
    slots = torch.tensor([2, 0, 3, 1])
    x = torch.randn(4, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    block(x, slots=slots)
    ids, weights = recorded[0]
    for row, slot in enumerate(slots.tolist()):
        assert set(ids[row * 5:(row + 1) * 5].flatten().tolist()) <= subset[slot]
    # the bias only selects: the weights are the chosen experts' own sigmoid scores, renormalised
    cfg = target.config
    probs = torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ block.gate.weight.T).gather(1, ids)
    if cfg.norm_topk_prob:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(weights, probs * cfg.routed_scaling_factor)
    impose_routing_locality(target, None, slots=4)
    assert routing_locality(target) is None and all(b.routing_bias is None for b in blocks)


def test_speculation_under_routing_locality_is_lossless():
    kw = dict(dtype=torch.float32, device="cpu", max_batch=4, max_seq_len=128, routing_locality=2)
    spec = Engine.from_preset("tiny-moe", **kw)
    plain = Engine.from_preset("tiny-moe", None, **kw)
    assert spec.model_runner.routing_locality == 2 and plain.model_runner.routing_locality == 2
    prompts = [[5, 9, 13], [7, 7, 7, 7, 2], [100, 3], [42] * 6]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("preset, experts, message", [
    ("tiny", 2, "needs an MoE target"),
    ("tiny-moe", 1, r"must lie in \[2, 8\]"),
    ("tiny-moe", 9, r"must lie in \[2, 8\]"),
    ("tiny-moe", True, "must be an integer"),
])
def test_bad_routing_locality_is_refused_by_name(preset, experts, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_preset(preset, None, dtype=torch.float32, device="cpu", max_batch=2, max_seq_len=64,
                           routing_locality=experts)


def test_bench_reports_the_distinct_experts_of_a_verify(tmp_path):
    """With a locality of top_k experts a sequence's tokens all pick the same ones, so a batch-1 verify
    reads exactly top_k experts per layer, and a batch-2 verify at most twice that."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--preset", "tiny-moe", "--batch-sizes", "1,2", "--prompt-len", "6", "--output-len", "9",
                 "--runs", "1", "--no-hf", "--device", "cpu", "--routing-locality", "2", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["engine"]["routing_locality"] == 2 and report["num_experts"] == 8
    rows = {r["batch"]: r for r in report["results"]["speculative"]}
    assert rows[1]["distinct_experts_per_verify"] == 2.0
    assert 2.0 <= rows[2]["distinct_experts_per_verify"] <= 4.0
    assert all(r["routing_locality"] == 2 for r in rows.values())
