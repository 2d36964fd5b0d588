#!/usr/bin/env bash
# trace-overhead.sh - what in-kernel tracing costs when it is off, measured: epx_bench's EPX
# rows from the default build (tracing compiled in, not started) against a TRACE=0 build
# (compiled out), run alternately (in, out, in, out, ...) so that drift of the machine falls on
# both. The last run of the default build also traces one extra iteration per row (--trace),
# which shows the cost when tracing is on. docs/profiling.md explains how to read the table.
#
# Usage: scripts/trace-overhead.sh [OUT_DIR]   (default: $OUT, else ./out)
# Env:   BENCH_ARGS (default "--sms 24 --tokens 4096 --iters 50 --warmup 10"), ROUNDS (3).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-out}}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 # NVLink multicast stays off on shared machines
args=${BENCH_ARGS:---sms 24 --tokens 4096 --iters 50 --warmup 10}
rounds=${ROUNDS:-3}

for v in in out; do
  trace=1
  [ $v = out ] && trace=0
  if ! make -j"$(nproc)" BUILD=build/trace-$v TRACE=$trace build/trace-$v/bin/epx_bench \
    >"$out/overhead-build-$v.log" 2>&1; then
    tail -30 "$out/overhead-build-$v.log"
    echo "BUILD FAILED (trace compiled $v)"
    exit 1
  fi
done

for r in $(seq 1 "$rounds"); do
  for v in in out; do
    extra=""
    [ $v = in ] && [ "$r" = "$rounds" ] && extra="--trace $out/overhead-trace.json"
    # shellcheck disable=SC2086
    if ! timeout 600 build/trace-$v/bin/epx_bench $args $extra --json "$out/overhead-$v-$r.json" \
      >"$out/overhead-$v-$r.log" 2>&1; then
      tail -20 "$out/overhead-$v-$r.log"
      echo "BENCH FAILED (trace compiled $v, round $r)"
      exit 1
    fi
  done
done

echo "== EPX rows: median us per run, tracing compiled in (off at run time) vs compiled out"
python3 - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {v: [json.load(open(f"{out}/overhead-{v}-{r}.json")) for r in range(1, rounds + 1)]
        for v in ("in", "out")}
keys = [(row["op"], row["tokens"], row["sms"]) for row in runs["in"][0] if row["op"].startswith("epx")]
print(f"{'op':22} {'tokens':>6} {'sms':>4} | {'compiled in (us)':>24} | {'compiled out (us)':>24} | in/out")
for op, tokens, sms in keys:
    med = {v: [row["median_us"] for run in runs[v] for row in run
               if (row["op"], row["tokens"], row["sms"]) == (op, tokens, sms)] for v in runs}
    mean = {v: sum(med[v]) / len(med[v]) for v in med}
    fmt = lambda xs: " ".join(f"{x:7.1f}" for x in xs)
    print(f"{op:22} {tokens:>6} {sms:>4} | {fmt(med['in']):>24} | {fmt(med['out']):>24} | "
          f"{mean['in'] / mean['out']:.3f}")
print("Read: the cost of compiled-in-but-off tracing is unmeasurable when in/out is within the")
print("run-to-run spread of each column.")
PY
echo "== cost when on (one traced iteration per row, default build, last round)"
grep "^# trace" "$out/overhead-in-$rounds.log"
