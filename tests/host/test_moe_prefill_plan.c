/*
 * test_moe_prefill_plan.c - host tests of the prefill MoE layer's pure host parts
 * (src/moe_prefill.c): the chunk split (every token in exactly one chunk, in order, sizes
 * within one of each other, the largest ceil(T / n)), the workspace layout (regions 256-byte
 * aligned, disjoint, each as large as its formula, FP8 regions only with FP8 weights), the
 * batched GEMM's block rows, the grouped FP8 GEMM's token tiles (src/include/moe_tiles.h) and
 * its launcher's refusals of tile shapes it has no kernel for, the refusals that need no GPU,
 * which FP8 backend AUTO picks, and the phases' rows (EPX_MOE_OVERLAP_PHASES).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/runner.h"
#include "epx.h"
#include "kernels/api.h"
#include "moe_prefill.h"
#include "moe_tiles.h"

EPX_HOST_TEST(moe_prefill_chunks_cover_the_tokens, 10) {
  for (int T = 0; T <= 70; T++)
    for (int n = 1; n <= EPX__MOE_MAX_CHUNKS; n++) {
      int next = 0, largest = 0, smallest = 1 << 30;
      for (int c = 0; c < n; c++) {
        int first = -1, count = -1;
        epx__moe_chunk(T, n, c, &first, &count);
        EXPECTF(first == next && count >= 0, "T %d n %d chunk %d: first %d count %d, next %d", T, n,
                c, first, count, next);
        next += count;
        if (count > largest) largest = count;
        if (count < smallest) smallest = count;
      }
      EXPECTF(next == T, "T %d n %d: chunks cover %d tokens", T, n, next);
      EXPECTF(largest == (T + n - 1) / n && largest - smallest <= 1, "T %d n %d: sizes %d..%d", T,
              n, smallest, largest);
    }
  return TEST_PASS;
}

/* [a, a + n) and [b, b + m) are disjoint. */
static int disjoint(size_t a, size_t n, size_t b, size_t m) {
  return n == 0 || m == 0 || a + n <= b || b + m <= a;
}

EPX_HOST_TEST(moe_prefill_workspace_regions, 10) {
  const size_t rows = 1000;
  const int H = 7168, I = 2048;
  static const int lanes_tried[] = {1, 3, EPX__MOE_MAX_LANES};
  for (int fp8 = 0; fp8 < 2; fp8++)
    for (int fp32 = 0; fp32 < 2; fp32++)
      for (int li = 0; li < 6; li++) {
        const int lanes = lanes_tried[li % 3];
        /* FP8 on the wire (li >= 3): a chunk's tokens staged, no xq copy */
        const size_t send = fp8 && li >= 3 ? 300 : 0;
        const epx__moe_ws_layout_t l =
            epx__moe_ws_layout(EPX_MOE_FFN_CUBLAS, fp8, fp32, lanes, rows, H, I, 0, send);
        const size_t off[] = {l.y[0], l.y[1], l.gu,   l.h,    l.hs,
                              l.xq,   l.xs,   l.blas, l.send, l.send_s};
        const size_t len[] = {rows * H * 2,
                              rows * H * 2,
                              rows * 2 * I * (fp8 && fp32 ? 4 : 2),
                              rows * I * (fp8 ? 1 : 2),
                              fp8 ? rows * (I / 128) * 4 : 0,
                              fp8 && !send ? rows * H : 0,
                              fp8 ? rows * (H / 128) * 4 : 0,
                              (size_t)lanes * EPX__MOE_BLAS_WS, /* a slice per lane */
                              send * H,
                              send * (H / 128) * 4};
        const int n = (int)(sizeof off / sizeof off[0]);
        for (int i = 0; i < n; i++) {
          EXPECTF(off[i] % 256 == 0, "fp8 %d region %d at %zu", fp8, i, off[i]);
          EXPECTF(off[i] + len[i] <= l.total, "fp8 %d region %d past the total", fp8, i);
          for (int j = i + 1; j < n; j++)
            EXPECTF(disjoint(off[i], len[i], off[j], len[j]), "fp8 %d regions %d and %d overlap",
                    fp8, i, j);
        }
      }
  const epx__moe_ws_layout_t e = epx__moe_ws_layout(EPX_MOE_FFN_EPX, 1, 0, 1, rows, H, I, 12345, 0);
  EXPECT(e.ffn >= 2 * rows * H * 2 && e.ffn % 256 == 0 && e.ffn + 12345 <= e.total);
  return TEST_PASS;
}

