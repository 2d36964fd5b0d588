#!/usr/bin/env bash
# run-deepep-tests.sh - run DeepEP V1's own intranode and low-latency tests on EPX (epx.deep_ep),
# or, with --deepep, unmodified against the real deep_ep, for a side-by-side comparison.
#
#   scripts/run-deepep-tests.sh [--deepep] [DEEPEP_DIR] [-- EXTRA TEST FLAGS]
#
# DEEPEP_DIR: a DeepEP V1 source tree (default ./deepep-v1, ignored by git). Its
# tests/test_intranode.py, tests/test_low_latency.py and tests/utils.py are copied into a
# temporary directory. Default mode: the one line `import deep_ep` of each test file becomes
# `from epx import deep_ep` (nothing else changes; the script fails if the line is not found),
# and the tests run against the installed epx package (else the repository's python/).
# --deepep: the copies stay unmodified and run with PYTHONPATH=DEEPEP_DIR, i.e. against the
# deep_ep built in place in that tree (`python setup.py build_ext --inplace` there).
#
# Each test runs with --num-processes N (N = $NPROC, else the visible GPUs) and the flags after
# `--`, NCCL_NVLS_ENABLE=0, under a timeout of $TIMEOUT seconds (default 1800). Output goes to
# $OUT (default out/deepep-tests/<mode>-<date>), one log per test; the performance lines are
# printed at the end. Exit code: 0 when every test exited 0.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
mode=epx
src=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deepep) mode=deepep ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    -*) echo "run-deepep-tests.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) src="$1" ;;
  esac
  shift
done
src_arg="${src:-$repo/deepep-v1}"
src="$(cd "$src_arg" 2>/dev/null && pwd)" || {
  echo "run-deepep-tests.sh: no DeepEP tree at $src_arg" >&2
  exit 2
}
python="${PYTHON:-python3}"
tests=(test_intranode test_low_latency)
for f in "${tests[@]}" utils; do
  [ -f "$src/tests/$f.py" ] || { echo "run-deepep-tests.sh: $src/tests/$f.py is missing" >&2; exit 2; }
done

if [ -z "${NPROC:-}" ]; then
  NPROC="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
fi
# EPX runs DeepEP's tests on one GPU too (a one-rank group); DeepEP itself needs 2.
min_proc=1
[ "$mode" = deepep ] && min_proc=2
if [ "$NPROC" -lt "$min_proc" ]; then
  echo "run-deepep-tests.sh: needs at least $min_proc GPU(s) in $mode mode (NPROC=$NPROC)" >&2
  exit 2
fi
TIMEOUT="${TIMEOUT:-1800}"
OUT="${OUT:-$repo/out/deepep-tests/$mode-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for f in "${tests[@]}" utils; do cp "$src/tests/$f.py" "$work/"; done

export NCCL_NVLS_ENABLE=0
# DeepEP's init_dist reads WORLD_SIZE and RANK as the node count and node rank: clear any
# values left by a launcher, and give each run its own port.
unset WORLD_SIZE RANK LOCAL_RANK
if [ "$mode" = epx ]; then
  for t in "${tests[@]}"; do
    sed -i 's/^import deep_ep$/from epx import deep_ep/' "$work/$t.py"
    if ! grep -qx 'from epx import deep_ep' "$work/$t.py" || grep -q '^import deep_ep' "$work/$t.py"; then
      echo "run-deepep-tests.sh: $t.py: the line 'import deep_ep' was not replaced" >&2
      exit 1
    fi
  done
  if ! "$python" -c 'import epx.deep_ep' 2>/dev/null; then
    export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$python" -c 'import epx.deep_ep, epx; print("epx", epx.version(), "from", epx.__file__)' | tee "$OUT/versions.txt"
else
  export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$python" -c 'import deep_ep' 2>"$OUT/import-error.txt"; then
    echo "run-deepep-tests.sh: deep_ep does not import from $src (build it in place there:" \
      "python setup.py build_ext --inplace); see $OUT/import-error.txt" >&2
    exit 1
  fi
  "$python" -c 'import deep_ep; print("deep_ep from", deep_ep.__file__)' | tee "$OUT/versions.txt"
fi
# Only a git checkout of its own names the DeepEP tree's commit (an archive inside this
# repository would otherwise report EPX's).
if [ "$(cd "$src" && git rev-parse --show-toplevel 2>/dev/null)" = "$src" ]; then
  (cd "$src" && git rev-parse HEAD | sed 's/^/DeepEP tree commit /') | tee -a "$OUT/versions.txt"
else
  echo "DeepEP tree $src: not a git checkout (expected: an archive of 567632d)" |
    tee -a "$OUT/versions.txt"
fi
(cd "$repo" && git rev-parse HEAD 2>/dev/null | sed 's/^/EPX commit /') | tee -a "$OUT/versions.txt" || true
nvidia-smi -L 2>/dev/null | head -n "$NPROC" | tee -a "$OUT/versions.txt" || true

status=0
for t in "${tests[@]}"; do
  port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  echo "== $mode: $t.py --num-processes $NPROC ${extra[*]:-} (timeout ${TIMEOUT}s, log $OUT/$t.log)"
  set +e
  # timeout signals its whole process group: the test's spawned ranks are stopped too.
  (cd "$work" && MASTER_PORT="$port" timeout --kill-after=30 "$TIMEOUT" \
    "$python" "$t.py" --num-processes "$NPROC" "${extra[@]}") 2>&1 | tee "$OUT/$t.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "== $t.py: timed out after ${TIMEOUT}s" | tee -a "$OUT/$t.log"
    echo "== $t.py: FAILED (exit code $rc)" | tee -a "$OUT/$t.log"
    status=1
  else
    echo "== $t.py: exit code 0" | tee -a "$OUT/$t.log"
  fi
done

echo
echo "== performance lines ($mode, $NPROC GPUs; full logs in $OUT)"
for t in "${tests[@]}"; do
  echo "-- $t"
  grep -h "Best\|bandwidth\|avg_t\|send/recv\|Kernel performance\|passed" "$OUT/$t.log" || echo "(none)"
done | tee "$OUT/summary.txt"
exit "$status"
