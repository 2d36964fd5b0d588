#!/usr/bin/env python3
"""bench-compare.py - compare epx_bench JSON runs of two builds taken in one device call.

Usage: scripts/bench-compare.py A1.json[,A2.json...] B1.json[,B2.json...] [--names=A,B]
                                [--field=median_us|kernel_us|kernel_median_us|copy_us|p99_us]

Rows are matched by (op, tokens, ranks, sms). For each build the median over its runs of the
row's figure (--field: the JSON key, default median_us, the event time; kernel_us is the kernel
time, docs/bench.md "Timing") is printed, with the spread (max - min over runs) as the noise
estimate, and the ratio B/A. A row moves "beyond noise" when |B - A| exceeds the larger of the
two spreads plus 2 % of A; such rows are flagged with '!'. Rows whose figure is null in any run
(kernel time unavailable, or --kernel-iters 0) are left out and counted.
"""
import json
import statistics
import sys


def load(paths):
    runs = []
    for p in paths.split(","):
        with open(p) as f:
            runs.append({(r["op"], r["tokens"], r["ranks"], r["sms"]): r for r in json.load(f)})
    return runs


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names = ["A", "B"]
    field = "median_us"
    for a in sys.argv[1:]:
        if a.startswith("--names="):
            names = a.split("=", 1)[1].split(",")
        elif a.startswith("--field="):
            field = a.split("=", 1)[1]
    if len(args) != 2:
        print(__doc__)
        return 2
    a_runs, b_runs = load(args[0]), load(args[1])
    keys = [k for k in a_runs[0] if all(k in r for r in a_runs + b_runs)]
    if field != "median_us":
        print(f"# {field}")
    print(f"{'op':30s} {'tokens':>6s} {'sms':>4s} {names[0]+' us':>9s} {'+-':>6s} "
          f"{names[1]+' us':>9s} {'+-':>6s} {'B/A':>6s}")
    flagged = missing = 0
    for k in keys:
        if k[0].startswith("ceiling"):
            continue
        a = [r[k].get(field) for r in a_runs]
        b = [r[k].get(field) for r in b_runs]
        if any(v is None for v in a + b):
            missing += 1
            continue
        am, bm = statistics.median(a), statistics.median(b)
        asp, bsp = max(a) - min(a), max(b) - min(b)
        beyond = abs(bm - am) > max(asp, bsp) + 0.02 * am
        flagged += beyond
        print(f"{k[0]:30s} {str(k[1]):>6s} {str(k[3]):>4s} {am:9.1f} {asp:6.1f} {bm:9.1f} "
              f"{bsp:6.1f} {bm / am:6.3f}{' !' if beyond else ''}")
    print(f"# {len(keys)} rows, {flagged} beyond noise ('!': |B-A| > max spread + 2% of A); "
          f"{len(a_runs)} run(s) of {names[0]}, {len(b_runs)} of {names[1]}"
          + (f"; {missing} rows without {field}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
