"""STS calibration of the draft's confidence head (runtime/calibration.py, ``lfmspark calibrate``)."""

from __future__ import annotations

import json

import pytest
import torch

from lfmspark.models.config import ConfigError, DraftConfig
from lfmspark.models.dspark import ConfidenceHead
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.tools.calibration import expected_calibration_error, fit_sts, record_rounds
from lfmspark.tools.cli import main
from spec_fixtures import random_tiny_draft, random_tiny_target, tiny_draft_config


def test_ece_of_a_calibrated_predictor_is_small_and_of_an_overconfident_one_large():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(50000, generator=g, dtype=torch.float64)
    label = (torch.rand(50000, generator=g, dtype=torch.float64) < p).double()
    assert expected_calibration_error(p, label) < 0.01
    assert expected_calibration_error(p.sqrt(), label) > 0.1


def test_fit_recovers_the_temperatures_that_generated_the_outcomes():
    """Outcomes drawn so that slot k survives with sigmoid(z_k / T_k) given the earlier ones: the fit
    finds each T_k (the grid is 0.01 apart; sampling noise allows a little more), and its ECE after is
    below the raw head's."""
    true_t = [2.0, 0.5, 1.5]
    g = torch.Generator().manual_seed(1)
    n = 40000
    z = torch.randn(n, 3, generator=g, dtype=torch.float64) * 2
    accepted = torch.zeros(n, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    for k, t in enumerate(true_t):
        alive &= torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(z[:, k] / t)
        accepted += alive
    fit = fit_sts(z, accepted)
    assert fit.temperatures == pytest.approx(true_t, rel=0.15)
    assert fit.rounds == n
    assert all(a < b for a, b in zip(fit.ece_after, fit.ece_before))
    with pytest.raises(ValueError, match="no rounds"):
        fit_sts(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))


def test_the_head_applies_the_configured_temperatures():
    cfg = tiny_draft_config(block=3)
    plain = ConfidenceHead(cfg)
    scaled = ConfidenceHead(DraftConfig(**{**cfg.__dict__, "sts_temperatures": (2.0, 0.5, 1.0)}))
    scaled.load_state_dict(plain.state_dict())
    h, e = torch.randn(2, 3, cfg.hidden_size), torch.randn(2, 3, cfg.markov_rank)
    with torch.no_grad():
        logit = torch.logit(plain(h, e).double())
        want = torch.sigmoid(logit / torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64))
        torch.testing.assert_close(scaled(h, e).double(), want, rtol=1e-5, atol=1e-6)


def test_config_reads_the_temperatures_and_refuses_bad_ones():
    base = {**tiny_draft_config(block=3).to_hf_dict(), "rope_is_neox_style": False}
    assert DraftConfig.from_dict({**base, "sts_temperatures": [1, 2.5, 0.5]}).sts_temperatures == (1.0, 2.5, 0.5)
    assert DraftConfig.from_dict(base).sts_temperatures is None
    for bad in ([1.0, 2.0], [1.0, 0.0, 1.0], "1,2,3", [1.0, True, 1.0]):
        with pytest.raises(ConfigError, match="sts_temperatures"):
            DraftConfig.from_dict({**base, "sts_temperatures": bad})
    with pytest.raises(ConfigError, match="no confidence head"):
        DraftConfig.from_dict({**base, "enable_confidence_head": False, "confidence_head_with_markov": False,
                               "sts_temperatures": [1.0, 1.0, 1.0]})


def test_record_rounds_reads_every_row_of_rounds_verified_whole():
    target, draft = random_tiny_target(seed=3), random_tiny_draft(block=3, seed=4)
    draft.confidence_head.temperatures = None
    engine = Engine(target, draft, max_batch=4, max_seq_len=64, verify_widths=[4])
    with pytest.raises(ValueError, match="want_confidence"):
        record_rounds(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=8))
    engine.model_runner.steps.want_confidence = True
    z, accepted = record_rounds(engine, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert z.shape[1] == 3 and z.shape[0] == len(accepted) > 0
    assert bool(((accepted >= 0) & (accepted <= 3)).all()) and bool(torch.isfinite(z).all())
    with pytest.raises(ValueError, match="verified whole"):
        record_rounds(Engine(target, draft, max_batch=4, max_seq_len=64), [[1]], SamplingParams(max_new_tokens=4))


def test_calibrate_command_writes_the_fit_and_the_config(tmp_path, capsys):
    from engine_fixtures import save_tiny_draft, save_tiny_target

    target_dir, draft_dir = save_tiny_target(tmp_path / "target"), save_tiny_draft(tmp_path / "draft")
    out = tmp_path / "fit.json"
    code = main(["calibrate", "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "6",
                 "--max-new-tokens", "24", "--max-batch", "4", "--max-seq-len", "256", "--out", str(out),
                 "--write-config"])
    assert code == 0
    fit = json.loads(out.read_text())
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["sts_temperatures"] == fit["sts_temperatures"] and fit["rounds"] > 0
    engine = Engine.from_pretrained(target_dir, draft_dir, dtype=torch.float32, device="cpu", max_batch=1,
                                    max_seq_len=128)
    assert engine.draft.confidence_head.temperatures == tuple(fit["sts_temperatures"])
    with pytest.raises(SystemExit, match="--target needs --draft"):
        main(["calibrate", "--target", str(target_dir)])
