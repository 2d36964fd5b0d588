/*
 * moe_gemm_fp8.cu - the prefill layer's grouped FP8 GEMM (docs/moe.md, "MoE layer at prefill"):
 * one launch runs a projection for every local expert of a chunk, y_j = x_j w_j^T on expert j's
 * segment of the expert-major rows, with DeepSeek-V3's block scales (128 x 128 on the weights,
 * 1 x 128 on the rows), reading the segments' bounds from device memory. It replaces one
 * cuBLASLt call per expert: those left most SMs idle (an expert's GEMM at prefill is a few
 * dozen tiles), split K to fill them, and cost the host ~10 us each (docs/moe.md).
 *
 * Tiles: 128 weight rows (one block of the block scales) by kTileX rows of x, 64, 96, 128 or 160
 * (the caller picks: moe_tiles.h; the width is a template argument: a switch over it inside the
 * kernel made ptxas serialize its wgmmas); or, at widths up to 128, the tall tile of 256 weight
 * rows (kHalves 2), which the caller picks where n allows it. At the usual width (128) x's rows
 * are wgmma's M: warpgroup wg takes rows [64 wg, 64 wg + 64) of the tile (A) against each weight
 * block (B, N 128), and its promotion reads two scale products a thread (run_tile_rows_m). At the
 * other widths the weights are A ("swap AB": each warpgroup one m64 of each weight block) and x's
 * rows N, every tile at wgmma N kTileX, so a promotion reads one product per column (run_tile);
 * those loads share the shared-memory pipe with the wgmmas' operand reads (at width 128, turning
 * x's rows into M took 9-21% of the kernel's cycles away: docs/moe.md, "x's rows as M"). Rows
 * past a tile's are computed and not stored.
 * An expert's segment of S rows is cut into ceil(S / kTileX) token tiles: at the usual width
 * kTileX rows each but the last (260 rows: 128, 128 and 4, each computed whole); at the others of
 * equal size, a multiple of 8 (260 rows at 96: 88, 88 and 84).
 * Tile order: expert, then weight tile, then token tile, so the token tiles that share a weight
 * tile run at about the same time and the weights come from HBM once.
 *
 * Warp-specialized: a producer warpgroup (one thread issues the copies) fills a ring of 6 slots
 * (5 at width 160, 4 for the tall tile), and another of its warps, the scaler, writes each
 * stage's products of weight block scale and x row scale once the copies land ("ready"
 * mbarrier; 6-10% fewer cycles at gate/up, measured: the promotions then load and multiply-add
 * only); the two consumer warpgroups never wait for each other (each warp waits for its stage's
 * "full" and "ready" mbarriers and frees the slot through an "empty" one). Persistent CTAs (one per
 * SM, the grid the caller asks for) stride over the tiles; the ring runs on across tiles, so the
 * producer streams the next tile's first stages while the consumers store the last one. (Clusters
 * of two CTAs sharing x through a TMA multicast were measured no faster: docs/moe.md, "EPX's
 * grouped FP8 GEMM".) Stages of 128 K-bytes: the tile's weight rows and x rows, both in the
 * 128-byte-swizzled K-major layout wgmma reads, the x rows' 128 scales of that block and each
 * weight block's one. Per stage and weight block a warpgroup runs the four k32 steps into one
 * partial sum (the tensor cores' FP8 sum of 128 products, as DeepSeek-V3's recipe and
 * cuBLASLt's block-scaled kernels promote), then adds it, times the scaler's weight scale x row
 * scale, into its float32 totals.
 */
#include <cuda.h>
#include <limits.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "moe_gemm_fp8.cu uses wgmma: build it for sm_90a (the Makefile's NVCC_GENCODE_WGMMA)"
#endif

#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"
#include "kernels/segment.cuh"
#include "kernels/wait.cuh"
#include "kernels/wgmma.cuh"
#include "moe_tiles.h"

