/*
 * moe_prefill.cu - the prefill MoE layer's kernels of its own (api.h): between its cuBLAS GEMMs
 * (epx__moe_rows_launch) SiLU times up and/or the per-128-channel FP8 quantization of the
 * expert-major rows, with the scales in the per-segment layout cuBLASLt's 1x128 block scaling
 * reads; and for FP8 on the wire, the quantization of a chunk's tokens before its dispatch
 * (epx__moe_quantize_tokens_launch) and the received scales into the per-segment layout
 * (epx__moe_segment_scales_launch); for the batched GEMM, its device arrays of matrix pointers
 * (epx__moe_group_ptrs_launch).
 *
 * Roles: one warp per (row, 512 channels); lane i holds channels [16 i, 16 i + 16) of the
 * 512, so one 128-channel group is 8 consecutive lanes (fp8.cuh's quantize16_float). Blocks
 * stride over the (row, column block) pairs. Memory-bound: each input value is read once and
 * each output written once.
 */
#include <cuda_bf16.h>

#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/fp8.cuh"
#include "kernels/launch.cuh"
#include "kernels/segment.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kChannelsPerWarp = 512;

/* 16 values from p (float32 or BF16), 16-byte aligned. */
template <bool kFp32>
__device__ __forceinline__ void load16(const void *p, float *f) {
  if constexpr (kFp32) {
    const float4 *v = (const float4 *)p;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float4 t = v[i];
      f[4 * i] = t.x, f[4 * i + 1] = t.y, f[4 * i + 2] = t.z, f[4 * i + 3] = t.w;
    }
  } else {
    const int4 *v = (const int4 *)p;
    epx::bf16x8_to_float(v[0], f);
    epx::bf16x8_to_float(v[1], f + 8);
  }
}

__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + expf(-gate)) * up;
}

template <bool kFp32, bool kSwiglu, bool kQuantize>
__global__ void __launch_bounds__(kThreads) moe_rows_kernel(epx__moe_rows_launch_args_t a) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int col_blocks = (a.cols + kChannelsPerWarp - 1) / kChannelsPerWarp;
  const long long tasks = (long long)a.num_rows * col_blocks;
  const size_t in_elem = kFp32 ? 4 : 2, in_cols = kSwiglu ? 2 * (size_t)a.cols : a.cols;
  const int groups = a.cols / 128;
  for (long long task = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; task < tasks;
       task += warps) {
    const int r = (int)(task / col_blocks);
    const int c0 = (int)(task % col_blocks) * kChannelsPerWarp + lane * 16;
    const int j = epx::segment_of(a.begin, a.num_experts, r);
    const int seg_begin = __ldg(a.begin + j);
    const bool real = r - seg_begin < __ldg(a.count + j);
    const bool active = c0 < a.cols; /* whole 128-channel groups: cols % 128 == 0 */
    float f[16];
#pragma unroll
    for (int i = 0; i < 16; i++) f[i] = 0.f;
    if (active && real) {
      const char *row = (const char *)a.in + (size_t)r * in_cols * in_elem;
      load16<kFp32>(row + (size_t)c0 * in_elem, f);
      if constexpr (kSwiglu) {
        float u[16];
        load16<kFp32>(row + ((size_t)a.cols + c0) * in_elem, u);
#pragma unroll
        for (int i = 0; i < 16; i++) f[i] = silu_mul(f[i], u[i]);
      }
    }
    /* Where the row goes: row r of its segment, or the phases' rows (real rows only) */
    const int out_seg = a.out_begin ? __ldg(a.out_begin + j) : seg_begin;
    const size_t o_row = (size_t)out_seg + (r - seg_begin);
    if constexpr (kQuantize) {
      float scale;
      const int4 q = epx::quantize16_float(f, false, &scale); /* every lane: shuffles */
      if (!active || (a.out_begin && !real)) continue;
      *(int4 *)((char *)a.out + o_row * a.cols + c0) = q;
      if (lane % 8 == 0) {
        /* NOTE: per segment [groups][S] with the segment's rows contiguous (api.h). */
        const int S =
            a.out_begin ? (__ldg(a.count + j) + 3) / 4 * 4 : __ldg(a.begin + j + 1) - seg_begin;
        a.scales[(size_t)out_seg * groups + (size_t)(c0 / 128) * S + (r - seg_begin)] =
            real ? scale : 1.f;
      }
    } else {
      if (!active || (a.out_begin && !real)) continue;
      int4 *o = (int4 *)((char *)a.out + (o_row * a.cols + c0) * 2);
      o[0] = epx::float8_to_bf16x8(f);
      o[1] = epx::float8_to_bf16x8(f + 8);
    }
  }
}

