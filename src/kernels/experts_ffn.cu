/*
 * experts_ffn.cu - the experts' grouped GEMMs with BF16 weights at decode size: y = x W_e^T for
 * the rows of each expert e, the row counts read on the device (no host synchronization,
 * graph-capturable). The FP8 GEMMs (wgmma) are in experts_fp8.cu; what both share is in
 * experts_common.cuh.
 *
 * With tens of rows per expert the cost is reading the weights once, so the kernel is built to
 * stream them: a CTA owns 256 weight rows of one expert (8 warps x 32 rows) and all the
 * expert's rows of x, 32 at a time (one pass per 32 rows; a decode expert has one pass). The
 * weights are the MMA's A operand and x its B ("swap AB": 16 weight rows by 8 tokens), so no
 * MMA is wasted on padding rows of x beyond a multiple of 8.
 *
 * Pipeline: kStages stages of 64 K-bytes per row (32 BF16 values). Each thread copies
 * (cp.async) exactly the 16-byte pieces of its own four weight rows that it later feeds the
 * MMA, so weight slots are thread-private and need no ldmatrix; x's 32 x 64-byte slice of the
 * stage is shared by the CTA (one barrier per stage). The K order inside a stage is permuted
 * identically for both operands (thread t holds bytes [16t, 16t + 16) of a row): a dot product
 * does not care about order, and every load stays one 16-byte vector.
 *
 * Epilogues, through shared memory so stores are whole rows:
 *   store:  out[row][n] (BF16), the down projection; or, scatter_rows, each row straight to its
 *           token's slot in the source rank's low-latency combine receive rows (the combine's
 *           send, done as each tile is computed: epx_moe_decode's completion-time send);
 *   swiglu: the CTA's warps 0-3 hold gate rows [n0, n0 + 128) and warps 4-7 the matching up
 *           rows [I + n0, ...); h = silu(gate) * up, stored BF16.
 * Counts past an expert's room are cut to it (epx.h); nothing outside the experts' rows is
 * read or written.
 */
#include <cuda_bf16.h>

#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/experts_common.cuh"
#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"

