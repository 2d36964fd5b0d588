#!/usr/bin/env bash
# gpu-check.sh - everything a GPU machine should prove, in one call: build from scratch, run the
# tests at 1, 2 and 4 ranks, run the benchmark, print a short summary last.
#
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default: $OUT, else ./out)
# Env:   TEST_ARGS (e.g. "--filter layout"; "--shard 0/2", then "--shard 1/2" in a second call:
#        the whole suite at 1, 2 and 4 ranks takes longer than one 600 s device call, measured
#        at 1d8e399 on 4x H200), BENCH_ARGS (extra epx_bench flags), SKIP_BENCH=1,
#        SKIP_TESTS=1, SKIP_CLEAN=1 (keep earlier build outputs), RANKS (default "1,2,4" for the tests, "2,4" for the soak),
#        TEST_FILTERS="a b": instead of one whole run, one epx_test run per --filter word
#        (without it the whole run is followed by the prefill phases' SM-send path at 2 ranks,
#        EPX_MOE_PHASES_COPY_ENGINE=0),
#        SANITIZE="memcheck synccheck racecheck": compute-sanitizer (each tool, every rank
#        process; NCCL's own probing API errors not reported) over epx_test $SANITIZE_ARGS
#        (default "--ranks 2 --filter trace_dispatch_combine"), its ERROR SUMMARY in the summary;
#        SANITIZE_FILTERS="a b": one run per tool and --filter word instead (SANITIZE_RANKS,
#        default 2), SANITIZE_DEVICES=0,1: the GPUs they see,
#        SOAK_ITERS=N: after the tests, build/bin/epx_soak --iters N at each rank count of RANKS
#        (docs/testing.md, "Soak"; SOAK_ARGS: extra flags, SOAK_TIMEOUT: seconds per run,
#        default 600 + N/20; SOAK_RANKS: rank counts, default RANKS; SOAK_DEVICES: the GPUs),
#        PARALLEL=1: the sanitizers and the soak at once (give them disjoint *_DEVICES),
#        PYTHON_TESTS=1: pip-install the Python package (the README's command) into python3 and
#        run pytest python/tests (GPU tests included; PYTEST_ARGS, e.g. "-k native");
#        DEEPEP=DIR: a DeepEP V1 source tree (carried, e.g. deepep-v1): DeepEP's own
#        test_intranode.py / test_low_latency.py on epx.deep_ep (scripts/run-deepep-tests.sh),
#        and with DEEPEP_BUILD=1 also DeepEP V1 built there, unmodified, for the comparison;
#        MOE_BENCH=1: build/bin/epx_moe_bench (the decode MoE layer vs its parts, every visible
#        GPU; MOE_BENCH_ARGS, default "--tokens 8,128"; its table in the summary), then
#        build/bin/epx_moe_prefill_bench (the prefill MoE layer vs its parts and plain cuBLAS,
#        every visible GPU; MOE_PREFILL_BENCH_ARGS, default "--tokens 4096 --gemm-lanes 1,4 --grouped --timeline
#        OUT/prefill-timeline", the timelines tarred to prefill-timeline.tgz; its table too);
#        ONE_GPU_BENCH=1: the one-GPU benchmarks too (epx_experts_bench, epx_layout_bench,
#        epx_moe_gemm_bench; their last lines in the summary; they need one GPU, not a group);
#        EXPAND_SWEEP="EPX_EXPAND_PUBLISH_BATCH=1 EPX_EXPAND_FAN_OUT_BLOCKS=48,EPX_X=1": after the
#        bench, the normal rows once per word (its comma-separated VAR=value settings in the
#        environment), their expert-major rows in the summary (docs/moe.md, "Fan-out DURING");
#        EXPERTS_COMPARE=1 (with BASELINE): epx_experts_bench of DIR and of this tree alternately
#        (EXPERTS_COMPARE_ARGS, default "--dtype fp8 --tokens 1,8,32,128,512 --iters 20"), side
#        by side in the summary;
#        GEMM_COMPARE=1 (with BASELINE): epx_moe_gemm_bench (the prefill layer's grouped FP8 GEMM,
#        one GPU) of DIR and of this tree alternately (GEMM_COMPARE_ARGS, default "--shape all
#        --ranks 2,4 --chunks 1 --iters 8 --tile 0 --tile-w 0 --counts routed"), each point's
#        kernel cycles side by side with new / base (compare cycles, not time: the clock follows
#        the power; docs/bench.md);
#        BASELINE=DIR: a source tree of another commit (e.g. `git archive <rev> | tar -x -C DIR`);
#        its benchmark is built beside this one and both run COMPARE_ROUNDS times (default 2)
#        alternately with COMPARE_ARGS (default: the README's benchmark), then
#        scripts/bench-compare.py prints the rows side by side with the run-to-run spread (event
#        times, then kernel times); not with SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-out}}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 # NVLink multicast stays off on shared machines
# The device copy of the tree may have no .git: the caller can pass EPX_COMMIT.
commit=${EPX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -z "${EPX_COMMIT:-}" ] && [ -n "$(git status --porcelain 2>/dev/null)" ] && commit="$commit+dirty"
export EPX_COMMIT="$commit"