/* Each expert goes to the lane with the fewest rows so far (the first such lane on ties). */
EPX_HOST_TEST(moe_prefill_lanes_balance_rows, 10) {
  static const int count[] = {500, 10, 10, 10, 480, 0, -3, 20};
  int lane[8];
  epx__moe_assign_lanes(count, 8, 3, lane);
  /* loads after each expert: [500,0,0] [500,10,0] [500,10,10] [500,20,10] (tie: the first)
   * [500,20,490] [500,20,490] (0 rows) [500,20,490] (negative: none) [500,40,490] */
  static const int want[] = {0, 1, 2, 1, 2, 1, 1, 1};
  for (int j = 0; j < 8; j++)
    EXPECTF(lane[j] == want[j], "expert %d: lane %d, want %d", j, lane[j], want[j]);
  epx__moe_assign_lanes(count, 8, 1, lane);
  for (int j = 0; j < 8; j++) EXPECT(lane[j] == 0);
  epx__moe_assign_lanes(count, 8, 0, lane); /* below 1: one lane */
  for (int j = 0; j < 8; j++) EXPECT(lane[j] == 0);
  epx__moe_assign_lanes(count, 8, 99, lane); /* above the maximum: clamped */
  for (int j = 0; j < 8; j++) EXPECT(lane[j] >= 0 && lane[j] < EPX__MOE_MAX_LANES);
  return TEST_PASS;
}

EPX_HOST_TEST(moe_prefill_refuses_without_a_gpu, 10) {
  epx_moe_prefill_t p = (epx_moe_prefill_t)1;
  epx_experts_t ex = EPX_EXPERTS_INIT;
  EXPECT_STATUS(epx_moe_prefill_create(NULL, 2, &ex, NULL, &p), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "groups") != NULL);
  EXPECT(p == NULL);
  EXPECT_STATUS(epx_moe_prefill_create(NULL, 2, &ex, NULL, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "plan") != NULL);
  epx_group_t g[2] = {NULL, NULL};
  EXPECT_STATUS(epx_moe_prefill_create(g, 0, &ex, NULL, &p), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "num_groups") != NULL);
  EXPECT_OK(epx_moe_prefill_destroy(NULL));
  size_t bytes = 0;
  EXPECT_STATUS(epx_moe_prefill_workspace_size(NULL, &bytes), EPX_ERR_INVALID_ARGUMENT);
  epx_moe_prefill_info_t info = EPX_MOE_PREFILL_INFO_INIT;
  EXPECT_STATUS(epx_moe_prefill_get_info(NULL, &info), EPX_ERR_INVALID_ARGUMENT);
  epx_moe_prefill_args_t a = EPX_MOE_PREFILL_ARGS_INIT;
  EXPECT_STATUS(epx_moe_prefill(NULL, &a, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "plan") != NULL);
  /* A pointer that was never a plan is refused, not dereferenced. */
  epx_moe_prefill_t fake = (epx_moe_prefill_t)&a;
  EXPECT_STATUS(epx_moe_prefill(fake, &a, NULL), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_moe_prefill_destroy(fake), EPX_ERR_INVALID_USAGE);
  return TEST_PASS;
}

/* The batched GEMM's block (EPX_MOE_FFN_CUBLAS_GROUPED): the largest count rounded up to 16, or
 * 0 (one GEMM per expert) when a bound would be passed. begin: the segments as the dispatch
 * makes them (each count rounded up to 4). */
static int block_rows_of(const int *count, int L, size_t scratch, size_t input) {
  int begin[EPX_MAX_EXPERTS + 1];
  begin[0] = 0;
  for (int j = 0; j < L; j++) begin[j + 1] = begin[j] + (count[j] > 0 ? (count[j] + 3) / 4 * 4 : 0);
  return epx__moe_block_rows(count, begin, L, scratch, input);
}

