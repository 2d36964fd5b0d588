#!/usr/bin/env python3
"""trace-summary.py - a text summary of an EPX Chrome trace (docs/profiling.md).

Usage: scripts/trace-summary.py TRACE.json[.gz] [...]

For each rank and each span name: count, first start and last end (us, relative to the
earliest span of the trace), and the min / median / max duration. Then, per rank, the peers
that `wait` spans ended on (argument `peer` or `last_peer`), i.e. who that rank waited for.
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(path):
    doc = load(path)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        print(f"{path}: no spans")
        return
    t0 = min(e["ts"] for e in spans)
    by = defaultdict(list)
    waited = defaultdict(lambda: defaultdict(int))
    for e in spans:
        by[(e["pid"], e["name"])].append(e)
        if "wait" in e["name"]:
            args = e.get("args", {})
            peer = args.get("peer", args.get("last_peer"))
            if peer is not None:
                waited[(e["pid"], e["name"])][peer] += 1
    print(f"== {path}: {len(spans)} spans")
    print(f"{'rank':>4} {'span':22} {'count':>6} {'first_us':>9} {'last_end_us':>11} "
          f"{'min_us':>8} {'med_us':>8} {'max_us':>8}")
    for (pid, name) in sorted(by):
        ev = by[(pid, name)]
        durs = [e.get("dur", 0) for e in ev]
        first = min(e["ts"] for e in ev) - t0
        last = max(e["ts"] + e.get("dur", 0) for e in ev) - t0
        print(f"{pid:>4} {name:22} {len(ev):>6} {first:>9.1f} {last:>11.1f} "
              f"{min(durs):>8.2f} {statistics.median(durs):>8.2f} {max(durs):>8.2f}")
    for (pid, name), peers in sorted(waited.items()):
        print(f"rank {pid} {name}: ended on peer " +
              ", ".join(f"{p} x{n}" for p, n in sorted(peers.items())))


for p in sys.argv[1:]:
    summarize(p)