namespace {

using namespace epx::experts;

constexpr int kCtaRows = 256;    /* weight rows of a CTA */
constexpr int kTilesPerWarp = 2; /* m16 tiles of weight rows per warp */
constexpr int kWarps = kCtaRows / (16 * kTilesPerWarp);
constexpr int kThreads = 32 * kWarps;
constexpr int kTokens = 32;     /* rows of x per pass: four n8 tiles */
constexpr int kStageBytes = 64; /* weight K bytes per row per stage */
/* Two CTAs per SM, six stages each: ~80 KB of weights in flight per CTA. */
constexpr int kCtasPerSm = 2;
constexpr int kStages = 6;
constexpr int kWStageBytes = kCtaRows * kStageBytes; /* 2 x tiles pieces of 16 bytes a thread */
/* x in shared memory, per stage: the stage's 32 BF16 values of K per token (64 bytes). */
constexpr int kXPitch = 64;
constexpr int kXStageBytes = kTokens * kXPitch;
constexpr int kSmemBytes = kStages * (kWStageBytes + kXStageBytes);
static_assert(kCtasPerSm * kSmemBytes <= 227 * 1024, "the CTAs per SM fit in shared memory");
constexpr int kTileStride = kTokens + 1; /* epilogue tile [kCtaRows][kTokens + 1] floats */
static_assert(kCtaRows * kTileStride * 4 <= kSmemBytes, "the epilogue tile reuses the stages");
static_assert(kTokens * 4 <= kThreads, "at most one 16-byte piece of x per thread and stage");

__device__ __forceinline__ uint32_t word(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* c += A (16 x 16) * B (16 x 8), BF16 in, float32 out. */
__device__ __forceinline__ void mma_bf16(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    experts_gemm_kernel(epx__experts_gemm_args_t a) {
  constexpr int kM = kTilesPerWarp, kPieces = 2 * kM, kW = kWarps;
  constexpr int kT = kThreads, kWarpRows = 16 * kM;
  extern __shared__ __align__(16) unsigned char smem[];
  int begin;
  unsigned dead;
  const int count = cta_expert_rows(a, &begin, &dead); /* launched early: waits first */
  if (count == 0) return;
  const int e = blockIdx.y;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int half_n = a.n / 2;
  /* This warp's first weight row within expert e, and the CTA's first output column. */
  int wrow, col0;
  if constexpr (kSwiglu) {
    col0 = blockIdx.x * 128;
    wrow = warp < kW / 2 ? col0 + kWarpRows * warp : half_n + col0 + kWarpRows * (warp - kW / 2);
  } else {
    col0 = blockIdx.x * kCtaRows;
    wrow = col0 + kWarpRows * warp;
  }
  const bool warp_active = wrow < a.n;    /* n is a multiple of 128: a warp is all in or all out */
  const size_t k_bytes = (size_t)a.k * 2; /* a weight row, and a row of x */
  constexpr int kXPieces = kXPitch / 16;
  const int num_stages = (int)(k_bytes / kStageBytes);

  /* This thread's weight rows, piece j = 2 mt + h: tile mt, half h (row g or g + 8). */
  const char *w_expert = (const char *)a.w + (size_t)e * a.n * k_bytes;
  const char *w_row[kPieces];
#pragma unroll
  for (int j = 0; j < kPieces; j++)
    w_row[j] = w_expert + (size_t)(wrow + (j >> 1) * 16 + (j & 1) * 8 + g) * k_bytes + 16 * t;
  uint4 *w_s = (uint4 *)smem;                         /* [stage][kPieces][kT] */
  unsigned char *x_s = smem + kStages * kWStageBytes; /* [stage][kTokens][kXPitch] */
  const char *x = (const char *)a.x;

  for (int p0 = 0; p0 < count; p0 += kTokens) {
    const int rows = min(kTokens, count - p0);
    const int tiles = (rows + 7) / 8;
    const int x_tok = tid / kXPieces, x_piece = tid % kXPieces;
    const bool x_loader = tid < kTokens * kXPieces;
    const bool x_valid = x_loader && x_tok < rows;
    const char *x_src = x_valid ? x + (size_t)(begin + p0 + x_tok) * k_bytes + 16 * x_piece : x;

    auto issue = [&](int s) {
      if (s < num_stages) {
        const int slot = s % kStages;
        if (warp_active) {
#pragma unroll
          for (int j = 0; j < kPieces; j++)
            cp_async_cg16(&w_s[(slot * kPieces + j) * kT + tid],
                          w_row[j] + (size_t)s * kStageBytes);
        }
        if (x_loader)
          cp_async_ca16_zfill(x_s + slot * kXStageBytes + x_tok * kXPitch + 16 * x_piece,
                              x_valid ? x_src + (size_t)s * kStageBytes : x, x_valid ? 16 : 0);
      }
      cp_async_commit(); /* always, so wait_group counts stages */
    };

    float acc[kM][4][4];
#pragma unroll
    for (int mt = 0; mt < kM; mt++)
#pragma unroll
      for (int nj = 0; nj < 4; nj++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[mt][nj][i] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; s++) issue(s);
    for (int s = 0; s < num_stages; s++) {
      cp_async_wait<kStages - 2>();
      __syncthreads(); /* stage s landed for every thread; slot (s - 1) % kStages is free */
      issue(s + kStages - 1);
      if (!warp_active) continue;
      const int slot = s % kStages;
      uint4 wv[kPieces];
#pragma unroll
      for (int j = 0; j < kPieces; j++) wv[j] = w_s[(slot * kPieces + j) * kT + tid];
        /* One n8 tile of x at a time (its 16 bytes are the B fragments of both k-steps); the
         * weight fragments stay in registers across tiles. */
#pragma unroll
      for (int nj = 0; nj < 4; nj++) {
        if (nj >= tiles) continue;
        const uint4 xv =
            *(const uint4 *)(x_s + slot * kXStageBytes + (8 * nj + g) * kXPitch + 16 * t);
#pragma unroll
        for (int step = 0; step < 2; step++)
#pragma unroll
          for (int mt = 0; mt < kM; mt++)
            mma_bf16(acc[mt][nj], word(wv[2 * mt], 2 * step), word(wv[2 * mt + 1], 2 * step),
                     word(wv[2 * mt], 2 * step + 1), word(wv[2 * mt + 1], 2 * step + 1),
                     word(xv, 2 * step), word(xv, 2 * step + 1));
      }
    }
    cp_async_wait<0>();
    __syncthreads(); /* every stage consumed: the epilogue tile may overwrite them */

    float *tile = (float *)smem; /* [kCtaRows][kTileStride]: weight row (local) x token */
    if (warp_active) {
#pragma unroll
      for (int mt = 0; mt < kM; mt++)
#pragma unroll
        for (int nj = 0; nj < 4; nj++) {
          if (nj >= tiles) continue;
          const int r = kWarpRows * warp + 16 * mt + g, c = 8 * nj + 2 * t;
          tile[r * kTileStride + c] = acc[mt][nj][0];
          tile[r * kTileStride + c + 1] = acc[mt][nj][1];
          tile[(r + 8) * kTileStride + c] = acc[mt][nj][2];
          tile[(r + 8) * kTileStride + c + 1] = acc[mt][nj][3];
        }
    }
    __syncthreads();

    if constexpr (!kSwiglu) {
      store_down_rows<kCtaRows, kThreads>(tile, kTileStride, a, col0, (size_t)(begin + p0), rows,
                                          dead);
    } else {
      for (int item = tid; item < rows * 16; item += kT) {
        const int tok = item / 16, ch = item % 16;
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; i++)
          f[i] = silu_mul(tile[(8 * ch + i) * kTileStride + tok],
                          tile[(128 + 8 * ch + i) * kTileStride + tok]);
        *(int4 *)((__nv_bfloat16 *)a.out + (size_t)(begin + p0 + tok) * half_n + col0 + 8 * ch) =
            epx::float8_to_bf16x8(f);
      }
    }
    __syncthreads(); /* the next pass's stages overwrite the tile */
  }
}

}  // namespace

extern "C" epx_status_t epx__experts_gemm_launch(const epx__experts_gemm_args_t *a,
                                                 cudaStream_t stream) {
  if (a->fp8) return epx__experts_fp8_gemm_launch(a, stream);
  const dim3 grid = gemm_grid(*a, kCtaRows);
  return a->swiglu ? epx::launch_ex<experts_gemm_kernel<true>>(a->early_launch, grid, kThreads,
                                                               kSmemBytes, stream, *a)
                   : epx::launch_ex<experts_gemm_kernel<false>>(a->early_launch, grid, kThreads,
                                                                kSmemBytes, stream, *a);
}
