#!/usr/bin/env bash
# tune-combine.sh - sweep the normal-mode combine's work split (docs/env.md) on this machine's
# GPUs and print one combine row per setting. Run after a build (scripts/gpu-check.sh builds).
#
# Usage: scripts/tune-combine.sh [OUT_DIR]
# Env:   SEND_WARPS (default "4 6"), UNIT_ROWS (default "4"), REDUCE_TOKENS (default "1"),
#        STAGES (default "4"), LAG (default "2"), DEPTH (default "1"),
#        BENCH_ARGS (default "--tokens 4096 --epx-sms 24 --sms 24").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-out}}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
args=${BENCH_ARGS:---tokens 4096 --epx-sms 24 --sms 24}
for sw in ${SEND_WARPS:-4 6}; do
  for ur in ${UNIT_ROWS:-4}; do
    for rt in ${REDUCE_TOKENS:-1}; do
      for st in ${STAGES:-4}; do
        for lag in ${LAG:-2}; do
         for dep in ${DEPTH:-1}; do
          log="$out/tune-sw$sw-ur$ur-rt$rt-st$st-lag$lag-d$dep.log"
          EPX_COMBINE_SEND_WARPS=$sw EPX_COMBINE_UNIT_ROWS=$ur EPX_COMBINE_REDUCE_TOKENS=$rt \
            EPX_COMBINE_BULK_STAGES=$st EPX_COMBINE_BULK_LAG=$lag EPX_COMBINE_BULK_STORE_DEPTH=$dep \
            timeout 300 build/bin/epx_bench $args >"$log" 2>&1
          rc=$?
          row=$(grep -E "^epx combine" "$log" | awk '{print $9 " us, " $13 " GB/s, wrong " $17}')
          echo "send_warps=$sw unit_rows=$ur reduce_tokens=$rt stages=$st lag=$lag depth=$dep: ${row:-no row} (exit $rc)"
         done
        done
      done
    done
  done
done
