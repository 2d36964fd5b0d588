/*
 * test_ktime.c - the benchmark's kernel time without a GPU: the pure logic of bench/ktime.h
 * (attribution, per-call sums, breakdown, names, text) on hand-made records, and where
 * bench/cupti_lib.c looks for libcupti, on a scratch directory tree.
 *
 *   test                              what
 *   ktime_short_names                 mangled kernels as nvcc names EPX's (scope::name, no
 *                                     anonymous namespace), gcc's anonymous namespace,
 *                                     templates, std::, substitutions, plain and unmangled
 *                                     names, garbage, cutting to the buffer
 *   ktime_aggregate_attributes_calls  3 calls of ids 5..7 in unsorted records: activities of
 *                                     no id, of other ids, and the links of API calls that
 *                                     launched nothing are ignored; mean, median, copies,
 *                                     span, kernels per call, the breakdown in order of first
 *                                     start with the copies last; a call that launched
 *                                     nothing counts as 0 us; no calls: no figure
 *   ktime_breakdown_folds_other       more names than fit: the rest summed as "other",
 *                                     before the copies, and the parts still add up
 *   ktime_format_line                 the --kernels text: parts, launches per call, median,
 *                                     copies, varying kernel counts, span and event time
 *   ktime_timeline_and_overlap        one call's activities sorted by start (others' and
 *                                     unlinked ones left out); busy and overlapped time of two
 *                                     classes: nested, touching, disjoint intervals, ignored
 *                                     classes, an empty timeline
 *   cupti_candidates_order            the override, $CUDA_HOME, the build's toolkit,
 *                                     /usr/local/cuda, $VIRTUAL_ENV's and /opt/x/.venv's
 *                                     nvidia/x/lib, /usr/local's dist-packages, in that order;
 *                                     a file met twice (a symlink, the same toolkit twice)
 *                                     once; a missing override still first; the cap
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/runner.h"
#include "cupti_lib.h"
#include "ktime.h"

static int expect_short(const char *name, size_t len, const char *want) {
  char out[BENCH_KTIME_NAME_LEN];
  bench_ktime_short_name(name, out, len);
  EXPECTF(!strcmp(out, want), "short name of %s: \"%s\", want \"%s\"", name, out, want);
  return TEST_PASS;
}

EPX_HOST_TEST(ktime_short_names, 10) {
  static const struct {
    const char *name, *want;
  } cases[] = {
      /* as nvcc names EPX's kernels */
      {"_ZN41_GLOBAL__N__e9eaec0a_9_layout_cu_0a9edaaa13layout_kernelIiLb0EEEv15epx__kernel_ctx",
       "layout_kernel"},
      {"_ZN48_GLOBAL__N__2fa5603b_15_test_kernels_cu_958812eb11spin_kernelEm", "spin_kernel"},
      {"_ZN3epx6normal8dispatchIiiLi0EEEv15epx__kernel_ctx25epx__dispatch_launch_args",
       "normal::dispatch"},
      {"_ZN3epx2ll7combineILb1EEEv15epx__kernel_ctx", "ll::combine"},
      /* gcc's anonymous namespace, plain functions, more scopes, qualifiers, std::, S_ */
      {"_ZN12_GLOBAL__N_113layout_kernelILb0ElEEvN4epx3ctxE", "layout_kernel"},
      {"_Z11spin_kernelm", "spin_kernel"},
      {"_ZL11spin_kernelm", "spin_kernel"},
      {"_ZN3epx6detail5inner15dispatch_kernelILi8ELb1EEEvPv", "inner::dispatch_kernel"},
      {"_ZNK3epx4Impl3runEv", "Impl::run"},
      {"_ZNSt6thread4joinEv", "thread::join"},
      {"_ZN3epxS_7combineEv", "epx::combine"},
      {"ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_SendRecv"},
      {"plain_c_kernel", "plain_c_kernel"},
      {"_ZN99abc", "_ZN99abc"},       /* a length past the end: as given */
      {"_ZZ4mainE1x", "_ZZ4mainE1x"}, /* a local name: not a kernel, as given */
      {"(odd)", "(odd)"},
      {"", ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    if (expect_short(cases[i].name, BENCH_KTIME_NAME_LEN, cases[i].want)) return TEST_FAIL;
  if (expect_short("_ZN12_GLOBAL__N_113layout_kernelEv", 7, "layout")) return TEST_FAIL;
  if (expect_short("_ZN3epx6normal8dispatchEv", 10, "normal::d")) return TEST_FAIL;
  if (expect_short("a_rather_long_unmangled_kernel_name", 5, "a_ra")) return TEST_FAIL;
  return TEST_PASS;
}

