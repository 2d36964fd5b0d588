/*
 * experts_fp8.cu - the experts' grouped GEMMs with FP8 E4M3 weights (DeepSeek-V3's per-128
 * block scales) at decode size, on Hopper's wgmma (compiled for sm_90a), and the kernel that
 * quantizes BF16 x for them. The BF16 GEMMs are in experts_ffn.cu; what both share is in
 * experts_common.cuh.
 *
 * Why wgmma: Hopper has no FP8 mma.sync. The earlier kernel converted every weight byte to F16
 * and ran F16 mma.sync; with the conversion removed (a wrong-result ablation, 982dd99, one
 * H200) the same loop ran 1.2x faster, so the instruction stream, not HBM, bound it. wgmma
 * multiplies E4M3 from shared memory directly: one instruction per 64 x N x 32 block.
 *
 * Shape: a CTA (two warpgroups, 256 threads, one per SM) owns 256 weight rows of one expert and
 * streams them once per pass of up to 32 rows of x. Each warpgroup owns 128 rows (two m64
 * tiles), which are one 128-row scale block: gate/up puts the gate rows [c0, c0 + 128) in
 * warpgroup 0 and the matching up rows [I + c0, ...) in warpgroup 1, so the SwiGLU epilogue
 * finds both in the CTA. x is wgmma's B operand, N = the pass's rows rounded up to 8 (8, 16,
 * 24 or 32; rows past the count are zeros), so a decode expert with 8 rows pays for 8.
 *
 * Pipeline: stages of 128 K-bytes per row (one scale block), every thread copying (cp.async)
 * 16-byte pieces into the 128-byte-swizzled K-major layout wgmma reads (piece c of row r at
 * r * 128 + ((c ^ (r % 8)) * 16), stage bases 1024-aligned), with the block's scales (the 32
 * rows' and the two weight blocks') in the stage's slot. Per stage a warpgroup runs the 4 k32
 * steps of each tile, each into a partial sum that is added, times weight scale x row scale,
 * into its float32 total as soon as it is done: the scales apply per 128-deep block, as
 * DeepSeek-V3's recipe (and the oracle, tests/ref/epx_ref_experts.c) has it, and the tensor
 * cores' FP8 sums, which keep fewer bits than float32, never run longer than 32 products.
 *
 * Epilogues, through a float tile in shared memory: the down projection stores BF16 rows, or
 * sends each to its token's slot on the source rank (store_down_rows); gate/up writes
 * h = silu(gate) * up as FP8 with one scale per 128 channels of a row, the x of the down
 * projection.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "experts_fp8.cu uses wgmma: build it for sm_90a (the Makefile's NVCC_GENCODE_WGMMA)"
#endif

#include "kernels/api.h"
#include "kernels/experts_common.cuh"
#include "kernels/fp8.cuh"
#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"
#include "kernels/wgmma.cuh"

namespace {

using namespace epx::experts;
using namespace epx::wgmma;

constexpr int kCtaRows = 256;  /* weight rows of a CTA: 2 warpgroups x 2 m64 tiles */
constexpr int kThreads = 256;  /* two warpgroups */
constexpr int kTokens = 32;    /* rows of x per pass: wgmma's N, at most */
constexpr int kRowBytes = 128; /* K bytes of a row per stage: one scale block, one swizzle row */
constexpr int kStages = 6;     /* ~160 KB of weights in flight */
constexpr int kWStage = kCtaRows * kRowBytes; /* 32 KB */
constexpr int kXStage = kTokens * kRowBytes;  /* 4 KB */
/* Per stage: the x rows' scales (kTokens), then the two warpgroups' weight-block scales. */
constexpr int kScaleFloats = kTokens + 2;
constexpr int kScaleStage = 144; /* bytes: kScaleFloats floats, a 16-byte multiple */
static_assert(kScaleFloats * 4 <= kScaleStage, "a stage's scales fit");
constexpr int kSmemBytes =
    1024 /* to align the base */ + kStages * (kWStage + kXStage + kScaleStage);
static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM fits");
constexpr int kTileStride = kTokens + 1; /* epilogue tile [kCtaRows][kTileStride] floats */
static_assert(kCtaRows * kTileStride * 4 <= kStages * kWStage, "the tile reuses the stages");
static_assert(kTokens * 8 == kThreads, "one 16-byte piece of x per thread and stage");