{
  echo "commit: $commit   date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1 | head -12
} | tee "$out/machine.txt"

t0=$(date +%s)
[ -z "${SKIP_CLEAN:-}" ] && make clean >/dev/null
targets="lib build/bin/epx_test build/bin/epx_bench build/bin/epx_soak build/bin/epx_experts_bench \
  build/bin/epx_layout_bench build/bin/epx_moe_bench build/bin/epx_moe_prefill_bench \
  build/bin/epx_moe_gemm_bench"
baseline_pid=
if [ -n "${BASELINE:-}" ]; then
  base_targets=
  [ -z "${SKIP_BENCH:-}" ] && base_targets="build/bin/epx_bench"
  [ -n "${EXPERTS_COMPARE:-}" ] && base_targets="$base_targets build/bin/epx_experts_bench"
  [ -n "${GEMM_COMPARE:-}" ] && base_targets="$base_targets build/bin/epx_moe_gemm_bench"
  if [ -n "$base_targets" ]; then
    (make -C "$BASELINE" -j"$(nproc)" $base_targets >"$out/baseline-build.log" 2>&1) &
    baseline_pid=$!
  else
    echo "BASELINE=$BASELINE: nothing to compare (SKIP_BENCH=1, no EXPERTS_COMPARE=1 or GEMM_COMPARE=1)"
  fi
fi
if [ -n "${EXPERTS_COMPARE:-}${GEMM_COMPARE:-}" ] && [ -z "${BASELINE:-}" ]; then
  echo "EXPERTS_COMPARE=1 and GEMM_COMPARE=1 need BASELINE=DIR: not compared"
fi
if ! make -j"$(nproc)" $targets WGMMA_SERIALIZED=error >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
if [ -n "$baseline_pid" ] && ! wait "$baseline_pid"; then
  tail -20 "$out/baseline-build.log"
  echo "BASELINE BUILD FAILED"
  exit 1
fi
build_s=$(($(date +%s) - t0))
grep -iE "warning" "$out/build.log" | head -20

test_line="(not run)"
if [ -z "${SKIP_TESTS:-}" ]; then
  test_line=
  for filter in ${TEST_FILTERS:-ALL}; do
    log="$out/tests.log"
    args=()
    [ "$filter" != ALL ] && log="$out/tests-$filter.log" && args=(--filter "$filter")
    timeout 900 build/bin/epx_test --ranks "${RANKS:-1,2,4}" "${args[@]}" ${TEST_ARGS:-} >"$log" 2>&1
    test_rc=$?
    grep -E "^\[ (FAIL|SKIP) \]|FAILED|rank [0-9]+:" "$log" | head -60
    last=$(tail -1 "$log")
    [ $test_rc -eq 124 ] && last="TIMED OUT after 900 s; $last"
    [ "$filter" != ALL ] && last="$filter: $last"
    test_line="$test_line${test_line:+; }$last"
  done
  # The prefill layer's phases send on SMs only with EPX_MOE_PHASES_COPY_ENGINE=0 (the copy
  # engines are the default the whole suite ran with): that path's refusal and two phased cases.
  if [ -z "${TEST_FILTERS:-}" ]; then
    log="$out/tests-phases-sm.log"
    : >"$log"
    rcs=
    for f in moe_prefill_phases moe_prefill_matches; do
      EPX_MOE_PHASES_COPY_ENGINE=0 EPX_TEST_CASES=fp8_egrp_holes,fp8_holes timeout 300 \
        build/bin/epx_test --ranks 2 --filter "$f" ${TEST_ARGS:-} >>"$log" 2>&1
      rcs="$rcs $?"
    done
    grep -E "^\[ (FAIL|SKIP) \]|FAILED" "$log" | head -20
    test_line="$test_line; phases on SMs (2 ranks): $(grep -cE '^\[ PASS \]' "$log") passed, $(grep -cE '^\[ FAIL \]' "$log") failed, $(grep -cE '^\[ SKIP \]' "$log") skipped (exit codes$rcs)"
  fi