template <bool kFp32, bool kSwiglu, bool kQuantize>
epx_status_t launch_rows(const epx__moe_rows_launch_args_t *a, cudaStream_t stream) {
  return epx::launch<moe_rows_kernel<kFp32, kSwiglu, kQuantize>>(dim3(a->num_blocks), kThreads, 0,
                                                                 stream, *a);
}

/* One warp per (token, 512 channels), as moe_rows_kernel without SwiGLU: the same loads and
 * the same quantize16_float, so the codes and scales are the ones the expert side would make
 * from the same BF16 row. */
__global__ void __launch_bounds__(kThreads)
    moe_quantize_tokens_kernel(epx__moe_quantize_tokens_launch_args_t a) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int col_blocks = (a.hidden + kChannelsPerWarp - 1) / kChannelsPerWarp;
  const long long tasks = (long long)a.num_tokens * col_blocks;
  for (long long task = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; task < tasks;
       task += warps) {
    const int t = (int)(task / col_blocks);
    const int c0 = (int)(task % col_blocks) * kChannelsPerWarp + lane * 16;
    const bool active = c0 < a.hidden; /* whole 128-channel groups: hidden % 128 == 0 */
    float f[16];
#pragma unroll
    for (int i = 0; i < 16; i++) f[i] = 0.f;
    if (active) load16<false>((const char *)a.x + ((size_t)t * a.hidden + c0) * 2, f);
    float scale;
    const int4 q = epx::quantize16_float(f, false, &scale); /* every lane: shuffles */
    if (!active) continue;
    *(int4 *)((char *)a.codes + (size_t)t * a.hidden + c0) = q;
    if (lane % 8 == 0) a.scales[(size_t)t * (a.hidden / 128) + c0 / 128] = scale;
  }
}

/* Received row scales [rows, groups] into the per-segment layout (api.h): a block takes 32 rows
 * at a time through shared memory, so both the reads (32 rows' scales are contiguous) and the
 * writes (a group's scales of consecutive rows of a segment are contiguous) coalesce (one thread
 * a value with stores a row apart took 43 us at DeepSeek-V3's shape). Rows past their segment's
 * count get 1. */
constexpr int kScaleTileRows = 32;
constexpr int kScaleTileGroups = 64; /* groups a pass: one pass up to H = 8192, more past it */
__global__ void __launch_bounds__(kThreads)
    moe_segment_scales_kernel(epx__moe_segment_scales_launch_args_t a) {
  __shared__ float tile[kScaleTileRows * (kScaleTileGroups + 1)]; /* pitch gn | 1 <= 65 */
  __shared__ long long row_out[kScaleTileRows]; /* b G + (r - b): past 2^31 at 2^24 rows */
  __shared__ int row_stride[kScaleTileRows], row_real[kScaleTileRows];
  const int G = a.groups;
  const int tiles = (a.num_rows + kScaleTileRows - 1) / kScaleTileRows;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = t * kScaleTileRows, n = min(kScaleTileRows, a.num_rows - r0);
    if (threadIdx.x < n) { /* where row r0 + i goes: its segment's base and row stride */
      const int r = r0 + threadIdx.x;
      const int j = epx::segment_of(a.begin, a.num_experts, r);
      const int b = __ldg(a.begin + j);
      row_out[threadIdx.x] = (long long)b * G + (r - b);
      row_stride[threadIdx.x] = __ldg(a.begin + j + 1) - b;
      row_real[threadIdx.x] = r - b < __ldg(a.count + j);
    }
    for (int g0 = 0; g0 < G; g0 += kScaleTileGroups) {
      const int gn = min(kScaleTileGroups, G - g0), pitch = gn | 1; /* odd: no conflicts */
      for (int i = threadIdx.x; i < n * gn; i += kThreads)
        tile[(i / gn) * pitch + i % gn] = a.in[(size_t)(r0 + i / gn) * G + g0 + i % gn];
      __syncthreads();
      for (int i = threadIdx.x; i < n * gn; i += kThreads) {
        const int g = i / n, rr = i % n; /* consecutive threads: consecutive rows of a group */
        a.out[row_out[rr] + (long long)(g0 + g) * row_stride[rr]] =
            row_real[rr] ? tile[rr * pitch + g] : 1.f;
      }
      __syncthreads(); /* the tile and the row arrays are reused */
    }
  }
}