namespace {

using namespace epx::wgmma;
constexpr int kConsumers = 256;            /* two warpgroups: the wgmma and the epilogue */
constexpr int kThreads = kConsumers + 128; /* and a producer warpgroup (one thread copies) */
/* Registers per thread after setmaxnreg (2 x 128 x 232 + 128 x 40 <= 65536). At 288 threads
 * (one producer warp) ptxas spilled and serialized the wgmmas; here the consumers use about 160
 * (width 128, one weight block), 195 (width 160) and 230 (the tall tile at 128) registers, with no
 * spill (f119165's SASS), the producer about 24 (reviews' SASS readings). */
constexpr int kConsumerRegs = 232, kProducerRegs = 40;
constexpr int kWBlock = 128; /* weight rows of a scale block: wgmma's N at the usual width, one m64
                                 of each warpgroup at the others */
constexpr int kRowBytes = 128; /* K bytes of a row per stage: one scale block, one swizzle row */
constexpr int kMaxExperts = EPX_MAX_EXPERTS;

/* A launch's tile shape (moe_tiles.h): kTileX rows of x (64 to 160; every tile computes all
 * kTileX) by kHalves scale blocks of 128 weight rows (1, or 2 for the tall tile, where each
 * warpgroup runs its wgmmas in both blocks: as many wgmmas a stage for half the barriers, and a
 * quarter fewer bytes copied a product). It sets the ring's stage: the weight box, kTileX rows
 * of x, the x rows' scales (kTileX floats) and, per weight block, the 16 bytes of its row of
 * block scales that hold this K block's; and its depth: 6 stages of 32 KB, 5 of 36 KB or 4 of
 * 48 KB (no more fit), about as many bytes in flight; widths 64 and 96 keep those depths with
 * smaller stages (24-44 KB): rings as deep as fit there (5 to 8 stages) ran the same cycles
 * (session 19, docs/moe.md "Tile widths 64 and 96"). */
template <int kTileX, int kHalves>
struct Ring {
  static constexpr int kTileW = kWBlock * kHalves; /* weight rows of a tile */
  static constexpr int kWStage = kTileW * kRowBytes;
  static constexpr int kStages = kHalves == 2 ? 4 : kTileX <= 128 ? 6 : 5;
  static constexpr int kXStage = kTileX * kRowBytes;
  static constexpr int kScaleStage = kTileX * 4 + 16 * kHalves;
  static constexpr int kCombStage = kHalves * kTileX * 4; /* the scales' products */
  /* a consumer warp's BF16 outputs on their way to global memory: half a tile's x rows by its 16
   * weight rows (x's rows as N), or its 16 rows of x by 64 weight columns (as M) */
  static constexpr int kOutWarp = 16 * (kTileX / 2) * 2;
  static constexpr int kSmemBytes =
      1024 /* to align the base */ +
      kStages * (kWStage + kXStage + kScaleStage + kCombStage + 24 /* barriers */) +
      (kConsumers / 32) * kOutWarp + 2 * (kMaxExperts + 1) * 4 /* tile prefix, segment begins */;
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM fits");
  static_assert(kTileX % 8 == 0 && kTileX <= 256 && kScaleStage % 16 == 0, "a wgmma N, TMA box");
  static_assert(kHalves == 1 || (kHalves == 2 && kTileX <= 128), "registers: acc + part fit");
};
/* A slot is free again once every consumer warp read it. */
constexpr uint32_t kEmptyArrivals = kConsumers / 32;

/* Which widths run with x's rows as wgmma's M (A, 64 rows a warpgroup) and the weight rows as N
 * (B, one block of 128 a wgmma): the usual width. There a thread's accumulators cover 2 rows of x,
 * so a promotion reads 2 of the scaler's products; with the rows of x as N (the other widths) it
 * reads one per column, 32 at width 128, and those loads took the shared-memory pipe the wgmmas
 * read their operands through (a probe without them: 10-19% fewer cycles; docs/moe.md, "x's rows
 * as M"). */
template <int kTileX>
constexpr bool kRowsAsM = kTileX == EPX__MOE_TILE_X;

/* A tile: expert e's weight rows [n0, n0 + Ring::kTileW) on its segment rows [row0, row0 + rows).
 */
struct Tile {
  int e, n0, row0, rows, seg_rows, seg_begin;
};

/* Tile t of the grid's order (see the header); prefix[j]: the tiles before expert j's. */
template <int kTileX, int kTileW>
__device__ __forceinline__ Tile find_tile(int t, const int *prefix, const int *begin, int L) {
  /* the last expert whose first tile is <= t (it has tiles: t < its end) */
  const int lo = epx::segment_of_shared(prefix, L, t);
  Tile tl;
  tl.e = lo;
  tl.seg_begin = begin[lo];
  tl.seg_rows = begin[lo + 1] - begin[lo];
  /* rows of its token tiles: kTileX each but the last where the rows are wgmma's M; else equal
   * tiles (either way every tile computes all kTileX rows) */
  const int per = kRowsAsM<kTileX> ? kTileX : epx__moe_x_tile_rows(tl.seg_rows, kTileX);
  const int x_tiles = (tl.seg_rows + per - 1) / per; /* epx__moe_x_tiles without a 2nd `per` */
  const int local = t - prefix[lo];
  tl.n0 = (local / x_tiles) * kTileW;
  tl.row0 = (local % x_tiles) * per;
  tl.rows = min(per, tl.seg_rows - tl.row0);
  return tl;
}

/* A stage's four k32 wgmmas of one weight block into the partial sum p (m64 x N, A at a0, B at
 * b0), fenced and committed; mma_stage_wait waits for them, after which p may be read. Both
 * layouts' tiles (run_tile, run_tile_rows_m) look up their tile and wait for the scaler between
 * the two. */
template <int kN>
__device__ __forceinline__ void mma_stage(float *p, uint32_t a0, uint32_t b0) {
  fence_regs<kN / 2>(p);
  fence();
#pragma unroll
  for (int ks = 0; ks < 4; ks++)
    Wgmma<kN>::run(p, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), ks > 0);
  commit();
}
template <int kN>
__device__ __forceinline__ void mma_stage_wait(float *p) {
  wait<0>();
  fence_regs<kN / 2>(p);
}