EPX_HOST_TEST(moe_prefill_batched_block_rows, 10) {
  enum { L = 64 };
  int count[L];
  const size_t big = 1u << 30;
  for (int j = 0; j < L; j++) count[j] = 250 + j % 7; /* DeepSeek-like, one chunk: 250..256 */
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 256);
  count[5] = 257; /* rounded up to 16 */
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 272);
  /* the scratch holds L blocks exactly, then one row less */
  EXPECT_EQ_INT(block_rows_of(count, L, (size_t)L * 272, big), 272);
  EXPECT_EQ_INT(block_rows_of(count, L, (size_t)L * 272 - 1, big), 0);
  /* the last block's reads: begin[L - 1] + 272 rows of input, then one row less */
  int begin_last = 0;
  for (int j = 0; j < L - 1; j++) begin_last += (count[j] + 3) / 4 * 4;
  EXPECT_EQ_INT(block_rows_of(count, L, big, (size_t)begin_last + 272), 272);
  EXPECT_EQ_INT(block_rows_of(count, L, big, (size_t)begin_last + 271), 0);
  /* padding: 50% more rows than the real ones is the limit */
  for (int j = 0; j < L; j++) count[j] = j < L / 2 ? 32 : 16; /* 1536 real, 64 x 32 = 2048 */
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 32);
  count[0] = 48; /* 1552 real, 64 x 48 = 3072: 98% more */
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 0);
  /* one expert with every row; none with any; empty and -1 counts among others */
  memset(count, 0, sizeof count);
  count[9] = 1000;
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 0);
  count[9] = 0;
  EXPECT_EQ_INT(block_rows_of(count, L, big, big), 0);
  for (int j = 0; j < 3; j++) count[j] = j == 1 ? -1 : 5; /* three experts: 10 real, 3 x 16 */
  EXPECT_EQ_INT(block_rows_of(count, 3, big, big), 0);
  count[1] = 6; /* 16 real rows, 48 in blocks: 200% more */
  EXPECT_EQ_INT(block_rows_of(count, 3, big, big), 0);
  for (int j = 0; j < 3; j++) count[j] = 15 + j; /* 48 real, 3 x 32 = 96: 100% more */
  EXPECT_EQ_INT(block_rows_of(count, 3, big, big), 0);
  for (int j = 0; j < 3; j++) count[j] = 30 + j; /* 93 real, 3 x 32 = 96 */
  EXPECT_EQ_INT(block_rows_of(count, 3, big, big), 32);
  return TEST_PASS;
}

/* The grouped FP8 GEMM's token tiles of a segment of s rows, for every s a prefill chunk can
 * give an expert here, at every width (cap 64, 96, 128 and 160): ceil(s / cap) tiles (the fewest of
 * at most cap rows), each a multiple of 8 rows (wgmma's N steps) and at most cap, together exactly
 * s rows, none empty, and none more than 8 rows past the even split (the kernel's tiles at every
 * width but the usual one, where it takes cap rows a tile but the last: the same count); and the
 * width a launch picks from its segments, and the height from n and the width. */
