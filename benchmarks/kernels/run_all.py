"""Run every kernel microbenchmark once and write one JSON report (GPU only).

    python benchmarks/kernels/run_all.py --json kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import argmax_walk  # noqa: E402
import cache_attention  # noqa: E402
import kv_norm_rope_write  # noqa: E402
import moe  # noqa: E402
import short_conv  # noqa: E402
import skinny_linear  # noqa: E402
from common import copy_bandwidth_gbps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all rows here")
    args = parser.parse_args()
    from tabulate import tabulate

    copy = copy_bandwidth_gbps()
    report = {"copy_gbps": copy, "rows": []}
    for module in (short_conv, kv_norm_rope_write, cache_attention, moe, skinny_linear, argmax_walk):
        rows = module.run(copy)
        report["rows"] += rows
        print(tabulate(rows, headers="keys"), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"copy bandwidth: {copy:.0f} GB/s")


if __name__ == "__main__":
    main()
