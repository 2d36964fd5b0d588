/*
 * ceiling.c - the machine's ceiling, measured in the same run: an SM-driven all-to-all push.
 *
 * Every rank writes bytes_per_pair to every OTHER rank p at
 *   peer_base[p] + layout.normal_offset + rank * bytes_per_pair
 * (the normal receive region of p's EPX workspace; writers never overlap), from a local
 * cudaMalloc source of one block per peer, with a kernel of `sms` blocks (bench_kernels.cu).
 *   bytes_per_pair = min(64 MiB, normal_bytes / R rounded down to 16 KiB)
 *   push GB/s      = (R - 1) * bytes_per_pair / time   (bytes leaving each GPU)
 *   logical GB/s   = push * R / (R - 1) = R * bytes_per_pair / time
 * The logical figure is what DeepEP reports and what EPX rows are compared with.
 * NOTE: the push overwrites the normal region, so no EPX operation may be in flight on any rank
 * around it: the sweep ends with a synchronize and a barrier.
 */
#include "bench.h"
#include "group.h"
#include "workspace.h"

#define MAX_BYTES_PER_PAIR ((size_t)64 << 20)
#define PAIR_GRANULE ((size_t)16 << 10)

_Static_assert(PAIR_GRANULE % BENCH_PUSH_UNIT_BYTES == 0, "the kernel pushes whole units");

static size_t bytes_per_pair(const bench_rank_t *b) {
  size_t bytes = b->group->layout.normal_bytes / (size_t)b->num_ranks;
  bytes -= bytes % PAIR_GRANULE;
  return bytes < MAX_BYTES_PER_PAIR ? bytes : MAX_BYTES_PER_PAIR;
}

static int push_iter(void *arg, cudaStream_t stream) {
  BENCH_CUDA(bench_push_launch((const bench_push_args_t *)arg, stream));
  return 0;
}

/* Peer j (the j-th rank other than this one) gets source block j. */
static bench_push_args_t push_args(const bench_rank_t *b, const char *src, size_t pair_bytes) {
  bench_push_args_t a = {{0}, {0}, 0, pair_bytes, 0};
  const epx_group_t g = b->group;
  for (int p = 0; p < b->num_ranks; p++) {
    if (p == b->rank) continue;
    a.src[a.num_peers] = src + (size_t)a.num_peers * pair_bytes;
    a.dst[a.num_peers] = g->peer_base[p] + g->layout.normal_offset + (size_t)b->rank * pair_bytes;
    a.num_peers++;
  }
  return a;
}

static int measure(bench_rank_t *b, bench_push_args_t *a, int sms) {
  const int R = b->num_ranks;
  bench_stats_t stats;
  a->num_blocks = sms;
  BENCH_TRY(bench_time(b, push_iter, a, &stats));
  bench_row_t row = bench_row_init(BENCH_OP_CEILING);
  row.ranks = R;
  row.sms = sms;
  BENCH_TRY(bench_finish_row(b, &stats, -1, (double)R * a->bytes_per_pair, &row));
  row.push_gbps = row.gbps * (R - 1) / R;
  return bench_emit_row(b, &row);
}

int bench_ceiling_rows(bench_rank_t *b) {
  const size_t pair_bytes = bytes_per_pair(b);
  if (pair_bytes == 0) {
    if (b->rank == 0) printf("# ceiling skipped: the normal region is under 16 KiB per rank\n");
    return 0;
  }
  if (b->rank == 0)
    printf("# ceiling: %zu bytes per pair (%.1f MiB), %d peers per rank\n", pair_bytes,
           pair_bytes / 1048576.0, b->num_ranks - 1);
  char *src = NULL;
  BENCH_CUDA(cudaMalloc((void **)&src, (size_t)(b->num_ranks - 1) * pair_bytes));
  BENCH_CUDA(cudaMemsetAsync(src, 0x5a, (size_t)(b->num_ranks - 1) * pair_bytes, b->stream));
  bench_push_args_t a = push_args(b, src, pair_bytes);
  for (int i = 0; i < b->opt->num_sms; i++) {
    const int sms = b->opt->sms[i];
    if (sms > b->device_sms) {
      if (b->rank == 0) printf("# ceiling at %d SMs skipped: the GPU has %d\n", sms, b->device_sms);
      continue;
    }
    BENCH_TRY(measure(b, &a, sms));
  }
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_EPX(epx_group_barrier(b->group, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_CUDA(cudaFree(src));
  return 0;
}