/* One pass's copies: this thread's share of a stage (see issue()). */
struct Loads {
  const char *w[2];   /* weight rows tid / 8 of the CTA's first and second 128 (+32 i rows) */
  bool w_active[2];   /* those 128 rows exist (n is a multiple of 128, not always of 256) */
  size_t w_step;      /* bytes between rows 32 apart */
  const char *x;      /* x row tid / 8 of the pass, or NULL past its rows */
  const float *scale; /* tid < kScaleFloats: block 0's scale (block s: scale + s; x's and the
                         weights' are both [., k / 128]), or NULL */
  const void *any;    /* a valid address for the zero-filled copies */
  uint32_t w_off;     /* piece offset in a stage's weight slot (swizzled) */
  uint32_t x_off;     /* piece offset in a stage's x slot (swizzled) */
};

/* The whole K loop of one pass at N = kN, the totals left in tile[row][token] (floats). */
template <int kN>
__device__ __forceinline__ void mainloop(const Loads &ld, int num_stages, unsigned char *smem,
                                         float *tile) {
  const int tid = threadIdx.x, wg = tid / 128, warp4 = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  unsigned char *w_s = smem;                        /* [stage][kWStage] */
  unsigned char *x_s = smem + kStages * kWStage;    /* [stage][kXStage] */
  float *sc_s = (float *)(x_s + kStages * kXStage); /* [stage][kScaleStage / 4] */

  auto issue = [&](int s) {
    if (s < num_stages) {
      const int slot = s % kStages;
      unsigned char *wd = w_s + slot * kWStage + ld.w_off;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        if (!ld.w_active[h]) continue;
#pragma unroll
        for (int i = 0; i < 4; i++)
          cp_async_cg16(wd + (h * 4 + i) * 32 * kRowBytes,
                        ld.w[h] + i * ld.w_step + (size_t)s * kRowBytes);
      }
      cp_async_ca16_zfill(x_s + slot * kXStage + ld.x_off,
                          ld.x ? ld.x + (size_t)s * kRowBytes : ld.any, ld.x ? 16 : 0);
      if (tid < kScaleFloats)
        cp_async_ca4_zfill(sc_s + slot * (kScaleStage / 4) + tid, ld.scale ? ld.scale + s : ld.any,
                           ld.scale ? 4 : 0);
    }
    cp_async_commit(); /* always, so wait_group counts stages */
  };

  float acc[2][kN / 2], part[2][kN / 2], part2[2][kN / 2];
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int i = 0; i < kN / 2; i++) acc[mt][i] = part[mt][i] = part2[mt][i] = 0.f;
  const bool active = wg == 0 ? ld.w_active[0] : ld.w_active[1];

