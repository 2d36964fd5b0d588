/*
 * clock.c - clock alignment across GPUs (pure): each rank's %globaltimer mapped onto rank 0's.
 *
 * Each GPU stamps events with its own %globaltimer. At start and at dump the ranks run
 * EPX_TRACE_SYNC_ROUNDS barrier rounds in one kernel (src/kernels/barrier.cu) and stamp the end
 * of each round; all ranks leave a round within about one flag latency of each other, so
 * stamp_q[r] - stamp_0[r] estimates rank q's offset from rank 0. The median over rounds is the
 * offset, max - min the jitter. Between the two measurements the offset is interpolated
 * linearly (drift), outside them it is held. Error: one flag latency plus one timer step.
 * Invariant: a round stamp of 0 means "no stamp" and is never used.
 */
#include <stdlib.h>
#include <string.h>

#include "trace.h"

_Static_assert(EPX_TRACE_SYNC_ROUNDS <= 32, "round_used holds one bit a round");

static int compare_ll(const void *a, const void *b) {
  const long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

int epx__trace_clock_offset(const unsigned long long *mine, const unsigned long long *ref,
                            int rounds, long long *offset_ns, long long *spread_ns) {
  long long diff[64];
  int n = 0;
  for (int r = 0; r < rounds && n < 64; r++)
    if (mine[r] && ref[r]) diff[n++] = (long long)(mine[r] - ref[r]);
  *offset_ns = 0;
  *spread_ns = 0;
  if (n == 0) return 0;
  qsort(diff, (size_t)n, sizeof diff[0], compare_ll);
  *offset_ns = n % 2 ? diff[n / 2] : diff[n / 2 - 1] + (diff[n / 2] - diff[n / 2 - 1]) / 2;
  *spread_ns = diff[n - 1] - diff[0];
  return n;
}

void epx__trace_clock_model(const unsigned long long *mine, const unsigned long long *ref,
                            epx__trace_rank_t *r) {
  enum { K = EPX_TRACE_SYNC_ROUNDS };
  int anchors = 0;
  memset(r->sync_local_ns, 0, sizeof r->sync_local_ns);
  memset(r->offset_ns, 0, sizeof r->offset_ns);
  memset(r->round_offset_ns, 0, sizeof r->round_offset_ns);
  memset(r->round_used, 0, sizeof r->round_used);
  r->spread_ns = 0;
  for (int s = 0; s < 2; s++) {
    const unsigned long long *m = mine + s * K, *r0 = ref + s * K;
    for (int k = 0; k < K; k++)
      if (m[k] && r0[k]) {
        r->round_offset_ns[s][k] = (long long)(m[k] - r0[k]);
        r->round_used[s] |= 1u << k;
      }
    long long offset, spread;
    if (!epx__trace_clock_offset(m, r0, K, &offset, &spread)) continue;
    unsigned long long last = 0; /* the anchor: this rank's last valid stamp */
    for (int k = 0; k < K; k++)
      if (m[k] && r0[k]) last = m[k];
    r->sync_local_ns[anchors] = last;
    r->offset_ns[anchors] = offset;
    if (spread > r->spread_ns) r->spread_ns = spread;
    anchors++;
  }
  r->clock_valid = anchors > 0;
}

long long epx__trace_align(const epx__trace_rank_t *r, unsigned long long t) {
  const unsigned long long a0 = r->sync_local_ns[0], a1 = r->sync_local_ns[1];
  long long off = r->offset_ns[0];
  if (!r->clock_valid)
    off = 0;
  else if (a1 > a0 && t >= a1)
    off = r->offset_ns[1];
  else if (a1 > a0 && t > a0)
    off += (long long)((double)(r->offset_ns[1] - r->offset_ns[0]) * (double)(t - a0) /
                       (double)(a1 - a0));
  /* NOTE: times are ~1e18 ns since an epoch; only differences go through a double. */
  return (long long)t - off;
}