/* Bounded barrier waits (4 s, then a trap): a copy that never lands, or a slot never freed,
 * is a fault of the copy engine, a tensor map or this kernel, not a rank that may still come. */
__device__ __forceinline__ void wait_phase(uint64_t *bar, uint32_t parity) {
  const epx::WaitResult r = epx::wait_until(
      4000000000ull, [&] { return epx::mbarrier_try_wait(bar, parity); }, epx::NeverAbandon{});
  if (r != epx::WaitResult::kReady) __trap();
}

/* The shared memory's regions. */
struct Smem {
  unsigned char *w, *x; /* [Ring::kStages][Ring::kWStage], [Ring::kStages][Ring::kXStage] */
  float *sc;            /* [Ring::kStages][Ring::kScaleStage / 4] */
  float *comb;          /* [Ring::kStages][kHalves][kTileX]: weight block's scale x row's */
  unsigned char *out;   /* [consumer warp][Ring::kOutWarp]: the BF16 stores' staging */
  uint64_t *full;       /* [Ring::kStages]: a stage's copies landed */
  uint64_t *ready;      /* [Ring::kStages]: and its scales' products are written */
  uint64_t *empty;      /* [Ring::kStages]: every consumer warp is done with it */
};

/* The producer (one lane): every stage of the CTA's tiles, each into slot s % depth once the
 * consumers freed it: the weight box, the x rows' box (kTileX rows whatever the tile's: every
 * tile computes all kTileX), the x rows' scales and, per weight block, its row of block
 * scales that holds this K block's (16 bytes: ws_kb is a multiple of 4). */
template <int kTileX, int kHalves>
__device__ void produce(const epx__moe_gemm_fp8_args_t &a, const Smem &sm, const int *prefix,
                        const int *begin, int my_tiles, int k_blocks) {
  using R = Ring<kTileX, kHalves>;
  const int num_stages = my_tiles * k_blocks;
  Tile it{};
  int kb = k_blocks, tile = -1;
  for (int s = 0; s < num_stages; s++) {
    constexpr int kStages = R::kStages;
    const int slot = s % kStages;
    if (s >= kStages) wait_phase(&sm.empty[slot], ((s / kStages) - 1) & 1);
    if (kb == k_blocks) {
      kb = 0;
      tile++;
      it = find_tile<kTileX, R::kTileW>((int)blockIdx.x + tile * (int)gridDim.x, prefix, begin,
                                        a.num_experts);
    }
    const int b = kb++;
    const uint32_t scale_bytes = (uint32_t)it.rows * 4; /* rows: a multiple of 4 */
    epx::mbarrier_arrive_expect_tx(&sm.full[slot],
                                   R::kWStage + R::kXStage + scale_bytes + 16 * kHalves);
    epx::tma_load_2d(sm.w + slot * R::kWStage, &a.tmap_w, b * kRowBytes, it.e * a.n + it.n0,
                     &sm.full[slot]);
    epx::tma_load_2d(sm.x + slot * R::kXStage, &a.tmap_x, b * kRowBytes, it.seg_begin + it.row0,
                     &sm.full[slot]);
    float *sd = sm.sc + slot * (R::kScaleStage / 4);
    epx::bulk_copy(sd,
                   a.x_scales + (size_t)it.seg_begin * k_blocks + (size_t)b * it.seg_rows + it.row0,
                   scale_bytes, &sm.full[slot]);
#pragma unroll
    for (int h = 0; h < kHalves; h++)
      epx::bulk_copy(sd + kTileX + 4 * h,
                     a.w_scales + (size_t)it.e * a.ws_stride +
                         (size_t)(it.n0 / kWBlock + h) * a.ws_kb + (b & ~3),
                     16, &sm.full[slot]);
  }
}

/* The scaler (one warp of the producer warpgroup, idle otherwise): once a stage's copies land,
 * every (weight block, x row) product of its scales, which the consumers' promotions then read
 * as they are (with x's rows as N, 16 loads and 64 FMAs a thread and block at width 128 instead
 * of 16 loads, 32 multiplies and 64 FMAs; as M, 2 loads and 64 FMAs). Rows past a tile's read
 * stale scales: their outputs are computed and never stored. */