#pragma unroll
  for (int s = 0; s < kStages - 1; s++) issue(s);
  for (int s = 0; s < num_stages; s++) {
    cp_async_wait<kStages - 2>();
    fence_proxy_async_smem();
    __syncthreads(); /* stage s landed for every thread; slot (s - 1) % kStages is free */
    issue(s + kStages - 1);
    if (!active) continue;
    const int slot = s % kStages;
    const uint32_t a0 = epx::smem_addr(w_s + slot * kWStage + wg * 128 * kRowBytes);
    const uint32_t b0 = epx::smem_addr(x_s + slot * kXStage);
    const float *sc = sc_s + slot * (kScaleStage / 4);
    const float sw = sc[kTokens + wg];
    /* acc += p x (weight block's scale x row's scale), per token column */
    auto promote = [&](float(&p)[2][kN / 2]) {
#pragma unroll
      for (int mt = 0; mt < 2; mt++) fence_regs<kN / 2>(p[mt]);
#pragma unroll
      for (int j = 0; j < kN / 8; j++) {
        const float s0 = sw * sc[8 * j + 2 * t], s1 = sw * sc[8 * j + 2 * t + 1];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          acc[mt][4 * j + 0] += p[mt][4 * j + 0] * s0;
          acc[mt][4 * j + 1] += p[mt][4 * j + 1] * s1;
          acc[mt][4 * j + 2] += p[mt][4 * j + 2] * s0;
          acc[mt][4 * j + 3] += p[mt][4 * j + 3] * s1;
        }
      }
    };
    /* One k32 step at a time into alternating partial sums, each added into the float32
     * totals as soon as it is done (step ks + 1 runs on the tensor cores meanwhile): the tensor
     * cores keep fewer bits than float32 when they sum FP8 products, and chaining the four
     * steps of a block in one accumulator lost twice as many bits (1xH200, 1445f11). */
    auto step = [&](int ks, float(&p)[2][kN / 2]) {
#pragma unroll
      for (int mt = 0; mt < 2; mt++) fence_regs<kN / 2>(p[mt]);
      fence();
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
        Wgmma<kN>::run(p[mt], smem_desc(a0 + mt * 64 * kRowBytes + ks * 32),
                       smem_desc(b0 + ks * 32), 0);
      commit();
    };
    step(0, part);
    step(1, part2);
    wait<1>();
    promote(part);
    step(2, part);
    wait<1>();
    promote(part2);
    step(3, part2);
    wait<1>();
    promote(part);
    wait<0>();
    promote(part2);
  }
  cp_async_wait<0>();
  __syncthreads(); /* every stage consumed: the tile may overwrite them */
  if (active) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int j = 0; j < kN / 8; j++) {
        const int r = wg * 128 + mt * 64 + 16 * warp4 + g, c = 8 * j + 2 * t;
        tile[r * kTileStride + c] = acc[mt][4 * j + 0];
        tile[r * kTileStride + c + 1] = acc[mt][4 * j + 1];
        tile[(r + 8) * kTileStride + c] = acc[mt][4 * j + 2];
        tile[(r + 8) * kTileStride + c + 1] = acc[mt][4 * j + 3];
      }
  }
  __syncthreads();
}

template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, 1) experts_fp8_gemm_kernel(epx__experts_gemm_args_t a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  int begin;
  unsigned dead;
  const int count = cta_expert_rows(a, &begin, &dead); /* launched early: waits first */
  if (count == 0) return;
  const int e = blockIdx.y;
  unsigned char *smem = smem_raw + ((1024u - (epx::smem_addr(smem_raw) & 1023u)) & 1023u);
  float *tile = (float *)smem;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int half_n = a.n / 2, k_blocks = a.k / 128;
  const size_t k = (size_t)a.k; /* bytes of a weight row and of a row of x */
  /* The CTA's two 128-row halves (one per warpgroup) and its first output column. */
  int col0, first[2];
  if constexpr (kSwiglu) {
    col0 = blockIdx.x * 128;
    first[0] = col0;
    first[1] = half_n + col0;
  } else {
    col0 = blockIdx.x * kCtaRows;
    first[0] = col0;
    first[1] = col0 + 128;
  }
  const char *w_expert = (const char *)a.w + (size_t)e * a.n * k;
  const int piece = tid % 8, r8 = tid / 8; /* rows r8 + 32 i, 16-byte piece `piece` */
  Loads ld;
  for (int h = 0; h < 2; h++) {
    ld.w_active[h] = first[h] < a.n; /* n is a multiple of 128: a half is all in or all out */
    ld.w[h] = w_expert + (size_t)(first[h] + r8) * k + 16 * piece;
  }
  ld.w_step = 32 * k;
  ld.w_off = r8 * kRowBytes + ((piece ^ (r8 % 8)) << 4);
  ld.x_off = ld.w_off; /* token r8's piece: the same swizzle */
  ld.any = a.w;

  for (int p0 = 0; p0 < count; p0 += kTokens) {
    const int rows = min(kTokens, count - p0);
    const size_t row0 = (size_t)(begin + p0);
    ld.x = r8 < rows ? (const char *)a.x + (row0 + r8) * k + 16 * piece : nullptr;
    ld.scale = nullptr;
    if (tid < kTokens) {
      if (tid < rows) ld.scale = a.x_scales + (row0 + tid) * k_blocks;
    } else if (tid < kScaleFloats) {
      const int rb = (tid == kTokens ? first[0] : first[1]) / 128; /* a warpgroup's block */
      if (rb < a.n / 128) ld.scale = a.w_scales + ((size_t)e * (a.n / 128) + rb) * k_blocks;
    }
    const int num_stages = a.k / kRowBytes;
    switch ((rows + 7) / 8) {
      case 1:
        mainloop<8>(ld, num_stages, smem, tile);
        break;
      case 2:
        mainloop<16>(ld, num_stages, smem, tile);
        break;
      case 3:
        mainloop<24>(ld, num_stages, smem, tile);
        break;
      default:
        mainloop<32>(ld, num_stages, smem, tile);
        break;
    }

    if constexpr (!kSwiglu) {
      store_down_rows<kCtaRows, kThreads>(tile, kTileStride, a, col0, row0, rows, dead);
    } else {
      /* h as FP8: eight lanes per row (16 channels each) make one 128-channel scale group. */
      for (int base = 4 * warp; base < rows; base += 4 * (kThreads / 32)) {
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
          const size_t row = row0 + tok;
          *(int4 *)((unsigned char *)a.out + row * half_n + col0 + c0) = q;
          if (lane % 8 == 0) a.out_scales[row * (half_n / 128) + col0 / 128] = scale;
        }
      }
    }
    __syncthreads(); /* the next pass's stages overwrite the tile */
  }
}