EPX_HOST_TEST(moe_grouped_gemm_token_tiles, 10) {
  static const int caps[] = EPX__MOE_TILE_X_WIDTHS;
  EXPECT_EQ_INT(epx__moe_x_tiles(0, EPX__MOE_TILE_X), 0);
  EXPECT_EQ_INT(epx__moe_x_tiles(-4, EPX__MOE_TILE_X_WIDE), 0);
  EXPECT_EQ_INT(epx__moe_x_tile_rows(257, EPX__MOE_TILE_X), 88); /* the even split of 257 */
  EXPECT_EQ_INT(epx__moe_x_tiles(257, EPX__MOE_TILE_X), 3);
  EXPECT_EQ_INT(epx__moe_x_tile_rows(257, EPX__MOE_TILE_X_WIDE), 136);
  EXPECT_EQ_INT(epx__moe_x_tiles(257, EPX__MOE_TILE_X_WIDE), 2);
  EXPECT_EQ_INT(epx__moe_x_tile_rows(512, EPX__MOE_TILE_X), 128);
  EXPECT_EQ_INT(epx__moe_x_tiles(140, EPX__MOE_TILE_X_WIDE), 1);
  for (int ci = 0; ci < EPX__MOE_TILE_X_COUNT; ci++)
    for (int s = 1; s <= 20000; s++) {
      const int cap = caps[ci];
      const int per = epx__moe_x_tile_rows(s, cap), n = epx__moe_x_tiles(s, cap);
      const int fewest = (s + cap - 1) / cap;
      EXPECTF(per % 8 == 0 && per >= 8 && per <= cap, "cap %d, s %d: tile rows %d", cap, s, per);
      EXPECTF(n == fewest, "cap %d, s %d: %d tiles, want %d", cap, s, n, fewest);
      EXPECTF((n - 1) * per < s && n * per >= s, "cap %d, s %d: %d tiles of %d rows", cap, s, n,
              per);
      EXPECTF(per <= (s + n - 1) / n + 7, "cap %d, s %d: %d rows a tile, even split %d", cap, s,
              per, (s + n - 1) / n);
    }
  /* The width: the fewest columns computed in all (tiles x width), each weighed by its width's
   * cost (moe_tiles.h: 64 1.4, 96 1.2, 128 1, 160 1.15); 128 on a tie. */
  const int chunk[] = {0, 120, 264, 400, 540}; /* 120, 144, 136, 140: one tile each at 160 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(chunk, 4), EPX__MOE_TILE_X_WIDE); /* 640 x 1.15 against 896 */
  const int whole[] = {0, 512, 1024}; /* 512 rows twice: 4 x 128 against 4 x 160 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(whole, 2), EPX__MOE_TILE_X);
  const int some[] = {0, 256, 256, 416}; /* 256, none, 160: 512 against (320 + 160) x 1.15 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(some, 3), EPX__MOE_TILE_X);
  /* a tie with 160: 7 segments of 160 and 9 of 128, 2944 columns at 128 against 2560 x 1.15 */
  int tie[17] = {0};
  for (int j = 0; j < 16; j++) tie[j + 1] = tie[j] + (j < 7 ? 160 : 128);
  EXPECT_EQ_INT(epx__moe_pick_tile_x(tie, 16), EPX__MOE_TILE_X);
  EXPECT_EQ_INT(epx__moe_pick_tile_x(whole, 0), EPX__MOE_TILE_X); /* no experts */
  const int few[] = {0, 40, 76, 136}; /* 40, 36, 60: 3 x 64 x 1.4 against 3 x 96 x 1.2 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(few, 3), EPX__MOE_TILE_X_MIN);
  const int pair[] = {0, 128, 256}; /* 128 twice: 2 x 128 against 4 x 64 x 1.4 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(pair, 2), EPX__MOE_TILE_X);
  const int thirds[] = {0, 264, 524, 796}; /* 264, 260, 272: 9 x 96 x 1.2 = 1037 against
                                               6 x 160 x 1.15 = 1104 and 9 x 128 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(thirds, 3), 96);
  /* the weights pinned, each by a case its margin flips: 160 wins "chunk" below 1.4, loses
   * "some" above 1.07 and "thirds" (to 96) above 1.08; 96 wins "w64" below 1.245 (against 64's
   * 1.4) and loses "w96" above 1.07; 64 loses "w64" to 96 above 1.35 and "w64b" to 128 above 1.2,
   * and wins "few" below 1.8 */
  const int w96[] = {0, 4, 328}; /* 4, 324: 512 columns at 128 against 480 x 1.2 at 96 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(w96, 2), EPX__MOE_TILE_X);
  const int w64[] = {0, 4, 136}; /* 4, 132: 288 x 1.2 at 96 against 256 x 1.4 at 64 and 384 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(w64, 2), 96);
  const int w64b[] = {0, 4, 200}; /* 4, 196: 384 at 128 against 320 x 1.4 at 64 */
  EXPECT_EQ_INT(epx__moe_pick_tile_x(w64b, 2), EPX__MOE_TILE_X);
  /* every width the picker may return, the launcher knows */
  static const int widths[] = EPX__MOE_TILE_X_WIDTHS;
  for (int i = 0; i < EPX__MOE_TILE_X_COUNT; i++)
    EXPECTF(epx__moe_tile_x_known(widths[i]), "width %d unknown to the launcher", widths[i]);
  /* only the allowed widths; none allowed: the usual one */
  EXPECT_EQ_INT(epx__moe_pick_tile_x_among(thirds, 3, 1u << 3), EPX__MOE_TILE_X_WIDE);
  EXPECT_EQ_INT(epx__moe_pick_tile_x_among(few, 3, 0), EPX__MOE_TILE_X);
  /* The height: two weight blocks where n holds whole pairs of them, at widths up to 128 */
  EXPECT_EQ_INT(epx__moe_pick_tile_w(4096, EPX__MOE_TILE_X), EPX__MOE_TILE_W_TALL);
  EXPECT_EQ_INT(epx__moe_pick_tile_w(4096, 96), EPX__MOE_TILE_W_TALL);
  EXPECT_EQ_INT(epx__moe_pick_tile_w(512, EPX__MOE_TILE_X_MIN), EPX__MOE_TILE_W_TALL);
  EXPECT_EQ_INT(epx__moe_pick_tile_w(384, 96), EPX__MOE_TILE_W);
  EXPECT_EQ_INT(epx__moe_tile_w_fits(EPX__MOE_TILE_W, 512, 112), 0); /* no such width */
  EXPECT_EQ_INT(epx__moe_pick_tile_w(1536, EPX__MOE_TILE_X), EPX__MOE_TILE_W_TALL);
  EXPECT_EQ_INT(epx__moe_pick_tile_w(384, EPX__MOE_TILE_X), EPX__MOE_TILE_W);
  EXPECT_EQ_INT(epx__moe_pick_tile_w(4096, EPX__MOE_TILE_X_WIDE), EPX__MOE_TILE_W);
  EXPECT_EQ_INT(epx__moe_tile_w_fits(EPX__MOE_TILE_W, 384, EPX__MOE_TILE_X_WIDE), 1);
  EXPECT_EQ_INT(epx__moe_tile_w_fits(EPX__MOE_TILE_W, 200, EPX__MOE_TILE_X), 0);
  EXPECT_EQ_INT(epx__moe_tile_w_fits(EPX__MOE_TILE_W_TALL, 384, EPX__MOE_TILE_X), 0);
  EXPECT_EQ_INT(epx__moe_tile_w_fits(192, 384, EPX__MOE_TILE_X), 0);
  return TEST_PASS;
}

