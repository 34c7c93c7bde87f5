"""Render the results tables of docs/benchmarks.md from their data in docs/results/*.json.

Each figure of the results page is one JSON file, ``docs/results/NAME.json``::

    {
      "title": "LFM2.5-1.2B decode TPOT, target-only against DSpark, per batch",
      "columns": [{"key": "batch", "label": "batch"}, {"key": "tpot_p50_ms", "label": "TPOT p50 (ms)"}, ...],
      "key": ["gpu", "batch", "engine"],
      "rows": [{"batch": "1", "engine": "target-only", "tpot_p50_ms": "0.712", ...,
                "gpu": "H200", "date": "2026-12-04", "commit": "0ba5f8c", "commit_recorded": true,
                "command": "lfmspark bench --preset lfm2.5-1.2b ..."}]
    }

Every row carries the measured values (strings, exactly as printed, so ``1.290`` keeps its digits),
the GPU (or CPU) it ran on, the date, the commit and the command that reproduces it.
``commit_recorded: true`` marks a commit that recorded the figure where the measured commit was not
stated (rendered with a dagger). ``key`` names the fields that identify what a row measures: a new
measurement of the same thing replaces the row with the same key (older rows live in git history).

In docs/benchmarks.md each table sits between ``<!-- table: NAME -->`` and ``<!-- end table -->``;
this script writes the rendered table (the columns, then GPU, date, commit and a command reference)
and the table's command list there. The prose around the markers is written by hand.

    python scripts/results_tables.py            # rewrite the tables in docs/benchmarks.md
    python scripts/results_tables.py --check    # exit 1 naming every table that differs from its JSON

From ``lfmspark bench --json`` to a row: a report's ``results.target_only`` and
``results.speculative`` entries are rows of the TPOT tables (``tpot_lfm2.5-1.2b``,
``tpot_8b-a1b``). ``--import-bench REPORT --into NAME [--commit SHA]`` does that mapping:

- ``batch`` <- the entry's ``batch``; ``engine`` <- ``target-only`` for ``results.target_only``, else
  ``DSpark, imposed R`` (``imposed_profile``, one rate) or ``DSpark`` (real acceptance); `` (exact)``
  appended when ``config.engine.exact``;
- ``tpot_p50_ms`` / ``tpot_p99_ms`` <- ``tpot_ms_p50`` / ``tpot_ms_p99`` (3 decimals), ``tau`` <-
  ``tau`` (2 decimals), ``vs_target_only`` <- the target-only entry's ``tpot_ms_p50`` of the same
  batch over the entry's (2 decimals and ``x``);
- ``preset`` <- ``config.engine.preset`` (or the preset ``models`` names) upper-cased
  (``LFM2-8B-A1B``), ``output_tokens`` <- ``config.output_len``;
- ``gpu`` <- ``environment.gpu`` (the H100 / H200 / ... part of the device name), ``date`` <-
  ``environment.date`` (the day), ``command`` <- ``environment.command``, ``commit`` <-
  ``environment.commit`` (the checkout the benchmark ran from), or ``--commit`` where it has none.

Only the fields that are columns of the target table are kept, and only entries whose preset the
table's ``"import"`` list names. The other tables' rows (floors, TTFT, HF baselines, warm-up,
memory) map the same report fields by hand: ``step_ms``, ``floor_ms``, ``step_over_floor``,
``copy_gbps``, ``ttft_ms_p50``, ``prefill_ms``, ``results.hf_eager``, ``warmup``,
``peak_memory_bytes``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDARD = ("gpu", "date", "commit", "command")        # every row has these
BEGIN = re.compile(r"^<!-- table: (?P<name>[\w.\-]+) -->$")
END = "<!-- end table -->"
DAGGER = "†"


def load_tables(results: Path) -> dict[str, dict]:
    """Every ``NAME.json`` under ``results``, by name, checked for the fields each row needs."""
    tables: dict[str, dict] = {}
    for path in sorted(results.glob("*.json")):
        table = json.loads(path.read_text(encoding="utf-8"))
        for i, row in enumerate(table["rows"]):
            missing = [f for f in STANDARD if not row.get(f)]
            if missing:
                raise ValueError(f"{path.name}: row {i} lacks {', '.join(missing)}")
        tables[path.stem] = table
    return tables


def _cell(value: object) -> str:
    text = "–" if value in (None, "") else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render(table: dict) -> str:
    """The markdown that goes between a table's markers: the table, then its commands."""
    columns = [(c["key"], c["label"]) for c in table["columns"]]
    commands: list[str] = []
    lines = ["| " + " | ".join([label for _, label in columns] + ["GPU", "date", "commit", "command"]) + " |",
             "|" + "---|" * (len(columns) + 4)]
    for row in table["rows"]:
        if row["command"] not in commands:
            commands.append(row["command"])
        commit = f"`{row['commit']}`" + (DAGGER if row.get("commit_recorded") else "")
        cells = [_cell(row.get(key)) for key, _ in columns]
        cells += [_cell(row["gpu"]), row["date"], commit, f"({commands.index(row['command']) + 1})"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- ({i}) `{command}`" for i, command in enumerate(commands, 1)]
    return "\n".join(lines)


def blocks(markdown: str) -> dict[str, tuple[int, int]]:
    """Each marked table's name -> (index of its first content line, index of its end marker)."""
    lines = markdown.split("\n")
    found: dict[str, tuple[int, int]] = {}
    i = 0
    while i < len(lines):
        match = BEGIN.match(lines[i])
        if match:
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == END), None)
            if end is None:
                raise ValueError(f"table {match['name']}: no '{END}' after its marker")
            if match["name"] in found:
                raise ValueError(f"table {match['name']}: marked twice")
            found[match["name"]] = (i + 1, end)
            i = end
        i += 1
    return found