/* x for the FP8 GEMMs from BF16 rows: E4M3 codes and one scale per 128 channels (the rule of
 * tests/ref/epx_ref.h). One warp per row, eight lanes per 128-channel group; grid (blocks per
 * expert, E), blocks striding over the expert's rows. */
constexpr int kQuantWarps = 8;
__global__ void __launch_bounds__(kQuantWarps * 32)
    experts_quantize_x_kernel(epx__experts_quantize_args_t a) {
  epx::grid_dependency_wait(); /* launched early: the rows come from the previous kernel */
  epx::grid_dependents_may_launch();
  const int e = blockIdx.y;
  int begin = 0;
  const int count =
      expert_rows(a.expert_count, a.expert_begin, a.rows_per_expert, a.num_rows, e, &begin);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = a.hidden / 128;
  for (int r = blockIdx.x * kQuantWarps + warp; r < count; r += gridDim.x * kQuantWarps) {
    const size_t row = (size_t)(begin + r);
    const __nv_bfloat16 *src = (const __nv_bfloat16 *)a.x + row * a.hidden;
    for (int g0 = 0; g0 < groups; g0 += 4) { /* a warp covers four groups per step */
      const int grp = g0 + lane / 8, c = grp * 128 + (lane % 8) * 16;
      const bool valid = grp < groups;
      const int4 zero = make_int4(0, 0, 0, 0);
      const int4 lo = valid ? *(const int4 *)(src + c) : zero;
      const int4 hi = valid ? *(const int4 *)(src + c + 8) : zero;
      float scale;
      const int4 q = epx::quantize16(lo, hi, false, &scale); /* every lane: the max is a shuffle */
      if (valid) {
        *(int4 *)((unsigned char *)a.codes + row * a.hidden + c) = q;
        if (lane % 8 == 0) a.scales[row * groups + grp] = scale;
      }
    }
  }
}

}  // namespace

extern "C" epx_status_t epx__experts_fp8_gemm_launch(const epx__experts_gemm_args_t *a,
                                                     cudaStream_t stream) {
  const dim3 grid = gemm_grid(*a, kCtaRows);
  return a->swiglu ? epx::launch_ex<experts_fp8_gemm_kernel<true>>(a->early_launch, grid, kThreads,
                                                                   kSmemBytes, stream, *a)
                   : epx::launch_ex<experts_fp8_gemm_kernel<false>>(a->early_launch, grid, kThreads,
                                                                    kSmemBytes, stream, *a);
}

extern "C" epx_status_t epx__experts_quantize_x_launch(const epx__experts_quantize_args_t *a,
                                                       cudaStream_t stream) {
  /* Enough blocks per expert for the masked layout's room; a contiguous layout's room is
   * unknown on the host, so its blocks stride. */
  const int room = a->expert_begin ? a->num_rows : a->rows_per_expert;
  const dim3 grid(max(1, min(32, (room + kQuantWarps - 1) / kQuantWarps)), a->num_experts);
  return epx::launch_ex<experts_quantize_x_kernel>(a->early_launch, grid, kQuantWarps * 32, 0,
                                                   stream, *a);
}
