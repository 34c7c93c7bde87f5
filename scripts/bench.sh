#!/usr/bin/env bash
# Set up (once) and run the latency benchmark: `scripts/bench.sh [lfmspark bench options]`.
# Runs on `$PYTHON` if set, else `python3` (inside an active venv / conda env: that env's python).
# When that interpreter imports torch (e.g. a CUDA build on a GPU machine), the project is installed
# into its environment with torch pinned to the installed build, so pip cannot replace it (a nested
# venv would not see a torch that lives in a venv, and would install another). Otherwise .venv gets
# the CPU wheel torch==2.13.0 first, so a bare `torch` requirement never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
has_torch() { "$1" -c "import torch" 2>/dev/null; }
if ! has_torch "$PY"; then
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    PY=.venv/bin/python
    has_torch "$PY" || "$PY" -m pip install -q torch==2.13.0
fi
# (re)install unless lfmspark already resolves to this checkout (found, not imported: no torch load)
if ! "$PY" -c 'import importlib.util as u, os, sys; s = u.find_spec("lfmspark")
sys.exit(not (s and s.origin and os.path.realpath(s.origin).startswith(sys.argv[1] + os.sep)))' "$(pwd -P)"; then
    pin=$(mktemp) && trap 'rm -f "$pin"' EXIT
    # a torch that pip cannot see (no package metadata) cannot be pinned: then no dependencies at all
    deps=(-c "$pin")
    "$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$pin" 2>/dev/null \
        || deps=(--no-deps)
    "$PY" -m pip install -q "${deps[@]}" -e .
    rm -f "$pin"
fi
"$PY" - "$@" <<'EOF'
import sys, torch
args = " ".join(sys.argv[1:]).replace("--device=", "--device ").split()
device = args[args.index("--device") + 1] if "--device" in args[:-1] else "cuda" if torch.cuda.is_available() else "cpu"
name = f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") and torch.cuda.is_available() else ""
print(f"bench.sh: python {sys.executable}, torch {torch.__version__}, device {device}{name}")
EOF
exec "$PY" -m lfmspark.tools.cli bench "$@"