/* One warp writes the batched GEMM's pointer arrays (api.h), 32 experts a step. */
__global__ void __launch_bounds__(32) moe_group_ptrs_kernel(epx__moe_group_ptrs_launch_args_t a) {
  const int S = a.array_stride;
  for (int j = threadIdx.x; j <= a.num_experts; j += 32) {
    if (a.blocked_begin) a.blocked_begin[j] = j * a.block_rows;
    if (j == a.num_experts) break;
    const size_t blocked = (size_t)j * a.block_rows;
    const size_t xr = a.x_blocked ? blocked : (size_t)__ldg(a.begin + j);
    const size_t yr = a.y_blocked ? blocked : (size_t)__ldg(a.begin + j);
    a.ptrs[j] = (void *)(a.w + (size_t)j * a.w_stride);
    a.ptrs[S + j] = (void *)(a.x + xr * a.x_row);
    a.ptrs[2 * S + j] = (void *)(a.y + yr * a.y_row);
  }
}

}  // namespace

extern "C" epx_status_t epx__moe_group_ptrs_launch(const epx__moe_group_ptrs_launch_args_t *a,
                                                   cudaStream_t stream) {
  if (a->num_experts <= 0) return EPX_OK;
  return epx::launch<moe_group_ptrs_kernel>(dim3(1), 32, 0, stream, *a);
}

extern "C" epx_status_t epx__moe_rows_launch(const epx__moe_rows_launch_args_t *a,
                                             cudaStream_t stream) {
  if (a->num_rows <= 0) return EPX_OK;
  /* The combinations the layer uses: BF16 SwiGLU (BF16 weights), quantize BF16 rows (FP8 x),
   * SwiGLU + quantize from float32 or BF16 (FP8 h). */
  if (!a->quantize) {
    if (!a->swiglu || a->in_fp32)
      return epx__set_error(EPX_ERR_INTERNAL, "epx__moe_rows_launch: unsupported combination");
    return launch_rows<false, true, false>(a, stream);
  }
  if (!a->swiglu) {
    if (a->in_fp32)
      return epx__set_error(EPX_ERR_INTERNAL, "epx__moe_rows_launch: unsupported combination");
    return launch_rows<false, false, true>(a, stream);
  }
  return a->in_fp32 ? launch_rows<true, true, true>(a, stream)
                    : launch_rows<false, true, true>(a, stream);
}

extern "C" epx_status_t epx__moe_quantize_tokens_launch(
    const epx__moe_quantize_tokens_launch_args_t *a, cudaStream_t stream) {
  if (a->num_tokens <= 0) return EPX_OK;
  return epx::launch<moe_quantize_tokens_kernel>(dim3(a->num_blocks), kThreads, 0, stream, *a);
}

extern "C" epx_status_t epx__moe_segment_scales_launch(
    const epx__moe_segment_scales_launch_args_t *a, cudaStream_t stream) {
  if (a->num_rows <= 0) return EPX_OK;
  return epx::launch<moe_segment_scales_kernel>(dim3(a->num_blocks), kThreads, 0, stream, *a);
}
