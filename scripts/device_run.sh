#!/usr/bin/env bash
# The device-machine job (H200): install, GPU tests, kernel microbenchmarks, engine benchmarks.
# Logs and JSON go to $OUT; each step has its own time limit so one slow step cannot starve the rest.
#   STEPS="tests kernels bench12 bench8" bash scripts/device_run.sh
set -u
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests kernels bench12 bench8"}
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/gpu.txt 2>&1
for step in $STEPS; do
  case $step in
    tests)   # gpu-marked tests plus the op tests, which run natively on CUDA
      timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/ops tests/test_graphs_gpu.py 2>&1 \
        | tee $OUT/gpu_tests.log | tail -15 ;;
    kernels)
      timeout ${T_KERNELS:-120} python3 benchmarks/kernels/run_all.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
      tail -5 $OUT/kernels.log ;;
    bench12)
      timeout ${T_BENCH12:-420} lfmspark bench --preset lfm2.5-1.2b --batch-sizes ${BATCH_SIZES:-1,4,16} --runs 2 \
        --imposed-acceptance ${IMPOSED:-0.9} --json $OUT/bench_1p2b.json 2>&1 | tee $OUT/bench_1p2b.log | tail -20 ;;
    bench8)
      timeout ${T_BENCH8:-420} lfmspark bench --preset lfm2-8b-a1b --batch-sizes ${BATCH_SIZES:-1,4,16} --runs 2 \
        --imposed-acceptance ${IMPOSED:-0.9} --json $OUT/bench_8b.json 2>&1 | tee $OUT/bench_8b.log | tail -20 ;;
  esac
done
