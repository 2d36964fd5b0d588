/*
 * moe_tiles.h - how EPX's grouped FP8 GEMM (src/kernels/moe_gemm_fp8.cu) cuts an expert's
 * segment of s rows into token tiles: ceil(s / EPX__MOE_TILE_X) tiles of equal size, a multiple
 * of 8 rows (wgmma's N steps) and at most EPX__MOE_TILE_X, the last one shorter where s is not
 * a multiple of that size. Shared by the kernel and its host test
 * (tests/host/test_moe_prefill_plan.c). Pure.
 */
#ifndef EPX_SRC_MOE_TILES_H_
#define EPX_SRC_MOE_TILES_H_

#ifdef __CUDACC__
#define EPX__HOST_DEVICE __host__ __device__
#else
#define EPX__HOST_DEVICE
#endif

#define EPX__MOE_TILE_X 128 /* rows of x of a tile, at most */

/* Rows of each token tile of a segment of s > 0 rows. */
static inline EPX__HOST_DEVICE int epx__moe_x_tile_rows(int s) {
  const int n = (s + EPX__MOE_TILE_X - 1) / EPX__MOE_TILE_X;
  const int per = ((s + n - 1) / n + 7) / 8 * 8;
  return per < EPX__MOE_TILE_X ? per : EPX__MOE_TILE_X;
}

/* Token tiles of a segment of s rows (0 for s <= 0). */
static inline EPX__HOST_DEVICE int epx__moe_x_tiles(int s) {
  if (s <= 0) return 0;
  const int per = epx__moe_x_tile_rows(s);
  return (s + per - 1) / per;
}

#endif /* EPX_SRC_MOE_TILES_H_ */