static bench_ktime_activity_t kernel(uint32_t corr, uint64_t start, uint64_t dur_ns,
                                     const char *name) {
  bench_ktime_activity_t a = {.kind = BENCH_KTIME_KERNEL,
                              .correlation_id = corr,
                              .start_ns = start,
                              .end_ns = start + dur_ns,
                              .name = name};
  return a;
}

static bench_ktime_activity_t copy(bench_ktime_kind_t kind, uint32_t corr, uint64_t start,
                                   uint64_t dur_ns) {
  bench_ktime_activity_t a = {
      .kind = kind, .correlation_id = corr, .start_ns = start, .end_ns = start + dur_ns};
  return a;
}

#define EXPECT_NEAR(got, want) \
  EXPECTF(fabs((got) - (want)) < 1e-9, "%s = %.6f, want %.6f", #got, (double)(got), (double)(want))

EPX_HOST_TEST(ktime_aggregate_attributes_calls, 10) {
  /* Call c (id 5 + c) at t = 1000 c us: layout (2 us), dispatch (10, 11, 30 us), a memset of
   * 1 us in call 0 and a memcpy of 3 us in call 2; a barrier kernel between calls (no id) and
   * a kernel of id 9 (another series) must not count. Correlation ids: 10 c + k. */
  const char *layout = "layout_kernel", *dispatch = "dispatch_kernel";
  const double dispatch_us[3] = {10, 11, 30};
  bench_ktime_activity_t acts[16];
  bench_ktime_link_t links[16];
  int na = 0, nl = 0;
  for (int c = 2; c >= 0; c--) { /* out of order on purpose */
    const uint64_t t = 1000000ull * (uint64_t)c;
    acts[na++] = kernel(10 * c + 2, t + 5000, (uint64_t)(dispatch_us[c] * 1000), dispatch);
    acts[na++] = kernel(10 * c + 1, t + 1000, 2000, layout);
    acts[na++] = kernel(10 * c + 9, t + 100, 700, "barrier_kernel"); /* no link: no id */
    links[nl++] = (bench_ktime_link_t){(uint32_t)(10 * c + 1), 5 + (uint64_t)c};
    links[nl++] = (bench_ktime_link_t){(uint32_t)(10 * c + 2), 5 + (uint64_t)c};
    links[nl++] = (bench_ktime_link_t){(uint32_t)(10 * c + 3), 5 + (uint64_t)c}; /* no launch */
  }
  acts[na++] = copy(BENCH_KTIME_MEMSET, 4, 3000, 1000);
  links[nl++] = (bench_ktime_link_t){4, 5};
  acts[na++] = copy(BENCH_KTIME_MEMCPY, 24, 2000000 + 60000, 3000);
  links[nl++] = (bench_ktime_link_t){24, 7};
  acts[na++] = kernel(40, 3000000, 99000, dispatch);
  links[nl++] = (bench_ktime_link_t){40, 9};

  bench_ktime_summary_t s;
  EXPECT(bench_ktime_aggregate(acts, (size_t)na, links, (size_t)nl, 5, 3, &s) == 0);
  EXPECT_EQ_INT(s.num_calls, 3);
  EXPECT_NEAR(s.mean_us, (12.0 + 13.0 + 32.0) / 3);
  EXPECT_NEAR(s.median_us, 13.0);
  EXPECT_NEAR(s.copy_us, (1.0 + 3.0) / 3);
  /* spans: call 0 from 1 us (layout) to 15 us (dispatch), call 1 1..16, call 2 1..63 (memcpy) */
  EXPECT_NEAR(s.span_us, (14.0 + 15.0 + 62.0) / 3);
  EXPECT_EQ_INT(s.min_kernels, 2);
  EXPECT_EQ_INT(s.max_kernels, 2);
  EXPECT(isnan(s.event_us)); /* the caller's */
  EXPECT_EQ_INT(s.num_parts, 4);
  EXPECT(!strcmp(s.parts[0].name, "layout_kernel") && !s.parts[0].is_copy);
  EXPECT_NEAR(s.parts[0].us_per_call, 2.0);
  EXPECT_NEAR(s.parts[0].launches_per_call, 1.0);
  EXPECT(!strcmp(s.parts[1].name, "dispatch_kernel") && !s.parts[1].is_copy);
  EXPECT_NEAR(s.parts[1].us_per_call, 51.0 / 3);
  EXPECT(!strcmp(s.parts[2].name, "[memset]") && s.parts[2].is_copy);
  EXPECT_NEAR(s.parts[2].launches_per_call, 1.0 / 3);
  EXPECT(!strcmp(s.parts[3].name, "[memcpy]") && s.parts[3].is_copy);
  EXPECT_NEAR(s.parts[3].us_per_call, 1.0);

  /* Ids 5..8: call 8 launched nothing and counts as 0 us (the median moves to (12+13)/2). */
  EXPECT(bench_ktime_aggregate(acts, (size_t)na, links, (size_t)nl, 5, 4, &s) == 0);
  EXPECT_NEAR(s.mean_us, (12.0 + 13.0 + 32.0) / 4);
  EXPECT_NEAR(s.median_us, 12.5);
  EXPECT_EQ_INT(s.min_kernels, 0);
  EXPECT_NEAR(s.span_us, (14.0 + 15.0 + 62.0) / 3); /* over the calls that launched something */

  /* The other series alone. */
  EXPECT(bench_ktime_aggregate(acts, (size_t)na, links, (size_t)nl, 9, 1, &s) == 0);
  EXPECT_NEAR(s.mean_us, 99.0);
  EXPECT_EQ_INT(s.num_parts, 1);

  /* No calls, or no records: no figure / zeros. */
  EXPECT(bench_ktime_aggregate(acts, (size_t)na, links, (size_t)nl, 5, 0, &s) == 0);
  EXPECT_EQ_INT(s.num_calls, 0);
  EXPECT(isnan(s.mean_us));
  EXPECT(bench_ktime_aggregate(NULL, 0, NULL, 0, 1, 2, &s) == 0);
  EXPECT_EQ_INT(s.num_calls, 2);
  EXPECT_NEAR(s.mean_us, 0.0);
  EXPECT(isnan(s.span_us));
  EXPECT_EQ_INT(s.num_parts, 0);
  return TEST_PASS;
}

EPX_HOST_TEST(ktime_breakdown_folds_other, 10) {
  enum { N = BENCH_KTIME_MAX_PARTS + 3 };
  static char names[N][16];
  bench_ktime_activity_t acts[N + 1];
  bench_ktime_link_t links[N + 1];
  double sum = 0;
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "k%02d", i);
    acts[i] =
        kernel((uint32_t)i + 1, 100000 + 10000 * (uint64_t)i, 1000 * (uint64_t)(i + 1), names[i]);
    links[i] = (bench_ktime_link_t){(uint32_t)i + 1, 1};
    sum += i + 1;
  }
  acts[N] = copy(BENCH_KTIME_MEMSET, 100, 50, 500);
  links[N] = (bench_ktime_link_t){100, 1};
  bench_ktime_summary_t s;
  EXPECT(bench_ktime_aggregate(acts, N + 1, links, N + 1, 1, 1, &s) == 0);
  EXPECT_EQ_INT(s.num_parts, BENCH_KTIME_MAX_PARTS);
  const int kept = BENCH_KTIME_MAX_PARTS - 2; /* the memset, "other" */
  for (int i = 0; i < kept; i++)
    EXPECTF(!strcmp(s.parts[i].name, names[i]), "part %d: %s", i, s.parts[i].name);
  const bench_ktime_part_t *other = &s.parts[kept];
  EXPECT(!strcmp(other->name, "other") && !other->is_copy);
  EXPECT_NEAR(other->launches_per_call, (double)(N - kept));
  double parts = 0;
  for (int i = 0; i <= kept; i++) parts += s.parts[i].us_per_call;
  EXPECT_NEAR(parts, sum);
  EXPECT_NEAR(s.mean_us, sum);
  EXPECT(!strcmp(s.parts[kept + 1].name, "[memset]"));
  return TEST_PASS;
}