/* The grouped FP8 GEMM's launcher refuses a tile shape it has no kernel for, before it touches
 * the GPU (an internal error: the layer picks through moe_tiles.h); shapes it has, with no rows,
 * return at once. */
EPX_HOST_TEST(moe_gemm_fp8_launch_refusals, 10) {
  epx__moe_gemm_fp8_args_t a;
  memset(&a, 0, sizeof a);
  a.n = 512, a.k = 256, a.num_experts = 2, a.w_stride = 512 * 256, a.ws_kb = 4, a.ws_stride = 16;
  a.num_ctas = 1, a.x_rows = 0;
  static const int good[][2] = {{EPX__MOE_TILE_X, 0},
                                {EPX__MOE_TILE_X, EPX__MOE_TILE_W},
                                {EPX__MOE_TILE_X_WIDE, EPX__MOE_TILE_W},
                                {EPX__MOE_TILE_X, EPX__MOE_TILE_W_TALL},
                                {64, EPX__MOE_TILE_W},
                                {64, EPX__MOE_TILE_W_TALL},
                                {96, EPX__MOE_TILE_W},
                                {96, EPX__MOE_TILE_W_TALL}};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    a.tile_x = good[i][0], a.tile_w = good[i][1];
    EXPECT_OK(epx__moe_gemm_fp8_launch(&a, NULL));
  }
  static const int bad[][2] = {{112, EPX__MOE_TILE_W}, {32, EPX__MOE_TILE_W},
                               {0, EPX__MOE_TILE_W},   {EPX__MOE_TILE_X_WIDE, EPX__MOE_TILE_W_TALL},
                               {EPX__MOE_TILE_X, 192}, {EPX__MOE_TILE_X, 512}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    a.tile_x = bad[i][0], a.tile_w = bad[i][1];
    EXPECT_STATUS(epx__moe_gemm_fp8_launch(&a, NULL), EPX_ERR_INTERNAL);
    EXPECT(strstr(epx_last_error(), "weight rows") != NULL);
  }
  a.n = 384, a.w_stride = 384 * 256, a.tile_x = EPX__MOE_TILE_X; /* three weight blocks */
  a.tile_w = EPX__MOE_TILE_W_TALL;
  EXPECT_STATUS(epx__moe_gemm_fp8_launch(&a, NULL), EPX_ERR_INTERNAL);
  a.tile_w = EPX__MOE_TILE_W;
  EXPECT_OK(epx__moe_gemm_fp8_launch(&a, NULL));
  /* BF16 outputs leave through 16-byte stores (the staged store): y must be 16-byte aligned;
   * float32 ones are stored an element at a time */
  a.y = (void *)(uintptr_t)8;
  EXPECT_STATUS(epx__moe_gemm_fp8_launch(&a, NULL), EPX_ERR_INTERNAL);
  EXPECT(strstr(epx_last_error(), "BF16 outputs") != NULL);
  a.y_fp32 = 1;
  EXPECT_OK(epx__moe_gemm_fp8_launch(&a, NULL));
  return TEST_PASS;
}

