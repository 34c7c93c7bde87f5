"""docs/benchmarks.md's tables are what docs/results/*.json render (scripts/results_tables.py).

Standard library and the script only: no torch, no lfmspark.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results_tables.py"


def _module():
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--root", str(root)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_the_repository_tables_match_their_json():
    result = _check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_changed_value_fails_the_check_naming_the_table(docs_copy: Path):
    path = docs_copy / "docs" / "results" / "tpot_lfm2.5-1.2b.json"
    table = json.loads(path.read_text(encoding="utf-8"))
    table["rows"][0]["tpot_p50_ms"] = "9.999"
    path.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    result = _check(docs_copy)
    assert result.returncode == 1
    assert "tpot_lfm2.5-1.2b" in result.stderr
    # writing re-renders the table, after which the check passes again
    subprocess.run([sys.executable, str(SCRIPT), "--root", str(docs_copy)], check=True, timeout=60)
    assert _check(docs_copy).returncode == 0
    assert "9.999" in (docs_copy / "docs" / "benchmarks.md").read_text(encoding="utf-8")


def test_a_table_without_markers_or_json_fails_the_check(docs_copy: Path):
    extra = docs_copy / "docs" / "results" / "unplaced.json"
    extra.write_text(json.dumps({"title": "t", "columns": [], "rows": []}), encoding="utf-8")
    result = _check(docs_copy)
    assert result.returncode == 1 and "unplaced" in result.stderr


def test_every_row_names_its_gpu_date_commit_and_command():
    tables = _module().load_tables(ROOT / "docs" / "results")
    assert tables
    for name, table in tables.items():
        keys = {c["key"] for c in table["columns"]}
        for row in table["rows"]:
            assert len(row["date"]) == 10 and row["date"].startswith("20"), name
            assert len(row["commit"]) >= 7, name
            assert set(row) <= keys | {"gpu", "date", "commit", "commit_recorded", "command"}, name


def test_a_bench_report_becomes_rows_that_replace_the_same_measurement():
    mod = _module()
    table = {"columns": [{"key": k, "label": k} for k in
                         ("batch", "engine", "tpot_p50_ms", "tpot_p99_ms", "tau", "vs_target_only")],
             "key": ["gpu", "batch", "engine"], "import": ["lfm2.5-1.2b"],
             "rows": [{"batch": "1", "engine": "target-only", "tpot_p50_ms": "0.800", "gpu": "H100",
                       "date": "2026-01-01", "commit": "0000000", "command": "old"}]}
    report = {"environment": {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-07T10:00:00+00:00",
                              "command": "lfmspark bench --preset lfm2.5-1.2b"},
              "config": {"engine": {"preset": "lfm2.5-1.2b", "exact": False}, "output_len": 128},
              "results": {"target_only": [{"batch": 1, "tpot_ms_p50": 0.9341, "tpot_ms_p99": 0.95}],
                          "speculative": [{"batch": 1, "tpot_ms_p50": 0.3, "tpot_ms_p99": 0.31, "tau": 4.79,
                                           "imposed_profile": [0.8] * 9}]}}
    mod.merge(table, mod.import_bench(report, table, "abc1234"))
    assert len(table["rows"]) == 2
    target, spec = table["rows"]
    assert target["tpot_p50_ms"] == "0.934" and target["commit"] == "abc1234" and target["date"] == "2026-12-07"
    assert spec["engine"] == "DSpark, imposed 0.8" and spec["tau"] == "4.79" and spec["vs_target_only"] == "3.11x"
    assert spec["gpu"] == "H100" and "preset" not in spec
    report["config"]["engine"]["preset"] = "lfm2-8b-a1b"
    with pytest.raises(ValueError):
        mod.import_bench(report, table, "abc1234")