fi

# Sanitizers and soak: each writes its summary lines to a file; with PARALLEL=1 they run at
# once, each on its own GPUs (SANITIZE_DEVICES, SOAK_DEVICES), so one call holds both.
run_sanitizers() {
  local sanitizer tool filter log args rc
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SANITIZE:-}; do
    for filter in ${SANITIZE_FILTERS:-DEFAULT}; do
      log="$out/sanitize-$tool.log"
      args=(${SANITIZE_ARGS:---ranks 2 --filter trace_dispatch_combine})
      if [ "$filter" != DEFAULT ]; then
        log="$out/sanitize-$tool-$filter.log"
        args=(--ranks "${SANITIZE_RANKS:-2}" --filter "$filter")
      fi
      env ${SANITIZE_DEVICES:+CUDA_VISIBLE_DEVICES=$SANITIZE_DEVICES} \
        timeout "${SANITIZE_TIMEOUT:-300}" "$sanitizer" --tool "$tool" --target-processes all \
        --report-api-errors no build/bin/epx_test "${args[@]}" >"$log" 2>&1
      rc=$?
      echo "$tool ${args[*]} (exit $rc): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | sort | uniq -c |
        tr -s ' ' | tr '\n' ';') $(grep -E "^[0-9]+ passed" "$log" | tail -1)"
    done
  done >"$out/sanitize-summary.txt"
}

run_soaks() {
  local ranks log rc last limit=${SOAK_TIMEOUT:-$((600 + ${SOAK_ITERS:-0} / 20))}
  for ranks in $(echo "${SOAK_RANKS:-${RANKS:-2,4}}" | tr ',' ' '); do
    log="$out/soak-$ranks.log"
    env ${SOAK_DEVICES:+CUDA_VISIBLE_DEVICES=$SOAK_DEVICES} \
      timeout "$limit" build/bin/epx_soak --iters "$SOAK_ITERS" --ranks "$ranks" ${SOAK_ARGS:-} \
      >"$log" 2>&1
    rc=$?
    grep -E "WRONG|unexpected async error|epx_soak" "$log" | head -20 >&2
    last=$(grep -E "^soak: " "$log" | tail -2)
    [ $rc -eq 124 ] && last="$last
soak: TIMED OUT after $limit s"
    echo "--- soak at $ranks ranks (exit $rc, soak-$ranks.log):
$last"
  done >"$out/soak-summary.txt"
}

rm -f "$out/sanitize-summary.txt" "$out/soak-summary.txt"
if [ -n "${PARALLEL:-}" ]; then
  [ -n "${SANITIZE:-}" ] && run_sanitizers &
  [ -n "${SOAK_ITERS:-}" ] && run_soaks &
  wait
else
  [ -n "${SANITIZE:-}" ] && run_sanitizers
  [ -n "${SOAK_ITERS:-}" ] && run_soaks
fi
sanitize_lines=
[ -f "$out/sanitize-summary.txt" ] && sanitize_lines="
$(cat "$out/sanitize-summary.txt")"
soak_lines=
[ -f "$out/soak-summary.txt" ] && soak_lines="
$(cat "$out/soak-summary.txt")"

one_gpu_lines=
if [ -n "${ONE_GPU_BENCH:-}" ]; then
  timeout 300 build/bin/epx_experts_bench --iters 20 >"$out/experts-bench.log" 2>&1
  timeout 120 build/bin/epx_layout_bench >"$out/layout-bench.log" 2>&1
  timeout 300 build/bin/epx_moe_gemm_bench >"$out/moe-gemm-bench.log" 2>&1
  one_gpu_lines="$(tail -22 "$out/experts-bench.log")
$(tail -16 "$out/layout-bench.log")
$(tail -18 "$out/moe-gemm-bench.log")"
fi

moe_lines=
if [ -n "${MOE_BENCH:-}" ]; then
  timeout 400 build/bin/epx_moe_bench ${MOE_BENCH_ARGS:---tokens 8,128} >"$out/moe-bench.log" 2>&1
  moe_lines="$(tail -20 "$out/moe-bench.log")"
  # one call of each variant per point under CUPTI: kernel timelines (CSV) and overlap lines
  mkdir -p "$out/prefill-timeline"
  timeout 900 build/bin/epx_moe_prefill_bench \
    ${MOE_PREFILL_BENCH_ARGS:---tokens 4096 --gemm-lanes 1,4 --grouped --timeline "$out/prefill-timeline"} \
    >"$out/moe-prefill-bench.log" 2>&1
  prefill_rc=$?
  (cd "$out" && tar czf prefill-timeline.tgz prefill-timeline && rm -rf prefill-timeline)
  moe_lines="$moe_lines
