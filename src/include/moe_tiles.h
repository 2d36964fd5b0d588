/*
 * moe_tiles.h - how EPX's grouped FP8 GEMM (src/kernels/moe_gemm_fp8.cu) cuts an expert's
 * segment of s rows into token tiles, and which tile width and height a launch runs at. A launch
 * computes every tile at one width `cap` (64, 96, 128 or 160 rows: EPX__MOE_TILE_X_WIDTHS); a
 * segment is cut into ceil(s / cap) tiles: at the usual width (x's rows as wgmma's M) cap rows
 * each but the last; at the others (x's rows as wgmma's N) of equal size, a multiple of 8 rows and
 * at most cap, the last one shorter where s is not a multiple of that size
 * (epx__moe_x_tile_rows: the kernel's find_tile applies it only there). Shared by the kernel,
 * the layer's FFN (src/moe_ffn.c, which picks the width from the host's counts, then the height),
 * epx_moe_gemm_bench and their host test (tests/host/test_moe_prefill_plan.c). Pure.
 */
#ifndef EPX_SRC_MOE_TILES_H_
#define EPX_SRC_MOE_TILES_H_

#ifdef __CUDACC__
#define EPX__HOST_DEVICE __host__ __device__
#else
#define EPX__HOST_DEVICE
#endif

#define EPX__MOE_TILE_X 128      /* rows of x of a tile, at most: the usual width */
#define EPX__MOE_TILE_X_WIDE 160 /* the wide one (a bigger shared-memory ring stage) */
#define EPX__MOE_TILE_X_MIN 64   /* the narrowest: segments of a few dozen rows */
/* Every width a launch may run at, narrowest first (each is a kernel of its own), and what a
 * column costs at it relative to the usual width (epx__moe_pick_tile_x weighs the columns by it).
 * The usual width runs x's rows as wgmma's M, which makes its promotion read 2 scale products a
 * thread instead of one per column (moe_gemm_fp8.cu); the others run them as N. Measured in SM
 * cycles on even segments (epx_moe_gemm_bench, 2x H200, session 27: the other widths' cycles of
 * one call against the new 128's of another; docs/moe.md, "x's rows as M"): a column at 64 costs
 * 1.32-1.56x one at 128, at 96 1.14-1.35x, at 160 (one weight block) 1.10-1.28x. */
#define EPX__MOE_TILE_X_COUNT 4
#define EPX__MOE_TILE_X_WIDTHS \
  { 64, 96, 128, 160 }
#define EPX__MOE_TILE_X_COST_PERMILLE \
  { 1400, 1200, 1000, 1150 }

#define EPX__MOE_TILE_W 128      /* weight rows of a tile: one block of 128 (the block scales') */
#define EPX__MOE_TILE_W_TALL 256 /* two blocks: at widths up to 128, n a multiple of 256 */

/* Whether the kernel has width tile_x (one of EPX__MOE_TILE_X_WIDTHS). */
static inline EPX__HOST_DEVICE int epx__moe_tile_x_known(int tile_x) {
  const int widths[EPX__MOE_TILE_X_COUNT] = EPX__MOE_TILE_X_WIDTHS;
  for (int i = 0; i < EPX__MOE_TILE_X_COUNT; i++)
    if (tile_x == widths[i]) return 1;
  return 0;
}

/* Whether a launch may run tiles of tile_w weight rows at width tile_x on n weight rows (the tall
 * tile's registers fit up to the usual width). */
static inline EPX__HOST_DEVICE int epx__moe_tile_w_fits(int tile_w, int n, int tile_x) {
  if (!epx__moe_tile_x_known(tile_x)) return 0;
  if (tile_w == EPX__MOE_TILE_W) return n % EPX__MOE_TILE_W == 0;
  return tile_w == EPX__MOE_TILE_W_TALL && tile_x <= EPX__MOE_TILE_X && n % tile_w == 0;
}

/* Rows of each token tile of a segment of s > 0 rows, tiles of at most cap rows. */
static inline EPX__HOST_DEVICE int epx__moe_x_tile_rows(int s, int cap) {
  const int n = (s + cap - 1) / cap;
  const int per = ((s + n - 1) / n + 7) / 8 * 8;
  return per < cap ? per : cap;
}

/* Token tiles of a segment of s rows (0 for s <= 0). */
static inline EPX__HOST_DEVICE int epx__moe_x_tiles(int s, int cap) {
  if (s <= 0) return 0;
  const int per = epx__moe_x_tile_rows(s, cap);
  return (s + per - 1) / per;
}

/* The width a launch over segments [begin[j], begin[j + 1]), j < L, runs at, among the widths
 * whose bit is set in `allowed` (bit i: EPX__MOE_TILE_X_WIDTHS[i]; 0 or none known: the usual
 * width): the one that computes the fewest columns in all (tiles x width: each tile streams its
 * weight rows once per column block of the width, and a tile's unused columns are computed too),
 * each column weighed by its width's cost; the usual width on a tie, then the wider. Segments of
 * 129-160 rows (DeepSeek-V3's experts in a chunk of 2048 tokens at 2 ranks) are two tiles of 128
 * but one of 160; segments of 257-288 rows (a chunk of 2048 tokens at 4 ranks) three of 96. */
static inline int epx__moe_pick_tile_x_among(const int *begin, int L, unsigned allowed) {
  static const int widths[EPX__MOE_TILE_X_COUNT] = EPX__MOE_TILE_X_WIDTHS;
  static const int cost[EPX__MOE_TILE_X_COUNT] = EPX__MOE_TILE_X_COST_PERMILLE;
  long long best = -1;
  int pick = EPX__MOE_TILE_X;
  for (int i = EPX__MOE_TILE_X_COUNT - 1; i >= 0; i--) { /* widest first: it wins a tie */
    if (!(allowed & (1u << i))) continue;
    long long columns = 0;
    for (int j = 0; j < L; j++)
      columns += (long long)epx__moe_x_tiles(begin[j + 1] - begin[j], widths[i]) * widths[i];
    const long long weighed = columns * cost[i];
    if (best < 0 || weighed < best || (weighed == best && widths[i] == EPX__MOE_TILE_X))
      best = weighed, pick = widths[i];
  }
  return pick;
}
static inline int epx__moe_pick_tile_x(const int *begin, int L) {
  return epx__moe_pick_tile_x_among(begin, L, (1u << EPX__MOE_TILE_X_COUNT) - 1);
}

/* The tile height a launch at width tile_x runs: the tall tile wherever it fits (two weight
 * blocks a tile: 1-6% fewer cycles than one at every point of epx_moe_gemm_bench, 1x H200,
 * docs/moe.md "The tall tile"; the widths up to the usual one). The width is picked first: where
 * the wide width computes fewer columns, that saves more than the tall tile would. */
static inline int epx__moe_pick_tile_w(int n, int tile_x) {
  return epx__moe_tile_w_fits(EPX__MOE_TILE_W_TALL, n, tile_x) ? EPX__MOE_TILE_W_TALL
                                                               : EPX__MOE_TILE_W;
}

#endif /* EPX_SRC_MOE_TILES_H_ */
