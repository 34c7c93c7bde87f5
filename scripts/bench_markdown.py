"""The docs/benchmarks.md table of one ``lfmspark bench --json`` report (engine rows, then the round
split, the copy bandwidth and peak memory), so a session's tables are copied from the JSON, not by hand.

    python scripts/bench_markdown.py RUN_DIR/bench_1p2b.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _label(key: str, row: dict) -> str:
    if key == "target_only":
        return "target-only (graphs)"
    rates = row.get("imposed_profile") or []
    return f"DSpark, imposed {rates[0]:g}" if len(set(rates)) == 1 else "DSpark, imposed profile"


def _ttft(row: dict) -> str:
    eager = row.get("prefill_bucket", True) is None   # no bucket graph at this batch: the prefill ran eagerly
    return f"{row['ttft_ms_p50']:.3g} ms" + (" (eager)" if eager else "")


def engine_rows(report: dict) -> list[str]:
    res = report["results"]
    base = {r["batch"]: r["tpot_ms_p50"] for r in res["target_only"]}
    hf = {r["batch"]: r["tpot_ms_p50"] for r in res.get("hf_eager", []) if "tpot_ms_p50" in r}
    lines = []
    for key in ("target_only", "speculative"):
        for r in sorted(res.get(key, []), key=lambda r: r["batch"]):
            if "error" in r:
                lines.append(f"| {_label(key, r)} | {r['batch']} | failed: {r['error'][:80]} |")
                continue
            tau = f"{r['tau']:.2f}" if "tau" in r else "–"
            vs_hf = f"{hf[r['batch']] / r['tpot_ms_p50']:.1f}x" if r["batch"] in hf else "–"
            floor = f"{r['floor_ms']:.3f} ms" if "floor_ms" in r else "–"   # no copy bandwidth measured (CPU)
            lines.append(f"| {_label(key, r)} | {r['batch']} | {_ttft(r)} | **{r['tpot_ms_p50']:.3f} ms** | "
                         f"{r['tpot_ms_p99']:.3f} | {tau} | {r['step_ms']:.3f} ms | {floor} | "
                         f"{base[r['batch']] / r['tpot_ms_p50']:.2f}x | {vs_hf} |")
    if hf:
        rows = [r for r in res["hf_eager"] if "tpot_ms_p50" in r]
        batches = " / ".join(str(r["batch"]) for r in rows)
        ttft = " / ".join(f"{r['ttft_ms_p50']:.3g}" for r in rows)
        tpot = " / ".join(f"{r['tpot_ms_p50']:.3g}" for r in rows)
        lines.append(f"| HF eager `generate` | {batches} | {ttft} ms | {tpot} ms | – | – | – | – | – | 1x |")
    return lines


def main(path: str) -> None:
    report = json.loads(Path(path).read_text())
    print("| engine | batch | TTFT p50 | TPOT p50 | TPOT p99 | τ | step | floor | vs target-only | vs HF eager |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(engine_rows(report)))
    print()
    for r in report["results"].get("speculative", []):
        if "draft_ms" in r:
            print(f"round split, batch {r['batch']}, {_label('speculative', r)}: draft {r['draft_ms']:.3f}, "
                  f"verify {r['verify_ms']:.3f}, accept + commit {r['commit_ms']:.3f} ms")
    if report.get("copy_gbps"):
        print(f"copy bandwidth {report['copy_gbps']:.0f} GB/s")
    if report.get("peak_memory_bytes"):
        print(f"peak memory {report['peak_memory_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
