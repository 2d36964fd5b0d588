/*
 * experts_ffn.cu - the experts' grouped GEMMs at decode size: y = x W_e^T for the rows of each
 * expert e, the row counts read on the device (no host synchronization, graph-capturable).
 *
 * With tens of rows per expert the cost is reading the weights once, so the kernel is built to
 * stream them: a CTA owns 256 weight rows of one expert (8 warps x 32 rows) and all the
 * expert's rows of x, 32 at a time (one pass per 32 rows; a decode expert has one pass). The
 * weights are the MMA's A operand and x its B ("swap AB": 16 weight rows by 8 tokens), so no
 * MMA is wasted on padding rows of x beyond a multiple of 8.
 *
 * Pipeline: kStages stages of 64 K-bytes per row (32 BF16 or 64 FP8 values). Each thread
 * copies (cp.async) exactly the 16-byte pieces of its own four weight rows that it later feeds
 * the MMA, so weight slots are thread-private and need no ldmatrix; x's 32 x 64-byte slice of
 * the stage is shared by the CTA (one barrier per stage). The K order inside a stage is
 * permuted identically for both operands (thread t holds bytes [16t, 16t + 16) of a row): a
 * dot product does not care about order, and every load stays one 16-byte vector.
 *
 * FP8 weights: Hopper has no FP8 mma.sync (ptxas emulates it with an E4M3 -> F16 conversion
 * per operand per MMA), so the kernel converts each weight piece once per stage and runs F16
 * MMAs; x arrives as F16 holding the E4M3 codes exactly ("codes", written by the staging kernel
 * below and by the SwiGLU epilogue), so products are the FP8 products, summed in float32. Each
 * 128-deep K block is accumulated on its own and added with the weight block's scale times the
 * row's scale (two stages per block); those scales travel with the block's second stage
 * (cp.async into the stage's slot), so the loop never waits on a scale load.
 *
 * Epilogues, through shared memory so stores are whole rows:
 *   store:  out[row][n] (BF16), the down projection; or, scatter_rows, each row straight to its
 *           token's slot in the source rank's low-latency combine receive rows (the combine's
 *           send, done as each tile is computed: epx_moe_decode's completion-time send);
 *   swiglu: the CTA's warps 0-3 hold gate rows [n0, n0 + 128) and warps 4-7 the matching up
 *           rows [I + n0, ...); h = silu(gate) * up, stored BF16, or FP8 with one
 *           per-128-channel scale per row (kernels/fp8.cuh), its codes stored as F16.
 * Counts past an expert's room are cut to it (epx.h); nothing outside the experts' rows is
 * read or written.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/fp8.cuh"
#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"

namespace {

constexpr int kWarps = 8; /* the staging kernel's */
constexpr int kThreads = kWarps * 32;
constexpr int kCtaRows = 256; /* weight rows of a CTA */
/* Per variant (BF16, FP8): m16 tiles of weight rows per warp, and warps per CTA. */
constexpr int kTilesPerWarp[2] = {2, 1};
constexpr int kWarpsOf[2] = {kCtaRows / 32, kCtaRows / 16};
constexpr int kTokens = 32;     /* rows of x per pass: four n8 tiles */
constexpr int kStageBytes = 64; /* weight K bytes per row per stage */
/* Per variant (BF16, FP8): CTAs per SM and pipeline stages; ~80 KB (BF16) and ~112 KB (FP8)
 * of weights in flight per CTA. FP8 keeps two sets of sums (the 128-deep block's and the
 * total) and converts its weights: with two m16 tiles a warp it needed ~150 registers, so one
 * 8-warp CTA per SM, and issue, not bandwidth, bound it (2 warps per scheduler, ~200
 * instructions a stage). It runs 16 warps of one m16 tile each instead. */
constexpr int kCtasPerSm[2] = {2, 1};
constexpr int kStagesOf[2] = {6, 8};
constexpr int kWStageBytes = kCtaRows * kStageBytes; /* 2 x tiles pieces of 16 bytes a thread */
/* x in shared memory, per stage: the 16-bit values of the stage's K range per token: 64 bytes
 * (BF16: 32 values) or 128 bytes (F16 codes: 64 values) padded to 144 so the two rows a
 * quarter-warp reads fall in different banks. */
constexpr int kXPitch[2] = {64, 144};
constexpr int kXStageBytes[2] = {kTokens * kXPitch[0], kTokens *kXPitch[1]};
/* FP8, per stage: the scales of the 128-deep block that the stage ends (odd stages), copied
 * with the stage so that no scale load waits in the loop: the x rows' (kTokens), then the
 * CTA's two 128-row weight blocks'. */