template <int kTileX, int kHalves>
__device__ void scale_products(const Smem &sm, int num_stages, int k_blocks) {
  using R = Ring<kTileX, kHalves>;
  const int lane = threadIdx.x % 32;
  for (int s = 0; s < num_stages; s++) {
    const int slot = s % R::kStages, b = s % k_blocks;
    wait_phase(&sm.full[slot], (s / R::kStages) & 1);
    const float *sc = sm.sc + slot * (R::kScaleStage / 4);
    float *out = sm.comb + slot * (kHalves * kTileX);
#pragma unroll
    for (int h = 0; h < kHalves; h++) {
      const float sw = sc[kTileX + 4 * h + b % 4];
      for (int c = lane; c < kTileX; c += 32) out[h * kTileX + c] = sw * sc[c];
    }
    __syncwarp();
    if (lane == 0) epx::mbarrier_arrive(&sm.ready[slot]);
  }
}

/* A tile's float32 outputs (y_fp32) from the registers: this thread's element (j, q) is x row
 * 8 j + 2 (lane % 4) + (q & 1) of the tile and weight row n0 + 64 wg + 16 (warp % 4) + lane / 4
 * + 8 (q >> 1), at y[row of x][weight row]. One 64-bit base address a thread and 32-bit offsets
 * from it (8 j + 1 < kTileX rows of n: epx__moe_gemm_fp8_supported bounds n). Stores with 64-bit
 * arithmetic per element and a branch around each took ~5,000 cycles a tile, a fifth of a tile at
 * K 2048 (a probe's reading; docs/moe.md, "Where the grouped GEMM's cycles go"). */
template <int kN>
__device__ __forceinline__ void store_tile_fp32(float *y, int n, const Tile &ct, const float *acc) {
  constexpr int kJ = kN / 8;
  const int tid = threadIdx.x, wg = tid / 128, warp4 = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  float *base =
      y + (size_t)(ct.seg_begin + ct.row0 + 2 * t) * (size_t)n + (ct.n0 + wg * 64 + 16 * warp4 + g);
  /* this thread's x rows in the tile: 8 j + (q & 1) < left (in a tile of fewer than 8 rows, a
   * thread with none has a base past its rows and stores nothing) */
  const int left = ct.rows - 2 * t;
#pragma unroll
  for (int j = 0; j < kJ; j++) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int col = 8 * j + (q & 1);
      if (col < left) base[col * n + 8 * (q >> 1)] = acc[4 * j + q];
    }
  }
}

/* The BF16 outputs of a tile, through this warp's staging area: each thread holds, per n8 block
 * j, x rows 8 j + 2 t + {0, 1} of weight rows g and g + 8 (its warp's 16), so y's rows (x rows,
 * weight rows contiguous) are the accumulators' 8 x 8 blocks transposed: stmatrix .trans writes
 * them as 16-byte pieces of y's rows, and the warp copies those out 16 bytes a lane (whole 32-byte
 * sectors: a warp's store covers 16 rows' 32 bytes), half the tile's x rows at a time (the area is
 * 2 KB a warp at width 128). The element-wise stores they replace (two bytes a lane, 128 a thread
 * a tall tile) took 4,500-8,200 cycles a tile, a probe's reading: up to 39% of a Qwen3 down tile.
 * Staging layout: x row r's 32 bytes at 32 r, its two 16-byte halves swapped where r & 4 (no
 * bank conflict in either direction). */
__device__ __forceinline__ uint32_t stage_offset(int r, int half) {
  return (uint32_t)(r * 32 + ((half ^ ((r >> 2) & 1)) << 4));
}
template <int kN>
__device__ __forceinline__ void store_tile_bf16(__nv_bfloat16 *y, int n, const Tile &ct,
                                                const float *acc, unsigned char *stage) {
  constexpr int kPassRows = kN / 2, kPassJ = kPassRows / 8; /* x rows, n8 blocks of a pass */
  static_assert(kPassJ % 2 == 0, "stmatrix .x4 takes two n8 blocks");
  const int tid = threadIdx.x, wg = tid / 128, warp4 = (tid / 32) % 4, lane = tid % 32;
  const uint32_t stage_addr = epx::smem_addr(stage);
  /* stmatrix: lanes 8 m .. 8 m + 7 address matrix m's rows: n8 block j + m / 2, half m % 2 */
  const int mi = lane >> 3, ri = lane & 7;
  __nv_bfloat16 *col0 = y + (ct.n0 + wg * 64 + 16 * warp4);
#pragma unroll
  for (int p = 0; p < 2; p++) {
#pragma unroll
    for (int jj = 0; jj < kPassJ; jj += 2) {
      const float *a4 = acc + 4 * (p * kPassJ + jj);
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(a4[2 * m], a4[2 * m + 1]);
        r[m] = *(const uint32_t *)&v;
      }
      const int row = 8 * (jj + (mi >> 1)) + ri;
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       stage_addr + stage_offset(row, mi & 1)),
                   "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                   : "memory");
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 2 * kPassRows; c += 32) {
      const int row = c >> 1, half = c & 1, x_row = p * kPassRows + row;
      const uint4 v = *(const uint4 *)(stage + stage_offset(row, half));
      if (x_row < ct.rows)
        *(uint4 *)(col0 + (size_t)(ct.seg_begin + ct.row0 + x_row) * (size_t)n + 8 * half) = v;
    }
    __syncwarp(); /* read before the next pass overwrites it */
  }
}

