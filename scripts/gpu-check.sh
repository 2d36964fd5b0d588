#!/usr/bin/env bash
# gpu-check.sh - everything a GPU machine should prove, in one call: build from scratch, run the
# tests at 2 and 4 ranks, run the benchmark, print a short summary last.
#
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default: $OUT, else ./out)
# Env:   TEST_ARGS (e.g. "--filter layout"), BENCH_ARGS (extra epx_bench flags), SKIP_BENCH=1,
#        SKIP_TESTS=1, RANKS (default "2,4").
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
make clean >/dev/null
targets="lib build/bin/epx_test"
[ -z "${SKIP_BENCH:-}" ] && targets="$targets build/bin/epx_bench"
if ! make -j"$(nproc)" $targets >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
build_s=$(($(date +%s) - t0))
grep -iE "warning" "$out/build.log" | head -20

test_line="(not run)"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 900 build/bin/epx_test --ranks "${RANKS:-2,4}" ${TEST_ARGS:-} >"$out/tests.log" 2>&1
  test_rc=$?
  grep -E "^\[ (FAIL|SKIP) \]|FAILED|rank [0-9]+:" "$out/tests.log" | head -60
  test_line=$(tail -1 "$out/tests.log")
  [ $test_rc -eq 124 ] && test_line="TIMED OUT after 900 s; $test_line"
fi

bench_rc="(not run)"
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 600 build/bin/epx_bench --json "$out/bench.json" ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  bench_rc=$?
fi

echo
echo "==================== summary ($commit) ===================="
echo "build: ${build_s}s"
echo "tests: $test_line"
if [ -f "$out/bench.log" ]; then
  echo "bench: exit $bench_rc"
  tail -45 "$out/bench.log"
fi