constexpr int kScaleFloats = kTokens + 2;
constexpr int kScaleStageBytes = 144; /* kScaleFloats floats, 16-byte multiple */
static_assert(kScaleFloats * 4 <= kScaleStageBytes, "a stage's scales fit");
constexpr int kSmemBytes[2] = {kStagesOf[0] * (kWStageBytes + kXStageBytes[0]),
                               kStagesOf[1] * (kWStageBytes + kXStageBytes[1] + kScaleStageBytes)};
static_assert(kCtasPerSm[0] * kSmemBytes[0] <= 227 * 1024 &&
                  kCtasPerSm[1] * kSmemBytes[1] <= 227 * 1024,
              "the CTAs per SM fit in shared memory");
constexpr int kTileStride = kTokens + 1; /* epilogue tile [kCtaRows][kTokens + 1] floats */
static_assert(kCtaRows * kTileStride * 4 <= kSmemBytes[0], "the epilogue tile reuses the stages");
static_assert(kTokens * 8 <= kCtaRows, "at most one 16-byte piece of x per thread and stage");

/* Expert e's rows: [*begin, *begin + return), cut to its room (epx.h). */
__device__ __forceinline__ int expert_rows(const int *count, const int *begin_arr,
                                           int rows_per_expert, int num_rows, int e, int *begin) {
  int c = count[e], room;
  if (begin_arr) {
    const int b = begin_arr[e];
    if (b < 0 || b > num_rows) return 0;
    *begin = b;
    room = num_rows - b;
  } else {
    *begin = e * rows_per_expert;
    room = rows_per_expert;
  }
  return max(0, min(c, room));
}

