"""``EngineConfig`` (runtime/config.py): validated once, the same flags and defaults for every command,
and the one way an engine is built from options."""

from __future__ import annotations

import argparse

import pytest
import torch

from lfmspark import Engine, EngineConfig, SamplingParams
from lfmspark.tools.cli import build_parser


@pytest.mark.parametrize("changes, message", [
    (dict(max_batch=0), "max_batch must be >= 1, got 0"),
    (dict(max_batch=2.0), "max_batch must be an integer, got 2.0"),
    (dict(max_seq_len=True), "max_seq_len must be an integer, got True"),
    (dict(prefill_budget=0), "prefill_budget must be >= 1"),
    (dict(prefill_graph_tokens=-1), "prefill_graph_tokens must be >= 0"),
    (dict(prefix_block=0), "prefix_block must be >= 1"),
    (dict(prefix_cache_tokens=-5), "prefix_cache_tokens must be None"),
    (dict(markov_walk="fast"), "markov_walk='fast': use one of"),
    (dict(logprobs_mode="final"), "logprobs_mode='final': use one of"),
    (dict(exact=1), "exact must be True or False, got 1"),
    (dict(routing_locality="2"), "routing_locality must be an integer"),
    (dict(imposed_acceptance=[0.5, 1.5]), "imposed_acceptance must give per-position rates in [0, 1]"),
    (dict(batch_sizes=[4, 0]), "batch_sizes must be a non-empty list of integers >= 1"),
    (dict(preset="lfm9"), "unknown preset 'lfm9'"),
    (dict(target="dir", preset="tiny"), "not both"),
    (dict(draft="dir"), "draft (a checkpoint directory) needs target"),
    (dict(draft_preset="mystery"), "unknown draft preset 'mystery'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(quantization="int8"), "unknown quantization 'int8': use fp8, or None"),
])
def test_a_bad_option_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig(**changes)


def test_replace_names_an_unknown_option_and_the_engine_passes_it_on(target):
    with pytest.raises(TypeError, match="unknown engine option max_batches"):
        EngineConfig().replace(max_batches=2)
    with pytest.raises(TypeError, match="unknown engine option max_batches"):
        Engine(target, None, max_batches=2)
    cfg = EngineConfig(max_batch=3).replace(max_seq_len=128)
    assert (cfg.max_batch, cfg.max_seq_len) == (3, 128)


def test_lists_become_tuples_and_a_dict_round_trips():
    cfg = EngineConfig(preset="tiny", verify_widths=[1, 5], batch_sizes=[1, 2], imposed_acceptance=[0.5],
                       dtype=torch.float16, device=torch.device("cpu"))
    assert cfg.verify_widths == (1, 5) and cfg.batch_sizes == (1, 2) and cfg.imposed_acceptance == (0.5,)
    assert cfg.dtype == "float16" and cfg.device == "cpu"
    assert EngineConfig(**cfg.as_dict()) == cfg
    assert hash(cfg) == hash(EngineConfig(**cfg.as_dict()))       # frozen: usable as a key, picklable to Ray


def test_auto_dtype_follows_the_device():
    assert EngineConfig(device="cpu").torch_dtype() is torch.float32
    assert EngineConfig(device="cpu", dtype="bf16").torch_dtype() is torch.bfloat16
    assert EngineConfig(device="cuda").torch_dtype() is torch.bfloat16


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    return EngineConfig.from_args(parser.parse_args(list(argv)))


def test_flags_map_to_fields_with_the_vllm_names_too():
    assert parse() == EngineConfig()
    cfg = parse("--preset", "tiny", "--draft-preset", "none", "--max-num-seqs", "16", "--max-model-len", "512",
                "--enforce-eager", "--cuda-graph-sizes", "1,4", "--no-chat", "--verify-widths", "1,5",
                "--imposed-acceptance", "0.8", "--prefix-cache-tokens", "0", "--exact", "--dtype", "float16",
                "--device", "cpu", "--seed", "7", "--logprobs-mode", "processed", "--prefill-budget", "64")
    assert cfg == EngineConfig(preset="tiny", draft_preset=None, max_batch=16, max_seq_len=512, cuda_graphs=False,
                               batch_sizes=(1, 4), chat=False, verify_widths=(1, 5), imposed_acceptance=(0.8,),
                               prefix_cache_tokens=0, exact=True, dtype="float16", device="cpu", seed=7,
                               logprobs_mode="processed", prefill_budget=64)
    assert parse("--max-batch", "3", "--max-seq-len", "64").max_batch == 3
    assert parse("--quantization", "fp8").quantization == parse("-q", "fp8").quantization == "fp8"
    assert parse().quantization is None


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Every engine flag of a command's parser with its default."""
    reference = argparse.ArgumentParser()
    EngineConfig.add_arguments(reference)
    names = {s for a in reference._actions for s in a.option_strings} - {"-h", "--help"}
    return {s: a.default for a in parser._actions for s in a.option_strings if s in names}


def test_every_command_takes_the_same_engine_flags_with_the_same_defaults():
    commands = dict(build_parser()._subparsers._group_actions[0].choices)
    assert set(commands) == {"bench", "generate", "serve", "calibrate"}
    modes = commands.pop("bench")._subparsers._group_actions[0].choices     # bench: one parser per mode
    assert set(modes) == {"latency", "serve", "sampling", "warmup", "multiturn", "exact", "structured", "fp8"}
    flags = {name: engine_flags(p) for name, p in commands.items()}
    flags |= {f"bench {name}": engine_flags(p) for name, p in modes.items()}
    reference = flags["serve"]
    assert {"--max-model-len", "--max-num-seqs", "--enforce-eager", "--exact", "--target", "--preset"} <= set(reference)
    for name, got in flags.items():
        assert got == reference, name


def test_help_shows_the_defaults():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "(default: 8)" in text and "(default: the model's context length" in text and "(default: 256)" in text
    assert "--page-size" in text and "--kv-cache-memory" in text and "--gpu-memory-utilization" in text
    assert "--max-model-len" in text and "--max-num-seqs" in text


def test_from_config_builds_what_from_preset_builds():
    cfg = EngineConfig(preset="tiny", device="cpu", max_batch=2, max_seq_len=96, seed=3)
    a = Engine.from_config(cfg)
    b = Engine.from_preset("tiny", dtype=torch.float32, device="cpu", max_batch=2, max_seq_len=96, seed=3)
    assert a.config == b.config.replace(dtype="auto")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert a.generate([[3, 4, 5]], params)[0].token_ids == b.generate([[3, 4, 5]], params)[0].token_ids
    assert a.block_size == 4 and a.model_config.vocab_size == 264


def test_one_imposed_rate_applies_to_every_draft_slot(target, draft):
    e = Engine(target, draft, max_batch=1, max_seq_len=64, imposed_acceptance=[0.25])
    assert e.model_runner.imposed_acceptance.tolist() == [0.25] * e.block_size


def test_a_cpu_engine_runs_one_thread_unless_the_user_chose(target, monkeypatch):
    """runtime/cpu_threads.py: torch's default thread count drops to one; a count the user set (the
    config, OMP_NUM_THREADS, torch.set_num_threads after import) is kept."""
    from lfmspark.runtime import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_AT_IMPORT", 2)         # as if torch's default here were 2
    build = lambda **kw: Engine(target, None, max_batch=1, max_seq_len=64, **kw)  # noqa: E731
    try:
        torch.set_num_threads(2)
        build()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)                                 # the user's own choice
        build()
        assert torch.get_num_threads() == 3
        build(cpu_threads=2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        build()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)                                 # the suite's setting (tests/conftest.py)
