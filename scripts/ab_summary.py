"""One line per A/B variant of ``scripts/device_run.sh``'s ``ab`` step: decode and round times.

    python scripts/ab_summary.py RUN_DIR/ab_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    print(f"{'variant':<40} {'batch':>5} {'TPOT':>8} {'step':>8} {'spec TPOT':>10} {'round':>8} {'tau':>5}")
    for path in paths:
        report = json.loads(Path(path).read_text())
        results = report["results"]
        for target in results["target_only"]:
            b = target["batch"]
            spec = [r for r in results.get("speculative", []) if r["batch"] == b]
            spec_txt = "".join(f" {s['tpot_ms_p50']:>10.3f} {s['step_ms']:>8.3f} {s['tau']:>5.2f}" for s in spec[:1])
            print(f"{Path(path).stem:<40} {b:>5} {target['tpot_ms_p50']:>8.3f} {target['step_ms']:>8.3f}{spec_txt}")


if __name__ == "__main__":
    main(sys.argv[1:])