MoE layer at prefill (epx_moe_prefill_bench, exit $prefill_rc):
$(grep -v '^# timeline' "$out/moe-prefill-bench.log" | tail -20)
$(grep '^# timeline' "$out/moe-prefill-bench.log")"
fi

py_line="(not run)"
if [ -n "${PYTHON_TESTS:-}" ]; then
  if python3 -m pip install --no-build-isolation --no-deps --force-reinstall -q . \
    >"$out/pip.log" 2>&1; then
    timeout "${PY_TIMEOUT:-900}" python3 -m pytest python/tests -q -rs ${PYTEST_ARGS:-} \
      >"$out/pytest.log" 2>&1
    py_line="$(tail -1 "$out/pytest.log")"
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -30
  else
    tail -20 "$out/pip.log"
    py_line="PIP INSTALL FAILED (pip.log)"
  fi
fi

deepep_line=
if [ -n "${DEEPEP:-}" ]; then
  export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  OUT="$out/deepep-epx" TIMEOUT="${DEEPEP_TIMEOUT:-600}" scripts/run-deepep-tests.sh "$DEEPEP" \
    >"$out/deepep-epx.log" 2>&1
  deepep_line="deepep tests on epx: exit $?"
  if [ -n "${DEEPEP_BUILD:-}" ]; then
    if (cd "$DEEPEP" && CPATH=/usr/local/cuda/include/cccl python3 setup.py build_ext --inplace) \
      >"$out/deepep-build.log" 2>&1; then
      OUT="$out/deepep-v1" TIMEOUT="${DEEPEP_TIMEOUT:-600}" scripts/run-deepep-tests.sh --deepep \
        "$DEEPEP" >"$out/deepep-v1.log" 2>&1
      deepep_line="$deepep_line; on DeepEP V1: exit $?"
    else
      deepep_line="$deepep_line; DeepEP V1 BUILD FAILED (deepep-build.log)"
    fi
  fi
fi

bench_rc="(not run)"
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 600 build/bin/epx_bench --json "$out/bench.json" ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  bench_rc=$?
fi

# DURING's knobs (docs/env.md): the expert-major rows once per setting, each its own run of the
# normal rows at the default SM budget (docs/moe.md, "Fan-out DURING")
sweep_lines=
for setting in ${EXPAND_SWEEP:-}; do
  log="$out/bench-expand-$(echo "$setting" | tr ',=' '__').log"
  env $(echo "$setting" | tr ',' ' ') timeout 300 build/bin/epx_bench --rows normal --sms 24 >"$log" 2>&1
  sweep_lines="$sweep_lines
$setting (exit $?):
$(grep -E '^op|^epx (dispatch|combine) (expand|bf16)|^epx combine ' "$log")"
done

# The experts' GEMMs against the baseline's: alternating runs, one row per shape, dtype and T.
experts_compare_lines=
if [ -n "${BASELINE:-}" ] && [ -n "${EXPERTS_COMPARE:-}" ]; then
  rm -f "$out"/experts-compare-*.log # a reused OUT keeps no earlier run's rounds
  for round in $(seq 1 "${COMPARE_ROUNDS:-2}"); do
    for side in base new; do
      bin=build/bin/epx_experts_bench
      [ $side = base ] && bin="$BASELINE/build/bin/epx_experts_bench"
      log="$out/experts-compare-$side-$round.log"
      timeout 300 "$bin" ${EXPERTS_COMPARE_ARGS:---dtype fp8 --tokens 1,8,32,128,512 --iters 20} \
        >"$log" 2>&1 || echo "experts ffn: $side round $round exited with $?" >>"$log"
    done
  done
  # "experts ffn <shape> <dtype> T <T> ... median <us> us ... <share> of hbm": median us (share)
  experts_compare_lines=$(
    for f in "$out"/experts-compare-*-*.log; do
      side=$(basename "$f" .log | cut -d- -f3,4)
      grep '^experts ffn' "$f" | awk -v s="$side" '{print $3, $4, $6, s, $14" ("$(NF-2)")"}'
    done | sort -k1,1 -k2,2 -k3,3n -k4,4V | awk '{k=$1" "$2" T="$3
      if (k != p) { if (p != "") print line; line = k; p = k }
      line = line"  "$4" "$5" "$6} END { if (p != "") print line }'
    grep -h "exited with" "$out"/experts-compare-*-*.log
  )
fi

