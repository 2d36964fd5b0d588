#!/usr/bin/env python3
"""When does each local expert's rows become complete in an expert-major dispatch? Reads an EPX
trace (epx_bench --rows normal --trace FILE --trace-op expand, docs/profiling.md) and, per
rank, sets each "expert ready" event (expand_arrival.cuh: the add that completed the expert)
against the rank's dispatch: from its first sending block's start to its last expert ready.
Prints the share of experts ready at a quarter, half, three quarters and 90% of that span, the
span, and when this rank's senders ended (the last "dispatch token", as a share of the span).
docs/moe.md ("Arrival signals") quotes it; dev/expert_order_sim.py is what an expert-ordered
sender would give. Usage: python3 dev/expert_ready_curve.py TRACE.json [...]"""
import collections
import json
import sys


def per_rank(path):
    """{rank: (dispatch start, last sender token end, [expert ready times])}, in us."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    start, sent, ready = {}, collections.defaultdict(float), collections.defaultdict(list)
    for e in events:
        p, ts = e["pid"], float(e["ts"])
        if e["name"] == "dispatch send":
            start[p] = min(start.get(p, ts), ts)
        elif e["name"] == "dispatch token":
            sent[p] = max(sent[p], ts + float(e.get("dur", 0)))
        elif e["name"] == "expert ready":
            ready[p].append(ts)
    return {p: (start[p], sent[p], sorted(ready[p])) for p in sorted(start) if ready[p]}


def main(paths):
    marks = (0.25, 0.5, 0.75, 0.9)
    for path in paths:
        print(f"== {path}")
        ranks = per_rank(path)
        if not ranks:
            print("  no 'expert ready' events (a trace of an expand dispatch, built with TRACE=1?)")
        for p, (t0, sent, ready) in ranks.items():
            span = ready[-1] - t0
            shares = [sum(1 for t in ready if t - t0 <= m * span) / len(ready) for m in marks]
            print(f"  rank {p}: {len(ready)} experts, span {span:7.1f} us; ready at "
                  + ", ".join(f"{m:.0%}: {s:4.0%}" for m, s in zip(marks, shares))
                  + f"; first ready at {(ready[0] - t0) / span:4.0%}, this rank's senders "
                  f"ended at {(sent - t0) / span:4.0%}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
