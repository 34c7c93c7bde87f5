#!/usr/bin/env bash
# The device-machine job: install, engine benchmarks (with per-kernel profiles), GPU tests, kernel
# microbenchmarks. Each step has its own time limit so one slow step cannot starve the rest.
#   STEPS="bench12 tests kernels bench8" BATCH_SIZES=1,4,16 bash scripts/device_run.sh
#   STEPS="servebench sampling" bash scripts/device_run.sh   # serving and sampling figures
#   STEPS=warmup bash scripts/device_run.sh        # warm-up at every default size, cold then warm, and TPOT after
#   STEPS=specrows bash scripts/device_run.sh      # TPOT per batch size: scheduled widths against the whole block
#   STEPS=multiturn bash scripts/device_run.sh     # multi-turn chat TTFT with the prefix cache on and off
#   STEPS=exact bash scripts/device_run.sh         # exact mode: GPU identity tests, identity rates and cost
#   STEPS=fp8 bash scripts/device_run.sh           # fp8 weights against the model dtype: TPOT, target-only and speculative
#   STEPS=tests TEST_PATHS=tests/serve bash scripts/device_run.sh   # the server's tests (carry .whl and .whl_ray)
# Two code versions are compared by running the same steps from each checkout in one call, each installing
# itself: `(cd OTHER && RESULTS=other PACK_CACHES=0 bash scripts/device_run.sh); bash scripts/device_run.sh`.
# The device returns at most 8 files, so logs and JSON are packed into $OUT/results.tgz (after each step; RESULTS names it otherwise); Inductor's
# cache is packed into $OUT/inductor_cache.txz (the custom ops' Triton kernels into triton_cache.txz) and, when a
# later call carries them back in .carry/, unpacked first (a warm-cache warm-up).
set -u
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"bench12 tests kernels bench8"}
RUN=$OUT/run; mkdir -p $RUN
export LFMSPARK_CACHE_DIR=/tmp/lfmspark_inductor
# explicit, in case the image sets one (which would win, graphs/compile.py)
export TORCHINDUCTOR_CACHE_DIR=$LFMSPARK_CACHE_DIR
mkdir -p $LFMSPARK_CACHE_DIR
# the custom ops' Triton kernels travel with Inductor's (the tests step keeps its many shapes out of it)
export TRITON_CACHE_DIR=$LFMSPARK_CACHE_DIR/triton_ops
for f in .carry/inductor_cache.t?z .carry/triton_cache.t?z; do  # each file back must stay under 16 MiB: two, xz
  [ -f $f ] && tar xf $f -C $LFMSPARK_CACHE_DIR && echo "$f restored"
done
python3 -m pip install -q --no-deps --no-build-isolation -e . > $RUN/install.log 2>&1 || { cat $RUN/install.log; exit 1; }
# the serve extra and the server tests' client, from carried wheels (the device has no network): pip download
# fastapi uvicorn prometheus-client httpx openai --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d .whl
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus-client httpx openai > $RUN/pip_serve.log 2>&1 \
    || tail -5 $RUN/pip_serve.log