def rendered(markdown: str, tables: dict[str, dict]) -> tuple[str, list[str]]:
    """The markdown with every marked table rendered from its JSON, and the problems found."""
    lines = markdown.split("\n")
    marked = blocks(markdown)
    problems = [f"{name}: no JSON file for this marked table" for name in marked if name not in tables]
    problems += [f"{name}: no '<!-- table: {name} -->' marker in the markdown" for name in tables if name not in marked]
    for name, (start, end) in sorted(marked.items(), key=lambda item: -item[1][0]):   # last first: indices hold
        if name in tables:
            new = ["", render(tables[name]), ""]
            if lines[start:end] != "\n".join(new).split("\n"):
                problems.append(f"{name}: the markdown differs from what docs/results/{name}.json renders")
            lines[start:end] = new
    return "\n".join(lines), problems


def short_gpu(name: str) -> str:
    match = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return match.group(1) if match else name


def import_bench(report: dict, table: dict, commit: str | None = None) -> list[dict]:
    """Rows of a TPOT table from one ``lfmspark bench --json`` report (see the module docstring)."""
    env, cfg = report["environment"], report["config"]
    engine_cfg = cfg["engine"]
    models = re.match(r"preset (\S+)", report.get("models", ""))
    preset = str(engine_cfg.get("preset") or (models.group(1) if models else ""))
    commit = commit or env.get("commit")
    if not commit:
        raise ValueError("the report records no commit (not run from a git checkout): pass --commit")
    if preset not in table.get("import", []):
        raise ValueError(f"preset {preset!r} is not one this table takes ({table.get('import', [])})")
    results = report["results"]
    base = {r["batch"]: r["tpot_ms_p50"] for r in results.get("target_only", []) if "tpot_ms_p50" in r}
    keep = {c["key"] for c in table["columns"]}
    rows = []
    for kind in ("target_only", "speculative"):
        for entry in results.get(kind, []):
            if "tpot_ms_p50" not in entry:
                continue                       # a failed row
            rates = sorted(set(entry.get("imposed_profile") or []))
            engine = "target-only" if kind == "target_only" else (
                f"DSpark, imposed {rates[0]:g}" if len(rates) == 1 else "DSpark")
            values = {"preset": preset.upper(), "batch": str(entry["batch"]),
                      "engine": engine + (" (exact)" if engine_cfg.get("exact") else ""),
                      "output_tokens": str(cfg.get("output_len")),
                      "tpot_p50_ms": f"{entry['tpot_ms_p50']:.3f}", "tpot_p99_ms": f"{entry['tpot_ms_p99']:.3f}"}
            if "tau" in entry and kind == "speculative":
                values["tau"] = f"{entry['tau']:.2f}"
            if entry["batch"] in base:
                values["vs_target_only"] = f"{base[entry['batch']] / entry['tpot_ms_p50']:.2f}x"
            row = {k: v for k, v in values.items() if k in keep}
            row.update(gpu=short_gpu(env.get("gpu") or env.get("device", "")), date=str(env["date"])[:10],
                       commit=commit, command=env["command"])
            rows.append(row)
    return rows


def merge(table: dict, new_rows: list[dict]) -> None:
    """Put ``new_rows`` into ``table``: each replaces the row with the same key, or is appended."""
    key = table.get("key") or []
    for new in new_rows:
        ident = [new.get(k) for k in key]
        for i, old in enumerate(table["rows"]):
            if key and [old.get(k) for k in key] == ident:
                table["rows"][i] = new
                break
        else:
            table["rows"].append(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming the tables that differ")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    parser.add_argument("--import-bench", metavar="REPORT", type=Path,
                        help="an `lfmspark bench --json` report whose rows go into --into")
    parser.add_argument("--into", metavar="NAME", help="the results table the report's rows go into")
    parser.add_argument("--commit", help="the commit the report measured, where the report records none")
    args = parser.parse_args(argv)
    results, markdown_path = args.root / "docs" / "results", args.root / "docs" / "benchmarks.md"

    if args.import_bench:
        if not args.into:
            parser.error("--import-bench needs --into")
        path = results / f"{args.into}.json"
        table = json.loads(path.read_text(encoding="utf-8"))
        merge(table, import_bench(json.loads(args.import_bench.read_text(encoding="utf-8")), table, args.commit))
        path.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    markdown = markdown_path.read_text(encoding="utf-8")
    new, problems = rendered(markdown, load_tables(results))
    if args.check:
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    structural = [p for p in problems if "differs" not in p]
    for problem in structural:
        print(problem, file=sys.stderr)
    if new != markdown:
        markdown_path.write_text(new, encoding="utf-8")
    return 1 if structural else 0


if __name__ == "__main__":
    sys.exit(main())
