#!/usr/bin/env python3
"""When would each expert's rows be complete if a dispatch sent expert by expert? (docs/moe.md,
"Not built": per-expert arrival counters.) A simulation, no GPU: T tokens per rank, R ranks, E
experts, top-K drawn uniformly without repetition. A token's payload crosses to rank d once, at
the turn of its first local expert there (the receiver's fan-out fills its other rows); every
source goes through the turns in step. Expert j on d is complete once turns 0..j are sent, i.e.
at the fraction (payloads to d whose first local expert is <= j) / (all payloads to d) of d's
transfer. Prints, per setting, the share of experts complete at a quarter, half, three quarters
and 90% of the transfer. Usage: python3 dev/expert_order_sim.py [tokens per rank]"""
import bisect
import random
import sys


def completion(T, R, E, K, seed=1):
    """Transfer fraction at which each local expert of rank 0 is complete."""
    rnd, L = random.Random(seed), E // R
    keys = []  # first local expert on rank 0 of each payload sent to rank 0
    for _src in range(R):
        for _t in range(T):
            local = [e for e in rnd.sample(range(E), K) if e < L]
            if local:
                keys.append(min(local))
    keys.sort()
    return [bisect.bisect_right(keys, j) / len(keys) for j in range(L)]


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    for R, E in ((2, 256), (4, 256), (8, 256), (4, 128)):
        done = completion(T, R, E, 8)
        shares = ", ".join("%.0f%%: %.0f%%" % (100 * f, 100 * sum(x <= f for x in done) / len(done))
                           for f in (0.25, 0.5, 0.75, 0.9))
        print("R %d, E %d, top-8: experts complete at transfer %s; expert 0 at %.0f%%" %
              (R, E, shares, 100 * done[0]))


if __name__ == "__main__":
    main()
