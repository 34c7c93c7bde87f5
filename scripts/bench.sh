#!/usr/bin/env bash
# Set up (once) and run the latency benchmark: `scripts/bench.sh [lfmspark bench options]`.
# A torch already installed system-wide (e.g. a CUDA build on a GPU machine) is reused; otherwise
# the CPU wheel torch==2.13.0 is installed first, so a bare `torch` requirement never pulls a
# multi-GB CUDA build by accident.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/lfmspark ]; then
    python3 -m venv --system-site-packages .venv
    . .venv/bin/activate
    python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
    python -m pip install -q -e ".[test]"
else
    . .venv/bin/activate
fi
exec lfmspark bench "$@"