/* The BF16 outputs of a tile with x's rows as M, through this warp's staging area: the warp's 16
 * rows of x (16 (warp % 4) + lane / 4, + 8) by a weight block's 128 columns, 64 columns a pass.
 * The accumulators' 8 x 8 blocks are stmatrix's (row lane / 4, columns 2 (lane % 4), + 1), so it
 * writes them as the rows' 16-byte pieces (piece p of row r at 128 r + 16 (p ^ r % 8): no bank
 * conflict either way), and the warp copies each row's 128 bytes out with 8 lanes. */
__device__ __forceinline__ void store_rows_m_bf16(__nv_bfloat16 *y, int n, const Tile &ct, int col0,
                                                  const float *acc, unsigned char *stage) {
  const int tid = threadIdx.x, wg = tid / 128, warp4 = (tid / 32) % 4, lane = tid % 32;
  const uint32_t stage_addr = epx::smem_addr(stage);
  const int mi = lane >> 3, ri = lane & 7; /* stmatrix: lane 8 m + i addresses row i of matrix m */
  const int row_base = wg * 64 + 16 * warp4; /* the warp's first row in the tile */
#pragma unroll
  for (int pass = 0; pass < 2; pass++) {
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) { /* n8 blocks 8 pass + jj and + 1: four 8 x 8 matrices */
      const float *a4 = acc + 4 * (8 * pass + jj);
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 4; m++) { /* matrix m: rows 8 (m & 1).., block jj + (m >> 1) */
        const int q = 4 * (m >> 1) + 2 * (m & 1);
        const __nv_bfloat162 v = __floats2bfloat162_rn(a4[q], a4[q + 1]);
        r[m] = *(const uint32_t *)&v;
      }
      const int row = 8 * (mi & 1) + ri, piece = jj + (mi >> 1);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       stage_addr + (uint32_t)(row * 128 + ((piece ^ (row & 7)) << 4))),
                   "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                   : "memory");
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 128; c += 32) { /* 16 rows x 8 pieces */
      const int row = c >> 3, piece = c & 7, x_row = row_base + row;
      const uint4 v = *(const uint4 *)(stage + row * 128 + ((piece ^ (row & 7)) << 4));
      if (x_row < ct.rows)
        *(uint4 *)(y + (size_t)(ct.seg_begin + ct.row0 + x_row) * (size_t)n + col0 + 64 * pass +
                   8 * piece) = v;
    }
    __syncwarp(); /* read before the next pass overwrites it */
  }
}

