#!/usr/bin/env bash
# The device-machine job (H200): install, engine benchmarks (with per-kernel profiles), GPU tests,
# kernel microbenchmarks. Each step has its own time limit so one slow step cannot starve the rest.
#   STEPS="bench12 tests kernels bench8" BATCH_SIZES=1,4,16 bash scripts/device_run.sh
#   STEPS="serve servebench sampling" bash scripts/device_run.sh     # serving and sampling figures (carry .whl)
#   STEPS="sampling_old sampling" bash scripts/device_run.sh           # the sampling probe, old tree (.devrun/old) vs this
#   OLD_TREE=".devrun/a .devrun/b" STEPS=sampling_old bash scripts/device_run.sh   # the probe on two carried trees
#   WARMUP_OLD_TREE=.devrun/old STEPS=warmup bash scripts/device_run.sh  # warm-up cold/warm at every size, TPOT vs an old tree
#   STEPS=multiturn bash scripts/device_run.sh     # multi-turn chat TTFT with the prefix cache on and off
#   STEPS=exact bash scripts/device_run.sh         # exact mode: identity tests, identity rates and cost
#   STEPS=serveray bash scripts/device_run.sh      # serve vs one Ray Serve replica (carry .whl_ray: scripts/ray_carry.sh)
#   STEPS=loop bash scripts/device_run.sh          # a step's host launch / GPU wait / collect, target-only vs width 1
# The device returns at most 8 files, so logs and JSON are packed into $OUT/results.tgz (after each step; RESULTS names it otherwise); Inductor's
# cache is packed into $OUT/inductor_cache.txz (the custom ops' Triton kernels into triton_cache.txz) and, when a
# later call carries them back in .carry/, unpacked first (a warm-cache warm-up).
set -u
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"bench12 tests kernels bench8"}
RUN=$OUT/run; mkdir -p $RUN
export LFMSPARK_CACHE_DIR=/tmp/lfmspark_inductor
# explicit, in case the image sets one (which would win, graphs/compile.py): Inductor's archive below came back
# empty in session 22 (cause not confirmed)
export TORCHINDUCTOR_CACHE_DIR=$LFMSPARK_CACHE_DIR
mkdir -p $LFMSPARK_CACHE_DIR
# the custom ops' Triton kernels travel with Inductor's (the tests step keeps its many shapes out of it)
export TRITON_CACHE_DIR=$LFMSPARK_CACHE_DIR/triton_ops
for f in .carry/inductor_cache.t?z .carry/triton_cache.t?z; do  # each file back must stay under 16 MiB: two, xz
  [ -f $f ] && tar xf $f -C $LFMSPARK_CACHE_DIR && echo "$f restored"
