"""The named scenarios of ``lfmspark bench`` (tools/scenarios/): each runs end to end on the tiny
preset on the CPU and writes a report with the keys its module documents; a flag the scenario does
not read, or a bad value, is refused with a message that names it. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lfmspark.tools.cli import main

TINY = ["--preset", "tiny", "--device", "cpu"]
SHORT = ["--prompt-len", "6", "--output-len", "6", "--runs", "1"]
ENVIRONMENT = {"date", "command", "lfmspark", "torch", "transformers", "device", "commit", "variables", "pdl"}


def run_scenario(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, *TINY, *args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scenario"] == name
    assert ENVIRONMENT <= set(report["environment"])
    assert report["environment"]["command"].startswith(f"lfmspark bench {name} ")
    assert report["config"]["engine"]["preset"] == "tiny"
    return report


def test_sampling_times_every_setting_for_both_engines(tmp_path, capsys):
    report = run_scenario(tmp_path, "sampling", "--batch-sizes", "1,2", *SHORT)
    assert report["models"] == "preset tiny + tiny-dspark"
    assert set(report["settings"]) == {"greedy", "model-card", "moe-card", "min-p", "top-p"}
    assert report["settings"]["model-card"] == {"temperature": 0.1, "top_k": 50, "top_p": 0.1,
                                                "repetition_penalty": 1.05}
    assert report["settings"]["moe-card"] == {"temperature": 0.2, "top_k": 80, "repetition_penalty": 1.05}
    assert report["settings"]["min-p"] == {"temperature": 0.3, "min_p": 0.15, "repetition_penalty": 1.05}
    assert set(report["warmup_s"]) == {"speculative", "target_only"}
    cells = [(r["engine"], r["batch"], r["setting"]) for r in report["results"]]
    assert cells == [(e, b, s) for e in ("speculative", "target_only") for b in (1, 2)
                     for s in ("greedy", "model-card", "moe-card", "min-p", "top-p")]
    for r in report["results"]:
        assert r["tpot_ms_p50"] > 0
        if r["engine"] == "speculative":
            assert r["imposed_acceptance"] == [0.9] and sum(r["rounds_by_width"].values()) > 0
        else:
            assert r["imposed_acceptance"] is None and "rounds_by_width" not in r
    table = capsys.readouterr().out
    assert "model-card" in table and "DSpark (imposed 0.9)" in table


def test_sampling_profiles_a_greedy_and_a_model_card_batch_at_each_size(tmp_path):
    report = run_scenario(tmp_path, "sampling", "--batch-sizes", "1,2", "--settings", "greedy",
                          "--profile-dir", str(tmp_path / "prof"), *SHORT)
    names = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert names == sorted(f"profile_sampling_{s}_bs{b}.txt" for b in (1, 2) for s in ("greedy", "model-card"))
    assert sorted(Path(p).name for p in report["profiles"]) == names
    assert (tmp_path / "prof" / "profile_sampling_model-card_bs2.txt").read_text().startswith("model-card, batch 2:")


def test_sampling_takes_a_subset_of_settings(tmp_path):
    report = run_scenario(tmp_path, "sampling", "--batch-sizes", "1", "--settings", "greedy,top-p",
                          "--draft-preset", "none", *SHORT)
    assert [(r["engine"], r["setting"]) for r in report["results"]] == [("target_only", "greedy"),
                                                                         ("target_only", "top-p")]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fp8_reports_quality_and_weight_memory(tmp_path, capsys, preset):
    """The fp8 scenario on a tiny preset (fp32 on the CPU): every quantized module has its weight error,
    the fp8 projections take about a quarter of the fp32 bytes (one byte a weight plus a scale per
    channel), and the teacher-forced distributions stay close (random weights: about 2e-5 mean KL)."""
    out = tmp_path / "fp8.json"
    assert main(["bench", "fp8", "--preset", preset, "--device", "cpu", "--prompt-len", "24", "--num-prompts", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scenario"] == "fp8" and report["positions"] == 48
    assert report["engine_config"]["draft_preset"] is None and report["engine_config"]["quantization"] is None
    names = [r["name"] for r in report["modules"]]
    assert "model.layers.0.conv.in_proj" in names and len(names) == len(set(names))
    assert any(n.endswith("feed_forward.experts.w13") for n in names) == (preset == "tiny-moe")
    assert all(0 < r["weight_rel_err"] < 0.05 for r in report["modules"])
    w = report["weight_bytes"]
    assert 0.25 <= w["projections_fp8"] / w["projections_model_dtype"] < 0.3
    assert w["fp8"] - w["projections_fp8"] == w["model_dtype"] - w["projections_model_dtype"]   # the rest unchanged
    lg, control = report["logits"], report["bf16_control"]
    assert 0 < lg["rel_err"] < 0.08 and 0 < lg["kl_mean"] <= lg["kl_p99"] <= lg["kl_max"] < 1e-2
    assert lg["greedy_agreement"] >= 0.9
    # bf16 rounding (relative 2**-9) moves the fp32 logits less than fp8's (2**-4)
    assert 0 < control["rel_err"] < lg["rel_err"] and control["kl_mean"] < lg["kl_mean"]
    assert 0 < report["reference"]["entropy_mean"] <= report["reference"]["entropy_max"]
    assert "bf16 projections (control)" in capsys.readouterr().out


def test_structured_times_constrained_unconstrained_and_mixed_batches(tmp_path, capsys):
    report = run_scenario(tmp_path, "structured", "--batch-sizes", "1,2", "--prompt-len", "6", "--output-len", "8",
                          "--runs", "1")
    assert report["tokenizer"] == "checkpoint"           # the tiny preset comes with the byte tokenizer
    assert set(report["compile_ms"]) == {"tokenizer", "first", "cached"} and report["compile_ms"]["first"] > 0
    cells = [(r["batch"], r["case"]) for r in report["results"]]
    assert cells == [(1, "unconstrained"), (1, "constrained"), (2, "unconstrained"), (2, "constrained"),
                     (2, "one-constrained")]
    for r in report["results"]:
        assert r["tpot_ms_p50"] > 0 and r["imposed_acceptance"] == [0.9] and sum(r["rounds_by_width"].values()) > 0
        assert (r["constrained_tpot_ms_p50"] is not None) == (r["case"] == "one-constrained")
    assert "20-property schema: compiled in" in capsys.readouterr().out
    assert main(["bench", "structured", *TINY, "--draft-preset", "none", *SHORT]) == 2
    assert "structured scenario: it measures the speculative engine" in capsys.readouterr().err


def test_warmup_reports_the_warmup_and_the_tpot_per_batch_size(tmp_path):
    report = run_scenario(tmp_path, "warmup", "--batch-sizes", "1,2", "--imposed-acceptance", "0.5", *SHORT)
    assert report["engine"] == "speculative" and report["imposed_acceptance"] == [0.5]
    assert set(report["compile_cache"]) == {"dir", "files_before", "files_after", "triton_dir", "triton_files_before",
                                            "triton_files_after", "state"}
    assert report["compile_cache"]["state"] == "unused (eager)"          # the CPU engine compiles nothing
    assert {"seconds", "prefill_s", "steps_s", "profile_s", "mode", "step_graphs", "prefill_graphs", "sizes", "modes",
            "widths", "graphs_compiled", "fx_cache_hits", "fx_cache_misses"} <= set(report["warmup"])
    start = report["startup"]
    assert start["load_s"] > 0 and start["build_s"] > 0 and start["warmup_s"] == report["warmup"]["seconds"] > 0
    assert start["total_s"] == pytest.approx(start["load_s"] + start["build_s"] + start["warmup_s"])
    assert report["warmup"]["widths"] == [1, 3, 5]          # the defaults for the tiny draft's block of 4
    assert [r["batch"] for r in report["results"]] == [1, 2]
    for r in report["results"]:     # several widths: the scheduler's rounds and the whole block every round
        assert r["tpot_ms_p50"] > 0 and r["tpot_ms_p50_whole_block"] > 0
        assert set(r["rounds_by_width"]) <= {"1", "3", "5"} and sum(r["rounds_by_width"].values()) > 0
    # sized to the batches measured; the captured sizes are the engine's defaults
    assert report["engine_config"]["max_batch"] == 2 and report["engine_config"]["batch_sizes"] is None


def test_warmup_reads_both_compile_caches(tmp_path):
    """Warm needs Inductor's cache and Triton's (the ops' kernels) filled; the Triton folder inside
    Inductor's (the default layout) is counted as Triton's only."""
    from lfmspark.tools.scenarios.warmup import cache_state, count_files

    inductor = tmp_path / "inductor"
    (inductor / "triton" / "abc").mkdir(parents=True)
    (inductor / "fxgraph").mkdir()
    assert count_files(inductor, leave_out=inductor / "triton") == 0 and count_files(inductor / "triton") == 0
    (inductor / "triton" / "abc" / "kernel.cubin").write_bytes(b"")
    assert count_files(inductor, leave_out=inductor / "triton") == 0 and count_files(inductor / "triton") == 1
    (inductor / "fxgraph" / "graph").write_bytes(b"")
    assert count_files(inductor, leave_out=inductor / "triton") == 1 and count_files(inductor) == 2
    assert [cache_state(1, 1), cache_state(0, 0)] == ["warm", "cold"]
    assert cache_state(3, 0) == "partly warm (Inductor's cache only)"
    assert cache_state(0, 2) == "partly warm (Triton's cache only)"


def test_warmup_of_a_target_only_engine(tmp_path):
    report = run_scenario(tmp_path, "warmup", "--batch-sizes", "2", "--draft-preset", "none", "--greedy-only", *SHORT)
    assert report["engine"] == "target_only" and report["warmup"]["widths"] == []
    assert report["warmup"]["mode"] == "eager" and report["imposed_acceptance"] is None
    assert list(report["results"][0]) == ["batch", "tpot_ms_p50"]


def test_multiturn_compares_the_prefix_cache_on_and_off(tmp_path, capsys):
    report = run_scenario(tmp_path, "multiturn", "--chats", "2", "--turns", "3", "--system-len", "40", "--turn-len",
                          "10", "--output-len", "5", "--prefix-block", "8", "--page-size", "4")
    assert report["prefix_cache_tokens"] == 40 + 2 * 3 * (10 + 5)          # the whole trace
    on, off = report["turns"]["cache"], report["turns"]["no_cache"]
    assert len(on) == len(off) == 3
    for turn in on + off:
        assert set(turn) == {"prompt_tokens", "cached_tokens", "ttft_ms_p50", "tpot_ms_p50", "between_turns_ms"}
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off] == [50, 65, 80]
    # the first turn finds nothing cached; each later one, the full blocks of the chat's earlier prompts
    assert all(t["cached_tokens"] == 0 for t in off)
    assert on[1]["cached_tokens"] > 0 and on[2]["cached_tokens"] > on[1]["cached_tokens"]
    assert "TTFT p50 ms cache" in capsys.readouterr().out


def test_exact_reports_identity_and_cost_in_both_modes(tmp_path):
    report = run_scenario(tmp_path, "exact", "--batch-sizes", "1,2", "--num-prompts", "3", *SHORT)
    assert [r["mode"] for r in report["identity"]] == ["default", "exact"]
    for r in report["identity"]:
        assert set(r) == {"mode", "prompts", "identical_prompts", "tokens_before_first_difference"}
        assert r["prompts"] == 3
    assert report["identity"][1]["identical_prompts"] == 1.0      # exact mode's guarantee
    cells = [(r["mode"], r["engine"], r["batch"]) for r in report["results"]]
    assert cells == [(m, e, b) for m in ("default", "exact") for e in ("speculative", "target_only") for b in (1, 2)]
    assert all(r["tpot_ms_p50"] > 0 for r in report["results"])
    assert [(r["engine"], r["batch"]) for r in report["exact_over_default"]] == [
        ("speculative", 1), ("speculative", 2), ("target_only", 1), ("target_only", 2)]
    assert report["imposed_acceptance"] == [0.9]
    # the whole block every round (tiny's block: 4), on slots for the identity run's batches of 32
    assert report["engine_config"]["verify_widths"] == [5] and report["engine_config"]["max_batch"] == 32


@pytest.mark.parametrize("args, message", [
    (["bench", "sampling", "--turns", "2"], "--turns (multiturn scenario) does not apply to the sampling scenario"),
    (["bench", "warmup", "--no-hf", "--num-prompts", "3"], "--num-prompts, --no-hf do not apply to the warmup"),
    (["bench", "multiturn", "--batch-sizes", "1,2"], "--batch-sizes does not apply to the multiturn scenario"),
    (["bench", "--greedy-only"], "--greedy-only (warmup scenario) does not apply to lfmspark bench latency"),
    (["bench", "serve", "--settings", "greedy"], "--settings (sampling scenario) does not apply"),
    (["bench", "sampling", "--imposed-acceptance", "0.5", "--imposed-acceptance", "0.6"], "takes one profile here"),
])
def test_a_flag_the_mode_does_not_read_is_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert message in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["bench", "sampling", "--settings", "greedy,nucleus"], "unknown settings ['nucleus']"),
    (["bench", "multiturn", "--chats", "0"], "expected a positive integer, got '0'"),
])
def test_a_bad_scenario_value_is_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["bench", "exact", "--exact"], "runs the default mode and exact mode in turn; drop --exact"),
    (["bench", "exact", "--draft-preset", "none"], "needs a draft"),
    (["bench", "multiturn", "--prefix-cache-tokens", "0"], "compares the prefix cache on and off"),
    (["bench", "sampling", "--max-batch", "1", "--batch-sizes", "1,2"], "--max-batch 1 is below the largest batch"),
])
def test_a_scenario_refuses_engine_flags_it_cannot_honour(args, message, capsys):
    assert main([*args, *TINY]) == 2
    assert message in capsys.readouterr().err
