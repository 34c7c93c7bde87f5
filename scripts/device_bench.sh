#!/usr/bin/env bash
# One device call: install, benchmark LFM2.5-1.2B-shaped target + draft, keep logs and JSON in $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
timeout ${BENCH_TIMEOUT:-330} lfmspark bench --preset lfm2.5-1.2b --batch-sizes ${BATCH_SIZES:-1,4} --prompt-len 128 \
  --output-len 128 --runs 2 --imposed-acceptance 0.9 --no-phase-split --json $OUT/bench_1p2b.json 2>&1 | tee $OUT/bench.log