__device__ __forceinline__ void cp_async_cg16(void *smem, const void *gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem)
               : "memory");
}
/* 16 bytes, or zeros when src_bytes is 0 (nothing is read then). */
__device__ __forceinline__ void cp_async_ca16_zfill(void *smem, const void *gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
/* 4 bytes, or zeros when src_bytes is 0. */
__device__ __forceinline__ void cp_async_ca4_zfill(void *smem, const void *gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint32_t word(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* c += A (16 x 16) * B (16 x 8): BF16, or F16 (FP8 codes). */
template <bool kF16>
__device__ __forceinline__ void mma(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

/* 16 E4M3 codes -> 8 F16 pairs, in order (exact: every E4M3 value is an F16 value). One
 * conversion per pair; the 16-bit halves of a word are register aliases, not shifts. */
__device__ __forceinline__ void fp8x16_to_f16(const uint4 &v, uint32_t *h) {
#pragma unroll
  for (int i = 0; i < 4; i++)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n"
        " cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(h[2 * i]), "=r"(h[2 * i + 1])
        : "r"(word(v, i)));
}

/* 16 E4M3 codes stored as 16 F16 values (32 bytes) at dst: the FP8 path's x operand form. */
__device__ __forceinline__ void store_codes_f16(__half *dst, const int4 &q) {
  uint32_t h[8];
  fp8x16_to_f16(make_uint4(q.x, q.y, q.z, q.w), h);
  uint4 *d = (uint4 *)dst;
  d[0] = make_uint4(h[0], h[1], h[2], h[3]);
  d[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + expf(-gate)) * up;
}

/* The down projection's row `row` on its token's source rank (epx__experts_scatter_t), or
 * NULL: a source that is dead or out of range, or a token or slot outside the receive rows. */
__device__ __forceinline__ __nv_bfloat16 *scatter_row(const epx__experts_scatter_t &sc, size_t row,
                                                      int n, unsigned dead) {
  const int4 info = __ldg((const int4 *)sc.src_info + row);
  const int s = info.x, t = info.y, k = info.z;
  if (s < 0 || s >= sc.num_ranks || ((dead >> s) & 1u) || t < 0 || t >= sc.max_tokens || k < 0 ||
      k >= sc.top_k)
    return nullptr;
  return (__nv_bfloat16 *)sc.recv[s] + ((size_t)t * sc.top_k + k) * n;
}

template <bool kFp8, bool kSwiglu>
__global__ void __launch_bounds__(32 * kWarpsOf[kFp8], kCtasPerSm[kFp8])
    experts_gemm_kernel(epx__experts_gemm_args_t a) {
  constexpr int kM = kTilesPerWarp[kFp8], kPieces = 2 * kM, kW = kWarpsOf[kFp8];
  constexpr int kT = 32 * kW, kWarpRows = 16 * kM;
  extern __shared__ __align__(16) unsigned char smem[];
  /* Launched early (early_launch): the counts and rows come from the previous kernel. */
  epx::grid_dependency_wait();
  epx::grid_dependents_may_launch();
  const int e = blockIdx.y;
  int begin = 0;
  const int count =
      expert_rows(a.expert_count, a.expert_begin, a.rows_per_expert, a.num_rows, e, &begin);
  if (count == 0) return; /* an idle expert costs no weight traffic */
  const unsigned dead = a.scatter_rows ? *(volatile const unsigned *)a.scatter.dead_mask : 0u;

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
  const bool warp_active = wrow < a.n; /* n is a multiple of 128: a warp is all in or all out */
  const size_t k_bytes = (size_t)a.k * (kFp8 ? 1 : 2); /* a weight row */
  const size_t x_row_bytes = (size_t)a.k * 2;          /* a row of x: BF16 or F16 codes */
  constexpr int kXRow = kFp8 ? 128 : 64;               /* x bytes per token per stage */
  constexpr int kXPieces = kXRow / 16;
  constexpr int kXP = kXPitch[kFp8], kXS = kXStageBytes[kFp8], kStages = kStagesOf[kFp8];
  const int num_stages = (int)(k_bytes / kStageBytes);
  const int k_blocks = a.k / 128;

  /* This thread's weight rows, piece j = 2 mt + h: tile mt, half h (row g or g + 8). */
  const char *w_expert = (const char *)a.w + (size_t)e * a.n * k_bytes;
  const char *w_row[kPieces];
#pragma unroll
  for (int j = 0; j < kPieces; j++)
    w_row[j] = w_expert + (size_t)(wrow + (j >> 1) * 16 + (j & 1) * 8 + g) * k_bytes + 16 * t;
  uint4 *w_s = (uint4 *)smem;                         /* [stage][kPieces][kT] */
  unsigned char *x_s = smem + kStages * kWStageBytes; /* [stage][kTokens][kXP] */
  float *sc_s = (float *)(x_s + kStages * kXS);       /* FP8: [stage][kScaleStageBytes / 4] */
  const char *x = (const char *)a.x;

  for (int p0 = 0; p0 < count; p0 += kTokens) {
    const int rows = min(kTokens, count - p0);
    const int tiles = (rows + 7) / 8;
    const int x_tok = tid / kXPieces, x_piece = tid % kXPieces;
    const bool x_loader = tid < kTokens * kXPieces;
    const bool x_valid = x_loader && x_tok < rows;
    const char *x_src = x_valid ? x + (size_t)(begin + p0 + x_tok) * x_row_bytes + 16 * x_piece : x;

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
          cp_async_ca16_zfill(x_s + slot * kXS + x_tok * kXP + 16 * x_piece,
                              x_valid ? x_src + (size_t)s * kXRow : x, x_valid ? 16 : 0);
        if constexpr (kFp8) {
          if ((s & 1) && tid < kScaleFloats) { /* the block that stage s ends: kb = s / 2 */
            const int kb = s >> 1;
            const float *src;
            bool ok;
            if (tid < kTokens) {
              ok = tid < rows;
              src = a.x_scales + (size_t)(begin + p0 + tid) * k_blocks + kb;
            } else {
              const int b = tid - kTokens; /* the CTA's 128-row weight block b */
              const int rb = kSwiglu ? (b == 0 ? col0 : half_n + col0) / 128 : col0 / 128 + b;
              ok = rb < a.n / 128;
              src = a.w_scales + ((size_t)e * (a.n / 128) + rb) * k_blocks + kb;
            }
            cp_async_ca4_zfill(sc_s + slot * (kScaleStageBytes / 4) + tid, ok ? src : a.w_scales,
                               ok ? 4 : 0);
          }
        }
      }
      cp_async_commit(); /* always, so wait_group counts stages */
    };

    float acc[kM][4][4];
    float part[kM][4][4];
#pragma unroll
    for (int mt = 0; mt < kM; mt++)
#pragma unroll
      for (int nj = 0; nj < 4; nj++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[mt][nj][i] = part[mt][nj][i] = 0.f;

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
      if constexpr (!kFp8) {
        /* One n8 tile of x at a time (its 16 bytes are the B fragments of both k-steps); the
         * weight fragments stay in registers across tiles. */
#pragma unroll
        for (int nj = 0; nj < 4; nj++) {
          if (nj >= tiles) continue;
          const uint4 xv = *(const uint4 *)(x_s + slot * kXS + (8 * nj + g) * kXP + 16 * t);
#pragma unroll
          for (int step = 0; step < 2; step++)
#pragma unroll
            for (int mt = 0; mt < kM; mt++)
              mma<false>(acc[mt][nj], word(wv[2 * mt], 2 * step), word(wv[2 * mt + 1], 2 * step),
                         word(wv[2 * mt], 2 * step + 1), word(wv[2 * mt + 1], 2 * step + 1),
                         word(xv, 2 * step), word(xv, 2 * step + 1));
        }
      } else {
        /* Each weight piece converted once (16 codes -> 8 F16 pairs, K = 16t .. 16t + 15 of
         * the stage), then four k-steps; x's 32 bytes per token are the same K range. */
        uint32_t wh[kPieces][8];
#pragma unroll
        for (int j = 0; j < kPieces; j++) fp8x16_to_f16(wv[j], wh[j]);
#pragma unroll
        for (int nj = 0; nj < 4; nj++) {
          if (nj >= tiles) continue;
          const unsigned char *xr = x_s + slot * kXS + (8 * nj + g) * kXP + 32 * t;
          const uint4 xa = *(const uint4 *)xr, xb = *(const uint4 *)(xr + 16);
#pragma unroll
          for (int step = 0; step < 4; step++) {
            const uint4 &xv = step < 2 ? xa : xb;
            const int i = 2 * (step & 1);
#pragma unroll
            for (int mt = 0; mt < kM; mt++)
              mma<true>(part[mt][nj], wh[2 * mt][2 * step], wh[2 * mt + 1][2 * step],
                        wh[2 * mt][2 * step + 1], wh[2 * mt + 1][2 * step + 1], word(xv, i),
                        word(xv, i + 1));
          }
        }
      }
      if constexpr (kFp8) {
        if (s & 1) { /* the end of a 128-deep block: scale it into acc (scales in the slot) */
          const float *sc = sc_s + slot * (kScaleStageBytes / 4);
#pragma unroll
          for (int mt = 0; mt < kM; mt++) {
            /* warps' rows: the first 128 of the CTA in block 0, the rest in block 1 (gate/up:
             * gate rows, then up rows; down: consecutive rows) */
            const float sw = sc[kTokens + (kWarpRows * warp + 16 * mt) / 128];
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
              if (nj >= tiles) continue;
              const float s0 = sw * sc[8 * nj + 2 * t], s1 = sw * sc[8 * nj + 2 * t + 1];
              acc[mt][nj][0] += part[mt][nj][0] * s0;
              acc[mt][nj][1] += part[mt][nj][1] * s1;
              acc[mt][nj][2] += part[mt][nj][2] * s0;
              acc[mt][nj][3] += part[mt][nj][3] * s1;
#pragma unroll
              for (int i = 0; i < 4; i++) part[mt][nj][i] = 0.f;
            }
          }
        }
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
      /* out[row][col0 + 8 ch + i] for the CTA's up-to-256 columns; scatter_rows: the row's
       * slot on its source rank instead (scatter_row) */
      for (int item = tid; item < rows * (kCtaRows / 8); item += kT) {
        const int tok = item / (kCtaRows / 8), ch = item % (kCtaRows / 8);
        const int col = col0 + 8 * ch;
        if (col >= a.n) continue;
        const size_t row = (size_t)(begin + p0 + tok);
        __nv_bfloat16 *dst = a.scatter_rows ? scatter_row(a.scatter, row, a.n, dead)
                                            : (__nv_bfloat16 *)a.out + row * a.n;
        if (!dst) continue;
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = tile[(8 * ch + i) * kTileStride + tok];
        *(int4 *)(dst + col) = epx::float8_to_bf16x8(f);
      }
      /* No fence for the rows sent to peers: the combine that signals them is a later kernel
       * (griddepcontrol.wait or stream order), whose release store at system scope follows
       * this grid's end in causality order, as a later kernel's flag after any earlier
       * kernel's writes. */
    } else if constexpr (!kFp8) {
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
    } else {
      /* Eight lanes per row (16 channels each) make one 128-channel scale group. */
      for (int base = 4 * warp; base < rows; base += 4 * kW) {
        const int tok = base + lane / 8, c0 = (lane % 8) * 16;
        float f[16];
#pragma unroll
        for (int i = 0; i < 16; i++)
          f[i] = tok < rows ? silu_mul(tile[(c0 + i) * kTileStride + tok],
                                       tile[(128 + c0 + i) * kTileStride + tok])
                            : 0.f;
        float scale;
        const int4 q = epx::quantize16_float(f, false, &scale);
        if (tok < rows) {
          const size_t row = (size_t)(begin + p0 + tok);
          store_codes_f16((__half *)a.out + row * half_n + col0 + c0, q);
          if (lane % 8 == 0) a.out_scales[row * (half_n / 128) + col0 / 128] = scale;
        }
      }
    }
    __syncthreads(); /* the next pass's stages overwrite the tile */
  }
}

/* The x operand of the FP8 path: each expert row's E4M3 codes as F16 (exact), from BF16 rows
 * (quantized per 128 channels; the scales written) or from FP8 rows (converted; the caller's
 * scales are used as they are). One warp per row, eight lanes per 128-channel group; grid
 * (blocks per expert, E), blocks striding over the expert's rows. */
template <bool kFromFp8>
__global__ void __launch_bounds__(kThreads) experts_stage_x_kernel(epx__experts_stage_args_t a) {
  epx::grid_dependency_wait(); /* launched early: the rows come from the previous kernel */
  epx::grid_dependents_may_launch();
  const int e = blockIdx.y;
  int begin = 0;
  const int count =
      expert_rows(a.expert_count, a.expert_begin, a.rows_per_expert, a.num_rows, e, &begin);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = a.hidden / 128;
  for (int r = blockIdx.x * kWarps + warp; r < count; r += gridDim.x * kWarps) {
    const size_t row = (size_t)(begin + r);
    for (int g0 = 0; g0 < groups; g0 += 4) { /* a warp covers four groups per step */
      const int grp = g0 + lane / 8, c = grp * 128 + (lane % 8) * 16;
      const bool valid = grp < groups;
      int4 q = make_int4(0, 0, 0, 0);
      if constexpr (kFromFp8) {
        if (valid) q = *(const int4 *)((const uint8_t *)a.x + row * a.hidden + c);
      } else {
        const __nv_bfloat16 *src = (const __nv_bfloat16 *)a.x + row * a.hidden;
        const int4 lo = valid ? *(const int4 *)(src + c) : q;
        const int4 hi = valid ? *(const int4 *)(src + c + 8) : q;
        float scale;
        q = epx::quantize16(lo, hi, false, &scale); /* every lane: the max is a shuffle */
        if (valid && lane % 8 == 0) a.scales[row * groups + grp] = scale;
      }
      if (valid) {
        store_codes_f16((__half *)a.codes + row * a.hidden + c, q);
      }
    }
  }
}

}  // namespace