/* AUTO's FP8 choice at the shapes it was measured on (docs/moe.md, "Which FFN AUTO runs"):
 * 4096 tokens a rank, two chunks. Qwen3-30B-A3B's experts at 2, 4 (and, not measured, 8) ranks
 * and DeepSeek-V3's at 2 take EPX's grouped GEMM; DeepSeek-V3's at 4 (and 8) cuBLASLt. Rows an
 * expert gets in a chunk: Qwen3 256, 512, 1024; DeepSeek 128, 256, 512. */
EPX_HOST_TEST(moe_prefill_auto_fp8_backend, 10) {
  static const struct {
    int ranks, experts, hidden, intermediate, grouped;
  } shapes[] = {{2, 128, 2048, 768, 1},  {4, 128, 2048, 768, 1},  {8, 128, 2048, 768, 1},
                {2, 256, 7168, 2048, 1}, {4, 256, 7168, 2048, 0}, {8, 256, 7168, 2048, 0}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const int got = epx__moe_auto_grouped_fp8(4096, shapes[i].ranks, 8, shapes[i].experts, 2,
                                              shapes[i].hidden, shapes[i].intermediate);
    EXPECTF(got == shapes[i].grouped, "%d ranks, %d experts of %d x %d: grouped %d, want %d",
            shapes[i].ranks, shapes[i].experts, shapes[i].hidden, shapes[i].intermediate, got,
            shapes[i].grouped);
  }
  /* fewer tokens or more chunks: smaller GEMMs, the grouped one; small test shapes too */
  EXPECT(epx__moe_auto_grouped_fp8(1024, 4, 8, 256, 2, 7168, 2048) == 1);
  EXPECT(epx__moe_auto_grouped_fp8(4096, 4, 8, 256, 4, 7168, 2048) == 1);
  EXPECT(epx__moe_auto_grouped_fp8(64, 4, 4, 16, 2, 256, 256) == 1);
  EXPECT(epx__moe_auto_grouped_fp8(0, 2, 8, 256, 2, 7168, 2048) == 1);
  return TEST_PASS;
}

/* The phases' rows: a known answer, then random counts (every part at a multiple of 4, as long
 * as its count rounded up, sources one after another, experts in order within a source). */
EPX_HOST_TEST(moe_prefill_phase_rows, 10) {
  /* L 2, R 2: expert 0 gets 1 row from source 0 and 4 from source 1; expert 1 0 and 5 */
  const int known[4] = {1, 4, 0, 5};
  int pb[2 * 3];
  EXPECT_EQ_INT(epx__moe_phase_rows(known, 2, 2, pb), 16);
  const int want[6] = {0, 4, 4, 4, 8, 16};
  for (int i = 0; i < 6; i++) EXPECT_EQ_INT(pb[i], want[i]);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  static int by[EPX_MAX_EXPERTS], begin[EPX_MAX_RANKS * (EPX_MAX_EXPERTS + 1)];
  for (int round = 0; round < 200; round++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int R = 1 + (int)(x >> 60) % EPX_MAX_RANKS, L = 1 + (int)((x >> 40) % 128);
    int total = 0;
    for (int i = 0; i < L * R; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      by[i] = (x >> 59) < 4 ? 0 : (int)((x >> 33) % 700); /* some empty parts */
      total += (by[i] + 3) / 4 * 4;
    }
    EXPECT_EQ_INT(epx__moe_phase_rows(by, L, R, begin), total);
    int row = 0;
    for (int s = 0; s < R; s++)
      for (int j = 0; j <= L; j++) {
        EXPECTF(begin[s * (L + 1) + j] == row && row % 4 == 0,
                "round %d, L %d, R %d: source %d, expert %d begins at %d, want %d", round, L, R, s,
                j, begin[s * (L + 1) + j], row);
        if (j < L) row += (by[j * R + s] + 3) / 4 * 4;
      }
    EXPECT_EQ_INT(row, total);
  }
  return TEST_PASS;
}