# The grouped FP8 GEMM against the baseline's: alternating runs, one row per point (shape,
# projection, ranks, chunks, tile width and height): each run's kcyc, then the mean ratio.
gemm_compare_lines=
if [ -n "${BASELINE:-}" ] && [ -n "${GEMM_COMPARE:-}" ]; then
  rm -f "$out"/gemm-compare-*.log
  for round in $(seq 1 "${COMPARE_ROUNDS:-2}"); do
    for side in base new; do
      bin=build/bin/epx_moe_gemm_bench
      [ $side = base ] && bin="$BASELINE/build/bin/epx_moe_gemm_bench"
      log="$out/gemm-compare-$side-$round.log"
      CUDA_VISIBLE_DEVICES=${GEMM_COMPARE_DEVICE:-0} timeout 300 "$bin" \
        ${GEMM_COMPARE_ARGS:---shape all --ranks 2,4 --chunks 1 --iters 8 --tile 0 --tile-w 0 --counts routed} \
        >"$log" 2>&1 || echo "moe gemm: $side round $round exited with $?" >>"$log"
    done
  done
  # rows "<shape> <gu|dn> R<r> c<c> n k L S tile tw us min GHz kcyc ...": field 14 is kcyc
  gemm_compare_lines=$(
    for f in "$out"/gemm-compare-*-*.log; do
      side=$(basename "$f" .log | cut -d- -f3)
      grep -E '^(deepseek|qwen3) ' "$f" | awk -v s="$side" '{print $1"_"$2"_"$3"_"$4"_"$9"x"$10, s, $14}'
    done | sort -k1,1 -k2,2 | awk '{k=$1
      if (k != p) { if (p != "") print line"  new/base "(nb ? sprintf("%.3f", n / b) : "-"); line = k; p = k; n = b = nb = 0 }
      line = line"  "$2" "$3; if ($2 == "base") { b += $3; nb++ } else n += $3 }
      END { if (p != "") print line"  new/base "(nb ? sprintf("%.3f", n / b) : "-") }'
    grep -h "exited with" "$out"/gemm-compare-*-*.log
  )
fi

compare_line=
if [ -n "${BASELINE:-}" ] && [ -z "${SKIP_BENCH:-}" ]; then
  a_json= b_json=
  for round in $(seq 1 "${COMPARE_ROUNDS:-2}"); do
    for side in base new; do
      bin=build/bin/epx_bench
      [ $side = base ] && bin="$BASELINE/build/bin/epx_bench"
      json="$out/compare-$side-$round.json"
      timeout 300 "$bin" --json "$json" ${COMPARE_ARGS:-} >"$out/compare-$side-$round.log" 2>&1 ||
        echo "compare run $side $round: exit $?"
      [ $side = base ] && a_json="${a_json:+$a_json,}$json" || b_json="${b_json:+$b_json,}$json"
    done
  done
  python3 scripts/bench-compare.py "$a_json" "$b_json" --names=base,$commit >"$out/compare.txt" 2>&1
  compare_line=$(tail -1 "$out/compare.txt")
  # kernel time too (a baseline without it has its rows left out and counted)
  python3 scripts/bench-compare.py "$a_json" "$b_json" --names=base,$commit --field=kernel_us \
    >>"$out/compare.txt" 2>&1
fi

echo
echo "==================== summary ($commit) ===================="
echo "build: ${build_s}s"
echo "tests: $test_line"
[ -n "$sanitize_lines" ] && echo "compute-sanitizer:$sanitize_lines"
[ -n "$soak_lines" ] && echo "soak:$soak_lines"
echo "python tests: $py_line"
[ -n "$one_gpu_lines" ] && echo "one-GPU benches:
$one_gpu_lines"
[ -n "$moe_lines" ] && echo "MoE layer at decode (epx_moe_bench):
$moe_lines"
if [ -n "$deepep_line" ]; then
  echo "$deepep_line"
  for log in "$out/deepep-epx.log" "$out/deepep-v1.log"; do
    [ -f "$log" ] && { echo "--- $(basename "$log")"; tail -25 "$log"; }
  done
fi
[ -n "$sweep_lines" ] && echo "expert-major rows per setting:$sweep_lines"
[ -n "$experts_compare_lines" ] && echo "epx_experts_bench, median us (share of HBM), per run:
$experts_compare_lines"
[ -n "$gemm_compare_lines" ] && echo "epx_moe_gemm_bench, kcyc per run (point: shape_projection_ranks_chunks_width x height):
$gemm_compare_lines"
[ -n "$compare_line" ] && cat "$out/compare.txt"
if [ -f "$out/bench.log" ]; then
  echo "bench: exit $bench_rc"
  tail -45 "$out/bench.log"
fi