done
python3 -m pip install -q --no-deps --no-build-isolation -e . > $RUN/install.log 2>&1 || { cat $RUN/install.log; exit 1; }
# the serve extra and the server tests' client, from carried wheels (the device has no network): see the serve step
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus-client httpx openai > $RUN/pip_serve.log 2>&1 \
    || tail -5 $RUN/pip_serve.log
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $RUN/gpu.txt 2>&1
IMPOSED_ARGS="--imposed-acceptance 0.9 --imposed-acceptance 0.8"
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)   # gpu-marked tests plus the op tests, which run natively on CUDA; at the time limit pytest
             # gets SIGINT, so it still prints the failures and counts of what ran; -v names each result as it
             # comes (session 33: the limit fell in xdist's worker teardown, and the summary was lost)
      TRITON_CACHE_DIR=/tmp/triton_tests timeout -s INT -k 30 ${T_TESTS:-240} python3 -m pytest -v -p no:cacheprovider -n ${TEST_PROCS:-6} -rfs --tb=short -p no:logging \
        ${TEST_PATHS:-tests/ops tests/models tests/test_graphs_gpu.py} 2>&1 | tee $RUN/gpu_tests.log | grep -v " PASSED " | tail -15 ;;
    ttft)    # first- vs second-request prefill per shape, with the Triton kernels each compiled
      timeout ${T_TTFT:-200} python3 scripts/ttft_probe.py --preset ${TTFT_PRESET:-lfm2.5-1.2b} ${TTFT_ARGS:-} \
        --json $RUN/ttft.json 2>&1 | tee $RUN/ttft.log | grep -v "^      " | tail -40 ;;
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
      for variant in ${AB_VARIANTS:-"base:LFMSPARK_PDL=0 pdl:LFMSPARK_PDL=1"}; do
        name=${variant%%:*}; envs=${variant#*:}
        echo "--- $name ($envs)"
        env ${envs//;/ } timeout ${T_AB:-120} lfmspark bench --preset ${AB_PRESET:-lfm2.5-1.2b} \
          --batch-sizes ${BATCH_SIZES:-1} --runs 2 --no-hf --no-phase-split ${AB_ARGS:---imposed-acceptance 0.8} \
          ${AB_PROFILE:+--profile-dir $RUN/profile_ab_$name} \
          --json $RUN/ab_$name.json > $RUN/ab_$name.log 2>&1 || tail -20 $RUN/ab_$name.log
      done
      python3 scripts/ab_summary.py $RUN/ab_*.json | tee $RUN/ab_summary.txt ;;
    oldnew)  # the benchmark on another checkout (OLD_TREE, carried: e.g. `git archive COMMIT | tar x -C .devrun/old`)
             # and on this one, in one call: LFM2.5-1.2B batch 1 and 8, LFM2-8B-A1B batch 1, imposed 0.8, no HF;
             # each tree installed in turn, each with its own compile cache (OLDNEW_ARGS: more bench flags, e.g. --exact;
             # OLDNEW_TAG: a prefix for this comparison's files, so that two comparisons in one call keep theirs;
             # OLDNEW_IMPOSED="" for runs without a draft)
      for tree in ${OLD_TREE:-.devrun/old} .; do
        name=${OLDNEW_TAG:-}$([ "$tree" = . ] && echo new || echo old)
        python3 -m pip install -q --no-deps --no-build-isolation -e $tree > $RUN/install_$name.log 2>&1 || { tail $RUN/install_$name.log; continue; }
        for preset in ${OLDNEW_PRESETS:-lfm2.5-1.2b:1,8 lfm2-8b-a1b:1}; do
          p=${preset%%:*}; b=${preset#*:}
          echo "--- $name $p $b"
          (cd $tree && LFMSPARK_CACHE_DIR=/tmp/oldnew_$name TORCHINDUCTOR_CACHE_DIR=/tmp/oldnew_$name timeout ${T_OLDNEW:-240} \
            python3 -m lfmspark.tools.cli bench --preset $p --batch-sizes $b --runs 2 --no-hf --no-phase-split \
            ${OLDNEW_IMPOSED---imposed-acceptance 0.8} ${OLDNEW_ARGS:-} --json $RUN/oldnew_${name}_$p.json > $RUN/oldnew_${name}_$p.log 2>&1) \
            || tail -20 $RUN/oldnew_${name}_$p.log
        done
      done
      python3 -m pip install -q --no-deps --no-build-isolation -e . > $RUN/install.log 2>&1 || tail -5 $RUN/install.log
      python3 scripts/ab_summary.py $RUN/oldnew_${OLDNEW_TAG:-}*.json | tee $RUN/oldnew_${OLDNEW_TAG:-}summary.txt ;;
    serve)   # the server's figures (scripts/serve_probe.py); needs the serve extra's wheels carried in .whl/
             # (pip download fastapi uvicorn prometheus-client httpx --python-version 3.12 --only-binary=:all:
             #  --platform manylinux2014_x86_64 -d .whl): the device has no network
      timeout ${T_SERVE:-420} python3 scripts/serve_probe.py --preset ${SERVE_PRESET:-lfm2.5-1.2b} --json $RUN/serve_probe.json \
        --server-log $RUN/serve.log 2>&1 | tail -6 ;;
    serveray)  # issue 40's one-GPU figure: scripts/serve_probe.py against `lfmspark serve`, then against the same
               # server as one Ray Serve replica; needs the wheels of scripts/ray_carry.sh carried in .whl_ray/
      python3 -m pip install -q --no-index --no-deps .whl_ray/*.whl > $RUN/pip_ray.log 2>&1 || tail -5 $RUN/pip_ray.log
      for replicas in 0 1; do
        echo "--- replicas $replicas"
        timeout ${T_SERVERAY:-240} python3 scripts/serve_probe.py --preset ${SERVE_PRESET:-lfm2.5-1.2b} \
          --clients ${SERVERAY_CLIENTS:-8} --cuda-graph-sizes ${SERVERAY_SIZES:-1,8} $([ $replicas = 0 ] || echo --replicas $replicas) \
          --json $RUN/serveray_$replicas.json --server-log $RUN/serveray_$replicas.log 2>&1 | tail -4
      done ;;
    servebench)  # the open-loop serving benchmark, target-only and speculative on one trace
                 # (SERVE_ARGS="--capacity-fraction 0.7": at 70% of each engine's measured capacity)
      timeout ${T_SERVEBENCH:-480} lfmspark bench serve --preset ${SERVE_PRESET:-lfm2.5-1.2b} --max-batch ${SERVE_BATCH:-64} \
        --cuda-graph-sizes ${SERVE_SIZES:-1,8,16,32,64} \
        --num-prompts ${SERVE_PROMPTS:-200} --request-rate ${SERVE_RATE:-20} --prompt-len 512 --output-len 128 \
        --imposed-acceptance 0.8 ${SERVE_ARGS:-} --json $RUN/serve_bench.json 2>&1 | tee $RUN/serve_bench.log | tail -60 ;;
    sampling)  # model-card sampling against greedy and target-only (scripts/sampling_probe.py)
      timeout ${T_SAMPLING:-330} python3 scripts/sampling_probe.py ${SAMPLING_ARGS:---profile 30} > $RUN/sampling_probe_full.log 2>&1 \
        || tail -15 $RUN/sampling_probe_full.log
      grep -E "^(speculative|target-only|profile|  |\{)" $RUN/sampling_probe_full.log | tee $RUN/sampling_probe.log ;;
    sampling_old)  # scripts/sampling_probe.py on other checkouts (OLD_TREE: one or more carried trees, each installed
                   # for its probe alone; logs named after the tree's folder)
      for tree in ${OLD_TREE:-.devrun/old}; do
        name=$(basename $tree); echo "--- $tree"
        python3 -m pip install -q --no-deps --no-build-isolation -e $tree > $RUN/install_$name.log 2>&1 || tail -5 $RUN/install_$name.log
        (cd $tree && LFMSPARK_CACHE_DIR=/tmp/sampling_$name TORCHINDUCTOR_CACHE_DIR=/tmp/sampling_$name timeout ${T_SAMPLING:-330} \
          python3 scripts/sampling_probe.py ${SAMPLING_ARGS:-} > $RUN/sampling_probe_${name}_full.log 2>&1) \
          || tail -15 $RUN/sampling_probe_${name}_full.log
        grep -E "^(speculative|target-only|profile|  |\{)" $RUN/sampling_probe_${name}_full.log | tee $RUN/sampling_probe_$name.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done
      python3 -m pip install -q --no-deps --no-build-isolation -e . > $RUN/install.log 2>&1 || tail -5 $RUN/install.log ;;
    warmup)  # issue 35's warm-up figure: every default size to max_batch 64, cold (a fresh cache dir) then warm (the
             # same dir, a new process), speculative and target-only; then the per-size compile of a carried older
             # tree (WARMUP_OLD_TREE) at the TPOT sizes only, for the TPOT comparison in the same call
             # (WARMUP_KINDS / WARMUP_CACHES narrow the new runs; WARMUP_CACHES=none skips them)
      for kind in ${WARMUP_KINDS:-speculative target-only}; do
        for cache in ${WARMUP_CACHES:-cold warm}; do
          [ $cache = none ] && continue
          echo "--- new $kind $cache"
          LFMSPARK_CACHE_DIR=/tmp/warmup_$kind TORCHINDUCTOR_CACHE_DIR=/tmp/warmup_$kind timeout ${T_WARMUP:-240} \
            python3 scripts/warmup_probe.py --kind $kind ${WARMUP_ARGS:-} $([ $cache = warm ] && echo --tpot-sizes 1) \
            --json $RUN/warmup_new_${kind}_$cache.json > $RUN/warmup_new_${kind}_$cache.log 2>&1 || tail -5 $RUN/warmup_new_${kind}_$cache.log
          grep -E "^(speculative|target-only)" $RUN/warmup_new_${kind}_$cache.log
        done
      done
      tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      if [ -n "${WARMUP_OLD_TREE:-}" ]; then
        probe=$PWD/scripts/warmup_probe.py
        python3 -m pip install -q --no-deps --no-build-isolation -e $WARMUP_OLD_TREE > $RUN/install_old.log 2>&1 || tail -5 $RUN/install_old.log
        for kind in ${WARMUP_OLD_KINDS:-speculative target-only}; do
          echo "--- old $kind"
          (cd $WARMUP_OLD_TREE && LFMSPARK_CACHE_DIR=/tmp/warmup_old TORCHINDUCTOR_CACHE_DIR=/tmp/warmup_old timeout ${T_WARMUP:-240} \
            python3 $probe --kind $kind --greedy-only --batch-sizes 1,8,32,64 --json $RUN/warmup_old_$kind.json \
            > $RUN/warmup_old_$kind.log 2>&1) || tail -5 $RUN/warmup_old_$kind.log
          grep -E "^(speculative|target-only)" $RUN/warmup_old_$kind.log
        done
        python3 -m pip install -q --no-deps --no-build-isolation -e . > $RUN/install.log 2>&1 || tail -5 $RUN/install.log
      fi ;;
    specrows)  # issue 36's rows: TPOT per batch size, target-only and speculative at imposed rates, greedy, one
               # cache dir (SPEC_ROWS="kind:rate ...", SPEC_PRESET, SPEC_SIZES, SPEC_MAX_BATCH)
      for row in ${SPEC_ROWS:-target-only:0 speculative:0.8 speculative:0.5}; do
        kind=${row%%:*}; rate=${row#*:}; name=${SPEC_PRESET:-lfm2.5-1.2b}_${kind}_$rate
        echo "--- $name"
        LFMSPARK_CACHE_DIR=/tmp/specrows TORCHINDUCTOR_CACHE_DIR=/tmp/specrows timeout ${T_SPECROW:-150} \
          python3 scripts/warmup_probe.py --preset ${SPEC_PRESET:-lfm2.5-1.2b} --kind $kind --imposed-acceptance $rate \
          --greedy-only --max-batch ${SPEC_MAX_BATCH:-128} --batch-sizes ${SPEC_SIZES:-1,8,32,64,128} \
          --tpot-sizes ${SPEC_SIZES:-1,8,32,64,128} --json $RUN/specrows_$name.json > $RUN/specrows_$name.log 2>&1 \
          || tail -5 $RUN/specrows_$name.log
        grep -E "^(speculative|target-only)" $RUN/specrows_$name.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    exact)   # issue 39: exact mode's GPU identity tests, then its identity rates and cost against the default
             # mode per preset (scripts/exact_probe.py; EXACT_PROMPTS, EXACT_PRESETS; EXACT_PROBE_PROMPTS: the
             # probe's own prompt count; EXACT_TEST_ARGS: e.g. -k to run some of the tests)
      LFMSPARK_EXACT_PROMPTS=${EXACT_PROMPTS:-200} timeout ${T_EXACT_TESTS:-300} python3 -m pytest -q -p no:cacheprovider \
        -rfs --tb=short -p no:logging ${EXACT_TEST_ARGS:-} tests/test_exact_mode_gpu.py 2>&1 | tee $RUN/exact_tests.log | tail -8
      for preset in ${EXACT_PRESETS:-lfm2.5-1.2b lfm2-8b-a1b}; do
        timeout ${T_EXACT:-300} python3 scripts/exact_probe.py --preset $preset --prompts ${EXACT_PROBE_PROMPTS:-${EXACT_PROMPTS:-200}} \
          --json $RUN/exact_$preset.json > $RUN/exact_$preset.log 2>&1 || tail -5 $RUN/exact_$preset.log
        grep -E "^(default|exact) " $RUN/exact_$preset.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    loop)    # where a generation step's time goes (host launch, GPU wait, host collect, kernels), target-only vs
             # speculative held at LOOP_WIDTHS, at LOOP_BATCH (scripts/loop_probe.py)
      timeout ${T_LOOP:-240} python3 scripts/loop_probe.py --preset ${LOOP_PRESET:-lfm2.5-1.2b} --batch ${LOOP_BATCH:-128} \
        --widths ${LOOP_WIDTHS:-1} --json $RUN/loop.json 2>&1 | tee $RUN/loop.log | grep -v "^USDT" | tail -32 ;;
    moesweep)  # issue 38: the MoE expert kernels' candidate tiles at decode and verify sizes, then their kernels' times
      timeout ${T_MOESWEEP:-200} python3 benchmarks/kernels/moe.py --sweep --sizes ${MOE_SIZES:-1 10} --budget ${MOE_BUDGET:-150} \
        --json $RUN/moe_sweep.json 2>&1 | tee $RUN/moe_sweep.log | tail -${MOESWEEP_LINES:-40} ;;
    multiturn)  # issue 37's figure: multi-turn chats, TTFT per turn with the prefix cache on and off
                # (MULTITURN_ARGS: the probe's flags; several runs separated by ";", logged as multiturn_<i>.log)
      IFS=";" read -ra runs <<< "${MULTITURN_ARGS:- }"
      for i in "${!runs[@]}"; do
        echo "--- ${runs[$i]}"
        timeout ${T_MULTITURN:-300} python3 scripts/multiturn_probe.py ${runs[$i]} > $RUN/multiturn_$i.log 2>&1 \
          || tail -15 $RUN/multiturn_$i.log
        grep -E "^turn" $RUN/multiturn_$i.log
        tar czf $OUT/${RESULTS:-results}.tgz -C $OUT run
      done ;;
    prefill)  # issue 38's prefill figure: target-only, one PREFILL_LEN-token prompt (TFLOP/s against the matmul ceiling)
      timeout ${T_PREFILL:-150} lfmspark bench --preset ${PREFILL_PRESET:-lfm2-8b-a1b} --draft-preset none --batch-sizes 1 \
        --prompt-len ${PREFILL_LEN:-1024} --runs 1 --no-hf --no-phase-split --json $RUN/prefill.json 2>&1 \
        | tee $RUN/prefill.log | tail -${PREFILL_LINES:-25} ;;
    exactsweep)  # issue 39: exact_linear's plan rules at the 1.2B / 8B shapes and M = 1, 8, 10, 80 (one plan for all M;
                 # EXACT_VARY: e.g. "row_programs num_stages", only those constants varied around the default)
      timeout ${T_EXACTSWEEP:-200} python3 benchmarks/kernels/exact_linear.py --sweep --budget ${EXACT_BUDGET:-150} \
        ${EXACT_VARY:+--vary $EXACT_VARY} --json $RUN/exact_sweep.json 2>&1 | tee $RUN/exact_sweep.log | tail -${EXACTSWEEP_LINES:-40} ;;
    moeprofile)  # issue 38: device time of each kernel of the MoE op per call (MOE_SIZES tokens)
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