fi
# Ray Serve for the replica tests, from the wheels scripts/ray_carry.sh builds
if [ -d .whl_ray ]; then
  python3 -m pip install -q --no-index --no-deps .whl_ray/*.whl > $RUN/pip_ray.log 2>&1 || tail -5 $RUN/pip_ray.log
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $RUN/gpu.txt 2>&1
IMPOSED_ARGS="--imposed-acceptance 0.9 --imposed-acceptance 0.8"
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)   # gpu-marked tests plus the op tests, which run natively on CUDA; at the time limit pytest
             # gets SIGINT, so it still prints the failures and counts of what ran; -v names each result as it
             # comes (a limit that falls in xdist's worker teardown loses the summary)
      TRITON_CACHE_DIR=/tmp/triton_tests timeout -s INT -k 30 ${T_TESTS:-240} python3 -m pytest -v -p no:cacheprovider -n ${TEST_PROCS:-6} -rfs --tb=short -p no:logging \
        ${TEST_PATHS:-tests/ops tests/models tests/graphs/test_graphs_gpu.py} 2>&1 | tee $RUN/gpu_tests.log | grep -v " PASSED " | tail -15 ;;
    walk)    # the Markov walk's launch-config sweep (WALK_ARGS=--persistent-sweep: the persistent walk's)
      timeout ${T_WALK:-120} python3 benchmarks/kernels/argmax_walk.py ${WALK_ARGS:---sweep} --batches ${WALK_BATCHES:-1} --json $RUN/walk.json 2>&1 \
        | tee $RUN/walk.log | head -${WALK_LINES:-24} ;;
    kernels)
      timeout ${T_KERNELS:-150} python3 benchmarks/kernels/run_all.py --json $RUN/kernels.json > $RUN/kernels.log 2>&1
      tail -40 $RUN/kernels.log ;;
    skinny)
      timeout ${T_SKINNY:-60} python3 benchmarks/kernels/skinny_linear.py ${SKINNY_ARGS:-} --json $RUN/skinny.json 2>&1 \
        | tee $RUN/skinny.log | tail -${SKINNY_LINES:-32} ;;
    fusednorm)
      timeout ${T_FUSEDNORM:-90} python3 benchmarks/kernels/add_rmsnorm_gemv.py ${FUSEDNORM_ARGS:-} --json $RUN/fused_norm.json \
        2>&1 | tee $RUN/fused_norm.log | tail -${FUSEDNORM_LINES:-30} ;;
    bench12)
      timeout ${T_BENCH12:-300} lfmspark bench --preset lfm2.5-1.2b --batch-sizes ${BATCH_SIZES:-1} --runs 2 \
        $IMPOSED_ARGS ${BENCH_ARGS:-} --profile-dir $RUN/profile_1p2b --json $RUN/bench_1p2b.json 2>&1 \
        | tee $RUN/bench_1p2b.log | tail -25 ;;
    bench8)
      timeout ${T_BENCH8:-300} lfmspark bench --preset lfm2-8b-a1b --batch-sizes ${BATCH_SIZES:-1} --runs 2 \
        $IMPOSED_ARGS ${BENCH_ARGS:-} --profile-dir $RUN/profile_8b --json $RUN/bench_8b.json 2>&1 \
        | tee $RUN/bench_8b.log | tail -25 ;;
    ab)      # A/B of runtime switches: AB_VARIANTS="name:VAR=1;VAR2=0 name2:..." (";" between variables, so
             # a value may hold commas: "k:LFMSPARK_TUNE=gemv.block_k=1024,gemv.num_warps=8"; no HF; AB_ARGS, default
             # imposed 0.8: e.g. "--draft-preset none" times target-only decode alone); AB_PROFILE=1 also
             # writes each variant's per-kernel tables
      for variant in ${AB_VARIANTS:-base:LFMSPARK_PDL=0 pdl:LFMSPARK_PDL=1}; do
        name=${variant%%:*}; envs=${variant#*:}
        echo "--- $name ($envs)"
        env ${envs//;/ } timeout ${T_AB:-120} lfmspark bench --preset ${AB_PRESET:-lfm2.5-1.2b} \
          --batch-sizes ${BATCH_SIZES:-1} --runs 2 --no-hf --no-phase-split ${AB_ARGS:---imposed-acceptance 0.8} \
          ${AB_PROFILE:+--profile-dir $RUN/profile_ab_$name} \
          --json $RUN/ab_$name.json > $RUN/ab_$name.log 2>&1 || tail -20 $RUN/ab_$name.log
        grep -E "^lfmspark (target-only|DSpark)" $RUN/ab_$name.log
      done ;;
    servebench)  # the open-loop serving benchmark, target-only and speculative on one trace
                 # (SERVE_ARGS="--capacity-fraction 0.7": at 70% of each engine's measured capacity)
      timeout ${T_SERVEBENCH:-480} lfmspark bench serve --preset ${SERVE_PRESET:-lfm2.5-1.2b} --max-batch ${SERVE_BATCH:-64} \
        --cuda-graph-sizes ${SERVE_SIZES:-1,8,16,32,64} \
        --num-prompts ${SERVE_PROMPTS:-200} --request-rate ${SERVE_RATE:-20} --prompt-len 512 --output-len 128 \
        --imposed-acceptance 0.8 ${SERVE_ARGS:-} --json $RUN/serve_bench.json 2>&1 | tee $RUN/serve_bench.log | tail -60 ;;
    sampling)  # the sampling settings users run against greedy and target-only, with the kernels of a greedy and a
               # model-card batch per batch size (SAMPLING_ARGS: more flags of lfmspark bench sampling)
      timeout ${T_SAMPLING:-330} lfmspark bench sampling --preset ${SAMPLING_PRESET:-lfm2.5-1.2b} --imposed-acceptance 0.8 \
        --profile-dir $RUN/profile_sampling ${SAMPLING_ARGS:-} --json $RUN/sampling.json > $RUN/sampling.log 2>&1 \
        || tail -15 $RUN/sampling.log
      sed -n '/^engine /,$p' $RUN/sampling.log ;;
    fp8)  # fp8 weights against the model dtype in one call: TPOT per batch size, target-only and speculative, on
          # FP8_PRESETS (FP8_ARGS: more flags of lfmspark bench)
      for preset in ${FP8_PRESETS:-lfm2.5-1.2b lfm2-8b-a1b}; do
        for q in model fp8; do
          timeout ${T_FP8:-240} lfmspark bench --preset $preset --batch-sizes ${BATCH_SIZES:-1,8} --runs 2 --no-hf \
            --no-phase-split --imposed-acceptance 0.8 $([ $q = fp8 ] && echo --quantization fp8) ${FP8_ARGS:-} \
            --json $RUN/fp8_${preset}_$q.json > $RUN/fp8_${preset}_$q.log 2>&1 || tail -15 $RUN/fp8_${preset}_$q.log
          echo "--- $preset $q"; grep -iE "tpot|floor" $RUN/fp8_${preset}_$q.log | head -8
        done
      done ;;
    warmup)  # warm-up at every default size to WARMUP_MAX_BATCH, cold (a fresh cache dir) then warm (the same dir, a new
             # process), speculative and target-only, and the TPOT after it (the warm run: batch 1 only)
             # (WARMUP_KINDS / WARMUP_CACHES narrow the runs; WARMUP_ARGS: more flags of lfmspark bench warmup)
      for kind in ${WARMUP_KINDS:-speculative target-only}; do
        for cache in ${WARMUP_CACHES:-cold warm}; do
          echo "--- $kind $cache"
          [ $cache = cold ] && rm -rf /tmp/warmup_$kind
          LFMSPARK_CACHE_DIR=/tmp/warmup_$kind TORCHINDUCTOR_CACHE_DIR=/tmp/warmup_$kind timeout ${T_WARMUP:-240} \
            lfmspark bench warmup --preset ${WARMUP_PRESET:-lfm2.5-1.2b} --max-batch ${WARMUP_MAX_BATCH:-64} \
            $([ $kind = target-only ] && echo --draft-preset none || echo --imposed-acceptance 0.8) \
            $([ $cache = warm ] && echo --batch-sizes 1) ${WARMUP_ARGS:-} --json $RUN/warmup_${kind}_$cache.json \
            > $RUN/warmup_${kind}_$cache.log 2>&1 || tail -5 $RUN/warmup_${kind}_$cache.log
          sed -n '/^engine /,$p' $RUN/warmup_${kind}_$cache.log
          tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
        done
      done ;;
    specrows)  # TPOT per batch size, target-only and speculative at imposed rates, greedy, one cache dir: the width
               # scheduler's rounds against the whole block every round (SPEC_ROWS="kind:rate ...", SPEC_PRESET, SPEC_SIZES)
      for row in ${SPEC_ROWS:-target-only:0 speculative:0.8 speculative:0.5}; do
        kind=${row%%:*}; rate=${row#*:}; name=${SPEC_PRESET:-lfm2.5-1.2b}_${kind}_$rate
        echo "--- $name"
        LFMSPARK_CACHE_DIR=/tmp/specrows TORCHINDUCTOR_CACHE_DIR=/tmp/specrows timeout ${T_SPECROW:-150} \
          lfmspark bench warmup --preset ${SPEC_PRESET:-lfm2.5-1.2b} --greedy-only \
          $([ $kind = target-only ] && echo --draft-preset none || echo --imposed-acceptance $rate) \
          --batch-sizes ${SPEC_SIZES:-1,8,32,64,128} --cuda-graph-sizes ${SPEC_SIZES:-1,8,32,64,128} \
          --json $RUN/specrows_$name.json > $RUN/specrows_$name.log 2>&1 || tail -5 $RUN/specrows_$name.log
        sed -n '/^engine /,$p' $RUN/specrows_$name.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    exact)   # exact mode's GPU identity tests, then its identity rates and cost against the default mode per preset
             # (EXACT_PROMPTS, EXACT_PRESETS; EXACT_BENCH_PROMPTS: the benchmark's own prompt count; EXACT_TEST_ARGS:
             # e.g. -k to run some of the tests)
      LFMSPARK_EXACT_PROMPTS=${EXACT_PROMPTS:-200} timeout ${T_EXACT_TESTS:-300} python3 -m pytest -q -p no:cacheprovider \
        -rfs --tb=short -p no:logging ${EXACT_TEST_ARGS:-} tests/e2e/test_exact_mode_gpu.py 2>&1 | tee $RUN/exact_tests.log | tail -8
      for preset in ${EXACT_PRESETS:-lfm2.5-1.2b lfm2-8b-a1b}; do
        timeout ${T_EXACT:-300} lfmspark bench exact --preset $preset --imposed-acceptance 0.8 \
          --num-prompts ${EXACT_BENCH_PROMPTS:-${EXACT_PROMPTS:-200}} --json $RUN/exact_$preset.json > $RUN/exact_$preset.log 2>&1 \
          || tail -5 $RUN/exact_$preset.log
        sed -n '/^engine /,$p' $RUN/exact_$preset.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    moesweep)  # the MoE expert kernels' candidate tiles at decode and verify sizes, then their kernels' times
      timeout ${T_MOESWEEP:-200} python3 benchmarks/kernels/moe.py --sweep --sizes ${MOE_SIZES:-1 10} --budget ${MOE_BUDGET:-150} \
        --json $RUN/moe_sweep.json 2>&1 | tee $RUN/moe_sweep.log | tail -${MOESWEEP_LINES:-40} ;;
    multiturn)  # multi-turn chats, TTFT per turn with the prefix cache on and off (MULTITURN_ARGS: flags of
                # lfmspark bench multiturn; several runs separated by ";", logged as multiturn_<i>.log)
      IFS=";" read -ra runs <<< "${MULTITURN_ARGS:- }"
      for i in "${!runs[@]}"; do
        echo "--- ${runs[$i]}"
        timeout ${T_MULTITURN:-300} lfmspark bench multiturn --preset ${MULTITURN_PRESET:-lfm2.5-1.2b} --imposed-acceptance 0.8 \
          ${runs[$i]} --json $RUN/multiturn_$i.json > $RUN/multiturn_$i.log 2>&1 || tail -15 $RUN/multiturn_$i.log
        sed -n '/^ *turn /,$p' $RUN/multiturn_$i.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    prefill)  # the prefill figure: target-only, one PREFILL_LEN-token prompt (TFLOP/s against the matmul ceiling)
      timeout ${T_PREFILL:-150} lfmspark bench --preset ${PREFILL_PRESET:-lfm2-8b-a1b} --draft-preset none --batch-sizes 1 \
        --prompt-len ${PREFILL_LEN:-1024} --runs 1 --no-hf --no-phase-split --json $RUN/prefill.json 2>&1 \
        | tee $RUN/prefill.log | tail -${PREFILL_LINES:-25} ;;
    exactsweep)  # exact_linear's plan rules at the 1.2B / 8B shapes and M = 1, 8, 10, 80 (one plan for all M;
                 # EXACT_VARY: e.g. "row_programs num_stages", only those constants varied around the default)
      timeout ${T_EXACTSWEEP:-200} python3 benchmarks/kernels/exact_linear.py --sweep --budget ${EXACT_BUDGET:-150} \
        ${EXACT_VARY:+--vary $EXACT_VARY} --json $RUN/exact_sweep.json 2>&1 | tee $RUN/exact_sweep.log | tail -${EXACTSWEEP_LINES:-40} ;;
    moeprofile)  # device time of each kernel of the MoE op per call (MOE_SIZES tokens)
      timeout ${T_MOEPROFILE:-60} python3 benchmarks/kernels/moe.py --profile --sizes ${MOE_SIZES:-1 10} 2>&1 \
        | tee $RUN/moe_profile.log | tail -${MOEPROFILE_LINES:-20} ;;
    profiles)
      for f in $RUN/profile_*/*.txt; do echo "--- $f"; head -${PROFILE_LINES:-14} $f | cut -c1-110; done ;;
  esac
  tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run  # after every step: a call cut short still returns what ran
done
echo "=== done $(date +%T)"
tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run && rm -rf $RUN
if [ "${PACK_CACHES:-1}" = 1 ]; then  # PACK_CACHES=0: a call that runs this script several times packs once
  XZ_OPT=-T0 tar cJf $OUT/inductor_cache.txz -C $LFMSPARK_CACHE_DIR --exclude=./triton_ops . 2>/dev/null
  XZ_OPT=-T0 tar cJf $OUT/triton_cache.txz -C $LFMSPARK_CACHE_DIR ./triton_ops 2>/dev/null
fi
ls -la $OUT
