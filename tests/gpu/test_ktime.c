/*
 * test_ktime.c - the benchmark's kernel time (bench/ktime.h) on one GPU: CUPTI's records of
 * known kernels, attributed to the right call with the right durations.
 *
 *   test                              what
 *   ktime_attributes_bracketed_calls  8 calls, each a 50 us and a 10 us spin kernel and a 1 MiB
 *                                     memset, between them a 20 us spin outside any bracket
 *                                     (the benchmark's barrier): 2 kernels per call, both
 *                                     named spin_kernel, summing 60 us (+15 us at most), the
 *                                     memset apart in copy_us; a 9th call of its own id (one
 *                                     30 us kernel) stays out of the 8 and is summarized alone;
 *                                     a second window starts empty
 * Skipped, with the reason, when libcupti cannot be loaded (bench/cupti_lib.c's search). Once
 * loaded, a window that cannot start fails: the benchmark would have no kernel time.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "ktime.h"

#define NUM_CALLS 8
#define FIRST_ID 1000
#define LONG_NS 50000ull
#define SHORT_NS 10000ull
#define OUTSIDE_NS 20000ull
#define ALONE_NS 30000ull
#define SLACK_US 15.0 /* launch, globaltimer step and CUPTI's timestamps, over two kernels */
#define MEMSET_BYTES (1u << 20)

/* Kernel sum of a call made of kernels of `want_us` in total: at least that (the spin waits
 * that long on the GPU's timer), at most SLACK_US more. */
#define EXPECT_KERNEL_US(got, want_us)                                \
  EXPECTF((got) >= 0.98 * (want_us) && (got) <= (want_us) + SLACK_US, \
          "%s = %.2f us, want %.1f us (+%.0f)", #got, (got), (want_us), SLACK_US)

static int expect_spin_part(const bench_ktime_part_t *p, double launches, double want_us) {
  EXPECTF(!strcmp(p->name, "spin_kernel"), "part name %s, want spin_kernel", p->name);
  EXPECT(!p->is_copy);
  EXPECTF(fabs(p->launches_per_call - launches) < 1e-9, "%.3f launches per call, want %.3f",
          p->launches_per_call, launches);
  EXPECT_KERNEL_US(p->us_per_call, want_us);
  return TEST_PASS;
}

/* The first window: NUM_CALLS bracketed calls, an unbracketed kernel before each, then one
 * call of its own id. */
static int first_window(cudaStream_t stream, void *buf) {
  char why[BENCH_KTIME_REASON_LEN];
  EXPECTF(bench_ktime_start(why, sizeof why) == 0, "bench_ktime_start: %s", why);
  for (int i = 0; i < NUM_CALLS; i++) {
    EXPECT_CUDA(test_spin_ns(OUTSIDE_NS, stream));
    bench_ktime_call_begin(FIRST_ID + (uint64_t)i);
    EXPECT_CUDA(test_spin_ns(LONG_NS, stream));
    EXPECT_CUDA(test_spin_ns(SHORT_NS, stream));
    EXPECT_CUDA(cudaMemsetAsync(buf, i, MEMSET_BYTES, stream));
    bench_ktime_call_end();
  }
  bench_ktime_call_begin(FIRST_ID + NUM_CALLS);
  EXPECT_CUDA(test_spin_ns(ALONE_NS, stream));
  bench_ktime_call_end();
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECTF(bench_ktime_stop(why, sizeof why) == 0, "bench_ktime_stop: %s", why);

  bench_ktime_summary_t s;
  EXPECT(bench_ktime_summarize(FIRST_ID, NUM_CALLS, &s) == 0);
  const double want_us = (LONG_NS + SHORT_NS) * 1e-3;
  EXPECT_EQ_INT(s.num_calls, NUM_CALLS);
  EXPECT_EQ_INT(s.min_kernels, 2);
  EXPECT_EQ_INT(s.max_kernels, 2);
  EXPECT_KERNEL_US(s.mean_us, want_us);
  EXPECT_KERNEL_US(s.median_us, want_us);
  EXPECTF(s.copy_us > 0 && s.copy_us < 50, "copy_us %.2f", s.copy_us);
  EXPECTF(s.span_us >= s.mean_us, "span %.2f < kernel sum %.2f", s.span_us, s.mean_us);
  EXPECT_EQ_INT(s.num_parts, 2);
  if (expect_spin_part(&s.parts[0], 2, want_us)) return TEST_FAIL;
  EXPECTF(!strcmp(s.parts[1].name, "[memset]") && s.parts[1].is_copy, "part 1: %s",
          s.parts[1].name);
  EXPECT(fabs(s.parts[1].launches_per_call - 1) < 1e-9);
  char text[512];
  bench_ktime_format(&s, text, sizeof text);
  printf("  %d calls: %s\n", NUM_CALLS, text);

  EXPECT(bench_ktime_summarize(FIRST_ID + NUM_CALLS, 1, &s) == 0);
  EXPECT_EQ_INT(s.min_kernels, 1);
  EXPECT_EQ_INT(s.max_kernels, 1);
  EXPECT_KERNEL_US(s.mean_us, ALONE_NS * 1e-3);
  EXPECTF(s.copy_us == 0, "copy_us %.2f in a call without copies", s.copy_us);
  return expect_spin_part(&s.parts[0], 1, ALONE_NS * 1e-3);
}

/* A second window reuses the ids: only its own records count. */
static int second_window(cudaStream_t stream) {
  char why[BENCH_KTIME_REASON_LEN];
  EXPECTF(bench_ktime_start(why, sizeof why) == 0, "bench_ktime_start: %s", why);
  for (int i = 0; i < 3; i++) {
    bench_ktime_call_begin(FIRST_ID + (uint64_t)i);
    EXPECT_CUDA(test_spin_ns(SHORT_NS, stream));
    bench_ktime_call_end();
  }
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECTF(bench_ktime_stop(why, sizeof why) == 0, "bench_ktime_stop: %s", why);
  bench_ktime_summary_t s;
  EXPECT(bench_ktime_summarize(FIRST_ID, NUM_CALLS, &s) == 0);
  EXPECT_EQ_INT(s.min_kernels, 0); /* calls 3..7 launched nothing in this window */
  EXPECT_EQ_INT(s.max_kernels, 1);
  EXPECT_EQ_INT(s.num_parts, 1);
  return expect_spin_part(&s.parts[0], 3.0 / NUM_CALLS, SHORT_NS * 1e-3 * 3 / NUM_CALLS);
}

EPX_ONE_GPU_TEST(ktime_attributes_bracketed_calls, 120) {
  char why[BENCH_KTIME_REASON_LEN];
  if (bench_ktime_open(why, sizeof why)) {
    fprintf(stderr, "  skipped: CUPTI cannot be loaded: %s\n", why);
    return TEST_SKIP;
  }
  printf("  CUPTI: %s\n", bench_ktime_library());
  cudaStream_t stream;
  void *buf = NULL;
  EXPECT_CUDA(cudaSetDevice(0));
  EXPECT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EXPECT_CUDA(cudaMalloc(&buf, MEMSET_BYTES));
  /* the kernel's module loaded before any window */
  EXPECT_CUDA(test_spin_ns(1000, stream));
  EXPECT_CUDA(cudaStreamSynchronize(stream));
  if (first_window(stream, buf) || second_window(stream)) return TEST_FAIL;
  EXPECT_CUDA(cudaFree(buf));
  EXPECT_CUDA(cudaStreamDestroy(stream));
  return TEST_PASS;
}