EPX_HOST_TEST(ktime_format_line, 10) {
  bench_ktime_summary_t s = bench_ktime_none();
  char text[512];
  bench_ktime_format(&s, text, sizeof text);
  EXPECTF(!strcmp(text, "no figure"), "%s", text);
  s.num_calls = 10;
  s.mean_us = 213.0;
  s.median_us = 212.5;
  s.copy_us = 1.2;
  s.span_us = 240.06;
  s.event_us = 250.3;
  s.min_kernels = s.max_kernels = 3;
  const bench_ktime_part_t parts[] = {{"layout_kernel", 0, 1, 3.1},
                                      {"notify_kernel", 0, 1, 4.9},
                                      {"dispatch_kernel", 0, 1, 205.0},
                                      {"[memcpy]", 1, 2, 1.2}};
  s.num_parts = 4;
  memcpy(s.parts, parts, sizeof parts);
  bench_ktime_format(&s, text, sizeof text);
  const char *want =
      "layout_kernel 3.1 + notify_kernel 4.9 + dispatch_kernel 205.0 = 213.0 us (median "
      "212.5); [memcpy] 1.2 (x2); span 240.1 us; event 250.3 us; 10 calls";
  EXPECTF(!strcmp(text, want), "\n  got  %s\n  want %s", text, want);
  s.parts[1].launches_per_call = 1.5;
  s.min_kernels = 2;
  s.event_us = NAN;
  bench_ktime_format(&s, text, sizeof text);
  want =
      "layout_kernel 3.1 + notify_kernel 4.9 (x1.50) + dispatch_kernel 205.0 = 213.0 us "
      "(median 212.5); [memcpy] 1.2 (x2); kernels per call vary: 2..3; span 240.1 us; 10 calls";
  EXPECTF(!strcmp(text, want), "\n  got  %s\n  want %s", text, want);
  /* A short buffer: cut, terminated, and the full length returned. */
  char small[16];
  const int n = bench_ktime_format(&s, small, sizeof small);
  EXPECT(n == (int)strlen(want) && strlen(small) == sizeof small - 1);
  EXPECT(!strncmp(small, want, sizeof small - 1));
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Where libcupti is looked for
 * ------------------------------------------------------------------------------------------- */
/* Create root + path (and its directories) as an empty file. */
static int touch(const char *root, const char *path) {
  char full[1024];
  snprintf(full, sizeof full, "%s%s", root, path);
  for (char *p = full + strlen(root) + 1; *p; p++)
    if (*p == '/') {
      *p = '\0';
      mkdir(full, 0755);
      *p = '/';
    }
  FILE *f = fopen(full, "w");
  if (!f) return -1;
  fclose(f);
  return 0;
}

/* The candidates of s must be root + want[0..num_want), in order. */
static int expect_candidates(const bench_cupti_search_t *s, int max, const char *root,
                             const char *const *want, int num_want) {
  char *got[16];
  const int n = bench_cupti_candidates(s, got, max);
  int rc = n == num_want ? TEST_PASS : TEST_FAIL;
  for (int i = 0; i < n; i++) {
    char target[1024];
    snprintf(target, sizeof target, "%s%s", root, i < num_want ? want[i] : "(none)");
    if (strcmp(got[i], target)) rc = TEST_FAIL;
  }
  if (rc != TEST_PASS) {
    fprintf(stderr, "  FAILED: %d candidates (want %d) under %s:\n", n, num_want, root);
    for (int i = 0; i < n; i++)
      fprintf(stderr, "    %s\n    want %s\n", got[i] + strlen(root), i < num_want ? want[i] : "-");
  }
  for (int i = 0; i < n; i++) free(got[i]);
  return rc;
}

/* The scratch tree's files, and what the search finds in it. */
static int check_search(const char *root) {
  static const char *const files[] = {
      "/custom/libcupti.so.x",
      "/cudahome/lib64/libcupti.so.13",
      "/usr/local/cuda/lib64/libcupti.so.13",
      "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.12",
      "/usr/local/cuda/lib/libcupti_other.so", /* not libcupti.so* */
      "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13",
      "/opt/torch/.venv/lib/python3.11/site-packages/nvidia/cuda_cupti/lib/libcupti.so.12",
      "/usr/local/lib/python3.10/dist-packages/nvidia/cu13/lib/libcupti.so.13",
  };
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
    EXPECTF(touch(root, files[i]) == 0, "creating %s%s", root, files[i]);
  char link[1024];
  snprintf(link, sizeof link, "%s/usr/local/cuda/lib64/libcupti.so", root);
  EXPECT(symlink("libcupti.so.13", link) == 0); /* the same file as libcupti.so.13 */

  char custom[1024], cuda_home[1024], build_home[1024], venv[1024];
  snprintf(custom, sizeof custom, "%s/custom/libcupti.so.x", root);
  snprintf(cuda_home, sizeof cuda_home, "%s/cudahome", root);
  snprintf(build_home, sizeof build_home, "%s/usr/local/cuda", root); /* = root + /usr/local/cuda */
  snprintf(venv, sizeof venv, "%s/venv", root);
  bench_cupti_search_t s = {custom, cuda_home, build_home, {venv, ""}, root};
  static const char *const want[] = {
      "/custom/libcupti.so.x",
      "/cudahome/lib64/libcupti.so.13",
      "/usr/local/cuda/lib64/libcupti.so", /* sorted first; libcupti.so.13 is the same file */
      "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.12",
      "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13",
      "/opt/torch/.venv/lib/python3.11/site-packages/nvidia/cuda_cupti/lib/libcupti.so.12",
      "/usr/local/lib/python3.10/dist-packages/nvidia/cu13/lib/libcupti.so.13",
  };
  if (expect_candidates(&s, 16, root, want, (int)(sizeof want / sizeof want[0]))) return TEST_FAIL;

  /* A missing override is still tried first (its dlopen error is the reason given); the cap. */
  snprintf(custom, sizeof custom, "%s/nowhere/libcupti.so", root);
  s.cuda_home = NULL;
  static const char *const capped[] = {"/nowhere/libcupti.so", "/usr/local/cuda/lib64/libcupti.so"};
  return expect_candidates(&s, 2, root, capped, 2);
}

static int class_by_name(const bench_ktime_activity_t *a) {
  if (!a->name) return -1;
  return a->name[0] == 'c' ? 0 : a->name[0] == 'g' ? 1 : -1; /* comm, gemm, else none */
}

EPX_HOST_TEST(ktime_timeline_and_overlap, 10) {
  /* Call 3 (correlation ids 1..6) and call 4 (id 7). Times in ns. */
  bench_ktime_activity_t acts[8];
  acts[0] = kernel(2, 500, 300, "gemm1");  /* [500, 800) */
  acts[1] = kernel(1, 100, 500, "comm1");  /* [100, 600) */
  acts[2] = kernel(3, 800, 200, "gemm2");  /* [800, 1000): touches gemm1 */
  acts[3] = kernel(4, 900, 50, "comm2");   /* [900, 950): inside gemm2 */
  acts[4] = kernel(5, 200, 100, "comm3");  /* [200, 300): inside comm1 */
  acts[5] = kernel(6, 1000, 400, "other"); /* [1000, 1400): no class */
  acts[6] = kernel(7, 0, 5000, "gemm9");   /* call 4 */
  acts[7] = kernel(99, 0, 5000, "comm9");  /* no link */
  const bench_ktime_link_t links[] = {{1, 3}, {2, 3}, {3, 3}, {4, 3}, {5, 3}, {6, 3}, {7, 4}};
  bench_ktime_activity_t *tl = NULL;
  const long n = bench_ktime_call_timeline(acts, 8, links, 7, 3, &tl);
  EXPECT_EQ_INT(n, 6);
  EXPECT(tl != NULL);
  for (long i = 1; i < n; i++) EXPECT(tl[i - 1].start_ns <= tl[i].start_ns);
  EXPECT(tl[0].start_ns == 100 && tl[n - 1].start_ns == 1000);
  const bench_ktime_overlap_t o = bench_ktime_overlap(tl, (size_t)n, class_by_name);
  EXPECT(o.span_ns == 1300);   /* 100 .. 1400 */
  EXPECT(o.busy_ns[0] == 550); /* [100, 600) + [900, 950) */
  EXPECT(o.busy_ns[1] == 500); /* [500, 1000) */
  EXPECT(o.both_ns == 150);    /* [500, 600) + [900, 950) */
  free(tl);
  EXPECT_EQ_INT(bench_ktime_call_timeline(acts, 8, links, 7, 42, &tl), 0);
  EXPECT(tl == NULL);
  const bench_ktime_overlap_t none = bench_ktime_overlap(NULL, 0, class_by_name);
  EXPECT(none.span_ns == 0 && none.busy_ns[0] == 0 && none.both_ns == 0);
  return TEST_PASS;
}

EPX_HOST_TEST(cupti_candidates_order, 10) {
  char root[] = "/tmp/epx_test_cupti_XXXXXX";
  EXPECT(mkdtemp(root) != NULL);
  const int rc = check_search(root);
  char cmd[64];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  EXPECT(system(cmd) == 0);
  return rc;
}