extern "C" epx_status_t epx__experts_gemm_launch(const epx__experts_gemm_args_t *a,
                                                 cudaStream_t stream) {
  const int col_tiles = a->swiglu ? (a->n / 2) / 128 : (a->n + kCtaRows - 1) / kCtaRows;
  const dim3 grid(col_tiles, a->num_experts);
  if (a->fp8)
    return a->swiglu ? epx::launch_ex<experts_gemm_kernel<true, true>>(
                           a->early_launch, grid, 32 * kWarpsOf[1], kSmemBytes[1], stream, *a)
                     : epx::launch_ex<experts_gemm_kernel<true, false>>(
                           a->early_launch, grid, 32 * kWarpsOf[1], kSmemBytes[1], stream, *a);
  return a->swiglu ? epx::launch_ex<experts_gemm_kernel<false, true>>(
                         a->early_launch, grid, 32 * kWarpsOf[0], kSmemBytes[0], stream, *a)
                   : epx::launch_ex<experts_gemm_kernel<false, false>>(
                         a->early_launch, grid, 32 * kWarpsOf[0], kSmemBytes[0], stream, *a);
}

extern "C" epx_status_t epx__experts_stage_x_launch(const epx__experts_stage_args_t *a,
                                                    cudaStream_t stream) {
  /* Enough blocks per expert for the masked layout's room; a contiguous layout's room is
   * unknown on the host, so its blocks stride. */
  const int room = a->expert_begin ? a->num_rows : a->rows_per_expert;
  const dim3 grid(max(1, min(32, (room + kWarps - 1) / kWarps)), a->num_experts);
  return a->x_fp8 ? epx::launch_ex<experts_stage_x_kernel<true>>(a->early_launch, grid, kThreads, 0,
                                                                 stream, *a)
                  : epx::launch_ex<experts_stage_x_kernel<false>>(a->early_launch, grid, kThreads,
                                                                  0, stream, *a);
}