/* The float32 outputs of a tile with x's rows as M: two adjacent columns a store. */
__device__ __forceinline__ void store_rows_m_fp32(float *y, int n, const Tile &ct, int col0,
                                                  const float *acc) {
  const int tid = threadIdx.x, wg = tid / 128, warp4 = (tid / 32) % 4, lane = tid % 32;
  const int r0 = wg * 64 + 16 * warp4 + lane / 4;
  float *base = y + (size_t)(ct.seg_begin + ct.row0 + r0) * (size_t)n + col0 + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    if (r0 < ct.rows) *(float2 *)(base + 8 * j) = make_float2(acc[4 * j], acc[4 * j + 1]);
    if (r0 + 8 < ct.rows)
      *(float2 *)(base + (size_t)8 * n + 8 * j) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

/* One tile at the usual width with x's rows as M: warpgroup wg runs the tile's rows [64 wg, 64 wg
 * + 64) against each weight block (wgmma m64n128, A the rows, B the block's 128 weight rows), and
 * promotes with its rows' two products (the weight block's scale x the row's). A warpgroup with no
 * rows in the tile (a last tile of 64 rows or fewer) computes them all the same: skipping its
 * wgmmas (a warpgroup-uniform branch) made ptxas serialize them (C7518, CUDA 13.0). */
template <int kHalves>
__device__ __forceinline__ void run_tile_rows_m(const epx__moe_gemm_fp8_args_t &a, const Smem &sm,
                                                const int *prefix, const int *begin, int tile,
                                                int s0, int k_blocks, float *acc, float *part) {
  constexpr int kN = EPX__MOE_TILE_X, kP = kN / 2; /* weight columns a block, floats of part */
  using R = Ring<kN, kHalves>;
  static_assert(kN == kWBlock && kN == 2 * 64, "the tile's rows: two m64; a weight block: N");
  static_assert(R::kOutWarp >= 16 * 64 * 2, "store_rows_m_bf16: 16 rows of 64 BF16 a pass");
  constexpr int kStages = R::kStages;
  unsigned char *stage = sm.out + (threadIdx.x / 32) * R::kOutWarp;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  const int r0 = wg * 64 + 16 * ((tid / 32) % 4) + lane / 4; /* this thread's rows: r0, r0 + 8 */
  Tile ct;
#pragma unroll
  for (int i = 0; i < kHalves * kP; i++) acc[i] = 0.f;
  for (int s = s0; s < s0 + k_blocks; s++) {
    const int slot = s % kStages;
    wait_phase(&sm.full[slot], (s / kStages) & 1);
    const uint32_t a0 = epx::smem_addr(sm.x + slot * R::kXStage + wg * 64 * kRowBytes);
#pragma unroll
    for (int h = 0; h < kHalves; h++) {
      const uint32_t b0 = epx::smem_addr(sm.w + slot * R::kWStage + h * kWBlock * kRowBytes);
      mma_stage<kN>(part, a0, b0);
      /* where the tile's rows go, looked up while its first stage's wgmmas run */
      if (h == 0 && s == s0) ct = find_tile<kN, R::kTileW>(tile, prefix, begin, a.num_experts);
      if (h == 0) wait_phase(&sm.ready[slot], (s / kStages) & 1);
      mma_stage_wait<kN>(part);
      const float *cb = sm.comb + slot * (kHalves * kN) + h * kN;
      const float c0 = cb[r0], c1 = cb[r0 + 8];
      float *acc_h = acc + h * kP;
#pragma unroll
      for (int j = 0; j < kN / 8; j++) {
        acc_h[4 * j + 0] += part[4 * j + 0] * c0;
        acc_h[4 * j + 1] += part[4 * j + 1] * c0;
        acc_h[4 * j + 2] += part[4 * j + 2] * c1;
        acc_h[4 * j + 3] += part[4 * j + 3] * c1;
      }
    }
    __syncwarp(); /* this warp is done with the slot (its wgmmas waited for): free it */
    if (lane == 0) epx::mbarrier_arrive(&sm.empty[slot]);
  }
#pragma unroll
  for (int h = 0; h < kHalves; h++) {
    const int col0 = ct.n0 + h * kWBlock;
    if (a.y_fp32)
      store_rows_m_fp32((float *)a.y, a.n, ct, col0, acc + h * kP);
    else
      store_rows_m_bf16((__nv_bfloat16 *)a.y, a.n, ct, col0, acc + h * kP, stage);
  }
}

/* One tile at wgmma width kN (the launch's kTileX): its k_blocks stages from stage s0 of the
 * CTA's sequence, then its rows stored (BF16 through the warp's staging area) while the producer
 * streams the next tile's first stages. With two weight blocks (kHalves 2) a warpgroup runs its m64
 * of the first block, promotes it, then its m64 of the second, through the one partial sum (two
 * would not fit beside the 128 totals). */
template <int kN, int kHalves>
__device__ __forceinline__ void run_tile(const epx__moe_gemm_fp8_args_t &a, const Smem &sm,
                                         const int *prefix, const int *begin, int tile, int s0,
                                         int k_blocks, float *acc, float *part) {
  using R = Ring<kN, kHalves>;
  unsigned char *stage = sm.out + (threadIdx.x / 32) * R::kOutWarp;
  constexpr int kJ = kN / 8; /* n8 column blocks */
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, t = lane % 4;
  Tile ct;
#pragma unroll
  for (int i = 0; i < kHalves * kN / 2; i++) acc[i] = 0.f;
  for (int s = s0; s < s0 + k_blocks; s++) {
    constexpr int kStages = R::kStages;
    const int slot = s % kStages;
    /* Every lane waits, each its own acquire of the stage's copies (lane 0 waiting, then a
     * __syncwarp, measured 3% slower). Check the build's ptxas output after changing this loop:
     * in the kernel before this one, every thread polling made ptxas serialize the wgmmas
     * (C7511, CUDA 13.0). */
    wait_phase(&sm.full[slot], (s / kStages) & 1);
    const uint32_t b0 = epx::smem_addr(sm.x + slot * R::kXStage);
#pragma unroll
    for (int h = 0; h < kHalves; h++) {
      const uint32_t a0 =
          epx::smem_addr(sm.w + slot * R::kWStage + (h * kWBlock + wg * 64) * kRowBytes);
      mma_stage<kN>(part, a0, b0);
      /* where the tile's rows go, looked up while its first stage's wgmmas run (~1,000 cycles) */
      if (h == 0 && s == s0) ct = find_tile<kN, R::kTileW>(tile, prefix, begin, a.num_experts);
      /* the scaler's products of this stage (in the wgmmas' shadow once it is ahead) */
      if (h == 0) wait_phase(&sm.ready[slot], (s / kStages) & 1);
      mma_stage_wait<kN>(part);
      /* acc += part x (weight block's scale x row's scale), per column (row of x) */
      const float *cb = sm.comb + slot * (kHalves * kN) + h * kN;
      float *acc_h = acc + h * (kN / 2);
#pragma unroll
      for (int j = 0; j < kJ; j++) {
        const float2 c2 = *(const float2 *)(cb + 8 * j + 2 * t);
        acc_h[4 * j + 0] += part[4 * j + 0] * c2.x;
        acc_h[4 * j + 1] += part[4 * j + 1] * c2.y;
        acc_h[4 * j + 2] += part[4 * j + 2] * c2.x;
        acc_h[4 * j + 3] += part[4 * j + 3] * c2.y;
      }
    }
    __syncwarp(); /* this warp is done with the slot (its wgmmas waited for): free it */
    if (lane == 0) epx::mbarrier_arrive(&sm.empty[slot]);
  }
#pragma unroll
  for (int h = 0; h < kHalves; h++) {
    Tile ch = ct;
    ch.n0 += h * kWBlock;
    if (a.y_fp32)
      store_tile_fp32<kN>((float *)a.y, a.n, ch, acc + h * (kN / 2));
    else
      store_tile_bf16<kN>((__nv_bfloat16 *)a.y, a.n, ch, acc + h * (kN / 2), stage);
  }
}

template <int kTileX, int kHalves>
__global__ void __launch_bounds__(kThreads, 1)
    moe_gemm_fp8_kernel(const __grid_constant__ epx__moe_gemm_fp8_args_t a) {
  using R = Ring<kTileX, kHalves>;
  constexpr int kStages = R::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char *base = smem_raw + ((1024u - (epx::smem_addr(smem_raw) & 1023u)) & 1023u);
  Smem sm;
  sm.w = base;
  sm.x = sm.w + kStages * R::kWStage;
  sm.sc = (float *)(sm.x + kStages * R::kXStage);
  sm.comb = (float *)((unsigned char *)sm.sc + kStages * R::kScaleStage);
  sm.out = (unsigned char *)sm.comb + kStages * R::kCombStage;
  sm.full = (uint64_t *)(sm.out + (kConsumers / 32) * R::kOutWarp);
  sm.ready = sm.full + kStages;
  sm.empty = sm.ready + kStages;
  int *prefix = (int *)(sm.empty + kStages); /* [L + 1] */
  int *begin = prefix + kMaxExperts + 1;     /* [L + 1] */

  epx::grid_dependency_wait(); /* launched early: the rows and bounds come from before */
  epx::grid_dependents_may_launch();
  const bool probe = a.clock_probe != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
  if (probe) a.clock_probe[0] = clock64(), a.clock_probe[1] = epx::globaltimer_ns();
  const int tid = threadIdx.x, L = a.num_experts;
  const int n_tiles = a.n / R::kTileW, k_blocks = a.k / kRowBytes;

  /* Every expert's segment bounds and first tile (warp 0 scans 32 experts per step). */
  for (int j = tid; j <= L; j += kThreads) begin[j] = a.begin[j];
  if (tid == 0) {
    for (int i = 0; i < kStages; i++) {
      epx::mbarrier_init(&sm.full[i], 1);
      epx::mbarrier_init(&sm.ready[i], 1);
      epx::mbarrier_init(&sm.empty[i], kEmptyArrivals);
    }
    epx::fence_mbarrier_init();
  }
  __syncthreads();
  if (tid < 32) {
    int carry = 0;
    for (int j0 = 0; j0 < L; j0 += 32) {
      const int j = j0 + tid;
      const int mine = j < L ? epx__moe_x_tiles(begin[j + 1] - begin[j], kTileX) * n_tiles : 0;
      int incl = mine;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (tid >= d) incl += v;
      }
      if (j < L) prefix[j] = carry + incl - mine;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (tid == 0) prefix[L] = carry;
  }
  __syncthreads();
  const int total = prefix[L];
  if ((int)blockIdx.x >= total) return;
  const int my_tiles = (total - 1 - (int)blockIdx.x) / (int)gridDim.x + 1;

  if (tid >= kConsumers) { /* the producer warpgroup */
    epx::setmaxnreg_dec<kProducerRegs>();
    if (tid == kConsumers) produce<kTileX, kHalves>(a, sm, prefix, begin, my_tiles, k_blocks);
    if (tid / 32 == kConsumers / 32 + 1)
      scale_products<kTileX, kHalves>(sm, my_tiles * k_blocks, k_blocks);
  } else { /* the consumers wait for every stage the producer fills: no copy outlives the CTA */
    epx::setmaxnreg_inc<kConsumerRegs>();
    float acc[kHalves * kTileX / 2], part[kTileX / 2];
#pragma unroll
    for (int i = 0; i < kTileX / 2; i++) part[i] = 0.f;
    for (int c = 0; c < my_tiles; c++) {
      const int tile = (int)blockIdx.x + c * (int)gridDim.x;
      if constexpr (kRowsAsM<kTileX>)
        run_tile_rows_m<kHalves>(a, sm, prefix, begin, tile, c * k_blocks, k_blocks, acc, part);
      else
        run_tile<kTileX, kHalves>(a, sm, prefix, begin, tile, c * k_blocks, k_blocks, acc, part);
    }
    if (probe) a.clock_probe[2] = clock64(), a.clock_probe[3] = epx::globaltimer_ns();
  }
}

}  // namespace

