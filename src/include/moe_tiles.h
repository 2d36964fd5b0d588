/*
 * moe_tiles.h - how EPX's grouped FP8 GEMM (src/kernels/moe_gemm_fp8.cu) cuts an expert's
 * segment of s rows into token tiles, and which tile width and height a launch runs at. A launch
 * runs every tile at one wgmma width `cap` (EPX__MOE_TILE_X or EPX__MOE_TILE_X_WIDE rows); a
 * segment is cut into ceil(s / cap) tiles of equal size, a multiple of 8 rows (wgmma's N steps) and
 * at most cap, the last one shorter where s is not a multiple of that size. Shared by the kernel,
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

#define EPX__MOE_TILE_X 128      /* rows of x of a tile, at most: the narrow width */
#define EPX__MOE_TILE_X_WIDE 160 /* the wide one (a bigger shared-memory ring stage) */

#define EPX__MOE_TILE_W 128      /* weight rows of a tile: one block of 128 (the block scales') */
#define EPX__MOE_TILE_W_TALL 256 /* two blocks: only at the narrow width, n a multiple of 256 */

/* Whether a launch may run tiles of tile_w weight rows at width tile_x on n weight rows. */
static inline EPX__HOST_DEVICE int epx__moe_tile_w_fits(int tile_w, int n, int tile_x) {
  if (tile_w == EPX__MOE_TILE_W) return n % EPX__MOE_TILE_W == 0;
  return tile_w == EPX__MOE_TILE_W_TALL && tile_x == EPX__MOE_TILE_X && n % tile_w == 0;
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

/* The width a launch over segments [begin[j], begin[j + 1]), j < L, runs at: the one that
 * computes fewer columns in all (tiles x width: each tile streams its weight rows once per
 * column block of the width, and a tile's unused columns are computed too); the narrow one on
 * a tie. Segments of 129-160 rows (DeepSeek-V3's experts in a chunk of 2048 tokens at 2 ranks)
 * are two narrow tiles but one wide one. */
static inline int epx__moe_pick_tile_x(const int *begin, int L) {
  long long narrow = 0, wide = 0;
  for (int j = 0; j < L; j++) {
    const int s = begin[j + 1] - begin[j];
    narrow += (long long)epx__moe_x_tiles(s, EPX__MOE_TILE_X) * EPX__MOE_TILE_X;
    wide += (long long)epx__moe_x_tiles(s, EPX__MOE_TILE_X_WIDE) * EPX__MOE_TILE_X_WIDE;
  }
  return wide < narrow ? EPX__MOE_TILE_X_WIDE : EPX__MOE_TILE_X;
}

/* The tile height a launch at width tile_x runs: the tall tile wherever it fits (two weight
 * blocks a tile: 1-6% fewer cycles than one at every point of epx_moe_gemm_bench, 1x H200,
 * docs/moe.md "The tall tile"). The width is picked first: where the wide width computes fewer
 * columns, that saves more than the tall tile would. */
static inline int epx__moe_pick_tile_w(int n, int tile_x) {
  return epx__moe_tile_w_fits(EPX__MOE_TILE_W_TALL, n, tile_x) ? EPX__MOE_TILE_W_TALL
                                                               : EPX__MOE_TILE_W;
}

#endif /* EPX_SRC_MOE_TILES_H_ */