extern "C" int epx__moe_gemm_fp8_supported(int n, int k, int num_experts) {
  /* n: store_tile_fp32's 32-bit offsets reach (kTileX + 8) rows of n */
  return n > 0 && k > 0 && n % kWBlock == 0 && k % kRowBytes == 0 && num_experts > 0 &&
         num_experts <= kMaxExperts && n <= INT_MAX / (EPX__MOE_TILE_X_WIDE + 8);
}

/* cuTensorMapEncodeTiled, from the driver at run time (libepx does not link libcuda). */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
  }
  return fn;
}

extern "C" int epx__moe_gemm_fp8_driver_ok(void) {
  return tensor_map_encoder() != nullptr;
}

/* A [rows, k] byte matrix read in boxes of box_rows x 128 bytes, 128-byte swizzled (the layout
 * wgmma's K-major descriptors read). */
static epx_status_t encode_rows(CUtensorMap *map, const void *base, int k, long long rows,
                                int box_rows, const char *what) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "epx__moe_gemm_fp8_launch: cuTensorMapEncodeTiled is not available "
                          "from the driver");
  const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)k};
  const cuuint32_t box[2] = {(cuuint32_t)kRowBytes, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(base), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return epx__set_error(EPX_ERR_CUDA,
                          "epx__moe_gemm_fp8_launch: cuTensorMapEncodeTiled (%s: %lld rows of %d "
                          "bytes at %p) failed: %d",
                          what, rows, k, base, (int)r);
  return EPX_OK;
}

template <int kTileX, int kHalves>
static epx_status_t launch(const epx__moe_gemm_fp8_args_t &args, cudaStream_t stream) {
  return epx::launch_ex<moe_gemm_fp8_kernel<kTileX, kHalves>>(
      args.early_launch, dim3(args.num_ctas), kThreads, Ring<kTileX, kHalves>::kSmemBytes, stream,
      args);
}

extern "C" epx_status_t epx__moe_gemm_fp8_launch(const epx__moe_gemm_fp8_args_t *a,
                                                 cudaStream_t stream) {
  if (!epx__moe_gemm_fp8_supported(a->n, a->k, a->num_experts) ||
      a->w_stride != (size_t)a->n * a->k)
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__moe_gemm_fp8_launch: n %d, k %d, %d experts, weight stride %zu",
                          a->n, a->k, a->num_experts, a->w_stride);
  /* The scales arrive by bulk copies: 16-byte aligned sources, the weights' 4 blocks at a time */
  if (a->ws_kb % 4 != 0 || a->ws_kb < a->k / kRowBytes || a->ws_stride % 4 != 0 ||
      (uintptr_t)a->w_scales % 16 != 0 || (uintptr_t)a->x_scales % 16 != 0)
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__moe_gemm_fp8_launch: scales at %p (stride %zu, %d blocks a row) "
                          "and %p: need 16-byte alignment and rows of a multiple of 4 blocks",
                          (const void *)a->w_scales, a->ws_stride, a->ws_kb,
                          (const void *)a->x_scales);
  if ((uintptr_t)a->y % (a->y_fp32 ? 8 : 16) != 0)
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__moe_gemm_fp8_launch: %s outputs at %p: need %d-byte alignment "
                          "(stored %d bytes a lane)",
                          a->y_fp32 ? "float32" : "BF16", a->y, a->y_fp32 ? 8 : 16,
                          a->y_fp32 ? 8 : 16);
  const int tile_w = a->tile_w ? a->tile_w : EPX__MOE_TILE_W;
  if (!epx__moe_tile_w_fits(tile_w, a->n, a->tile_x))
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__moe_gemm_fp8_launch: tile %d rows of x by %d weight rows (n %d)",
                          a->tile_x, tile_w, a->n);
  if (a->x_rows <= 0) return EPX_OK;
  epx__moe_gemm_fp8_args_t args = *a;
  EPX_CHECK(
      encode_rows(&args.tmap_w, a->w, a->k, (long long)a->num_experts * a->n, tile_w, "weights"));
  EPX_CHECK(encode_rows(&args.tmap_x, a->x, a->k, a->x_rows, a->tile_x, "rows"));
  const bool tall = tile_w == EPX__MOE_TILE_W_TALL;
  switch (a->tile_x) {
    case 64:
      return tall ? launch<64, 2>(args, stream) : launch<64, 1>(args, stream);
    case 96:
      return tall ? launch<96, 2>(args, stream) : launch<96, 1>(args, stream);
    case EPX__MOE_TILE_X_WIDE:
      return launch<EPX__MOE_TILE_X_WIDE, 1>(args, stream);
    default:
      return tall ? launch<EPX__MOE_TILE_X, 2>(args, stream)
                  : launch<EPX__MOE_TILE_X, 1>(args, stream);
  }
}
