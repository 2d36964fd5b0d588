/*
 * bench_kernels.cu - epx_bench's kernels, behind the extern "C" launchers declared in bench.h.
 *
 *   push      the ceiling: an all-to-all push of bytes_per_pair to each peer over NVLink
 *   fill_x    the payload: x[t][h] = BF16 of a hash of (seed, rank, t, h)
 *   pack      NCCL baseline: gather tokens into per-destination blocks of rows
 *   reduce    NCCL baseline: sum each token's returned rows in float32, write BF16
 *   check_*   recompute the expected payload from the seed and count the rows that differ
 *   spin      keep the GPU busy for a while (the gap between the halves of a split call)
 *
 * Rows are BF16 [*, H] with H a multiple of 8: one int4 (16 bytes) carries 8 elements, element
 * j of a chunk in bits [16 (j % 2), 16 (j % 2) + 16) of 32-bit word j / 2 (little-endian).
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "bench.h"
#include "kernels/ptx.cuh"

namespace {

constexpr unsigned kFullMask = 0xffffffffu;

/* ---------------------------------------------------------------------------------------------
 * Payload values
 * ------------------------------------------------------------------------------------------- */
/* A value in [-2, 2) with at most 16 significant bits, a pure function of its arguments
 * (t < 2^32, h < 2^16, so the key fields never overlap). */
__device__ __forceinline__ float x_value(uint64_t seed, int rank, int t, int h) {
  const uint64_t key = (uint64_t)rank << 48 | (uint64_t)(uint32_t)t << 16 | (uint64_t)h;
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (key + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)((int)(z >> 48) - 32768) * (1.0f / 16384.0f);
}

__device__ __forceinline__ uint32_t bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ float bf16_value(uint32_t bits) {
  return __bfloat162float(__ushort_as_bfloat16((unsigned short)bits));
}

/* The 8 elements [h0, h0 + 8) of BF16(mult x BF16(x_value(seed, rank, t, h))). mult = 1 is x
 * itself. With mult <= 8 the product is what a float32 sum of mult copies gives, exactly. */
__device__ __forceinline__ int4 expected_chunk(uint64_t seed, int rank, int t, int h0, int mult) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint32_t lo = bf16_bits(mult * bf16_value(bf16_bits(x_value(seed, rank, t, h0 + j))));
    const uint32_t hi = bf16_bits(mult * bf16_value(bf16_bits(x_value(seed, rank, t, h0 + j + 1))));
    w[j / 2] = lo | hi << 16;
  }
  return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

__device__ __forceinline__ bool same_chunk(int4 a, int4 b) {
  return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w;
}

/* acc[j] += element j of chunk v. */
__device__ __forceinline__ void add_chunk(float acc[8], int4 v) {
  const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] += bf16_value(w[j / 2] >> (16 * (j % 2)) & 0xffffu);
}

__device__ __forceinline__ int4 chunk_of(const float acc[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 8; j += 2) w[j / 2] = bf16_bits(acc[j]) | bf16_bits(acc[j + 1]) << 16;
  return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

/* ---------------------------------------------------------------------------------------------
 * Ceiling push. Grid: num_blocks (= SMs) x kPushThreads. The work is cut into units of
 * BENCH_PUSH_UNIT_BYTES (one warp: 32 lanes x kPushUnroll x 16 bytes); unit u belongs to peer
 * u % num_peers, so consecutive warps write to different peers and every SM spreads its
 * traffic over all links. Each lane issues its kPushUnroll non-allocating 16-byte loads before
 * the first store, so several loads are in flight per lane.
 * ------------------------------------------------------------------------------------------- */
constexpr int kPushThreads = 512;
constexpr int kPushUnroll = 8;
constexpr int kPushUnitInt4 = 32 * kPushUnroll;
static_assert(kPushUnitInt4 * 16 == BENCH_PUSH_UNIT_BYTES, "unit size must match bench.h");

__global__ void __launch_bounds__(kPushThreads) push_kernel(bench_push_args_t a) {
  const int lane = threadIdx.x % 32;
  const size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const size_t num_warps = (size_t)gridDim.x * blockDim.x / 32;
  const size_t units_per_peer = a.bytes_per_pair / BENCH_PUSH_UNIT_BYTES;
  const size_t num_units = units_per_peer * a.num_peers;
  for (size_t u = warp; u < num_units; u += num_warps) {
    const int peer = (int)(u % a.num_peers);
    const size_t offset = (u / a.num_peers) * kPushUnitInt4 + lane;
    const int4 *src = (const int4 *)a.src[peer] + offset;
    int4 *dst = (int4 *)a.dst[peer] + offset;
    int4 v[kPushUnroll];
#pragma unroll
    for (int i = 0; i < kPushUnroll; i++) v[i] = epx::ld_nc_na_v4(src + i * 32);
#pragma unroll
    for (int i = 0; i < kPushUnroll; i++) dst[i * 32] = v[i];
  }
}

/* ---------------------------------------------------------------------------------------------
 * Payload, pack and reduce. Pack and reduce: one block per token, threads over its chunks;
 * rank r's row of token t is rows[prefix[r] + token_pos_in_rank[t][r]].
 * ------------------------------------------------------------------------------------------- */
constexpr int kRowThreads = 256;

__global__ void fill_x_kernel(int4 *x, int num_tokens, int hidden, uint64_t seed, int rank) {
  const int n16 = hidden / 8;
  const size_t total = (size_t)num_tokens * n16;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = expected_chunk(seed, rank, (int)(i / n16), (int)(i % n16) * 8, 1);
}

/* pos[r] = token t's position in rank r's block, -1 if it does not go there. */
__device__ __forceinline__ void load_positions(const bench_rows_args_t &a, int t,
                                               int pos[EPX_MAX_RANKS]) {
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++)
    pos[r] = r < a.num_ranks ? a.token_pos_in_rank[(size_t)t * a.num_ranks + r] : -1;
}

__global__ void __launch_bounds__(kRowThreads) pack_kernel(bench_rows_args_t a) {
  const int t = blockIdx.x, n16 = a.hidden / 8;
  int pos[EPX_MAX_RANKS];
  load_positions(a, t, pos);
  const int4 *src = (const int4 *)a.x + (size_t)t * n16;
  int4 *rows = (int4 *)a.rows;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) {
    const int4 v = src[i];
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++)
      if (pos[r] >= 0) rows[(size_t)(a.prefix[r] + pos[r]) * n16 + i] = v;
  }
}

__global__ void __launch_bounds__(kRowThreads) reduce_kernel(bench_rows_args_t a) {
  const int t = blockIdx.x, n16 = a.hidden / 8;
  int pos[EPX_MAX_RANKS];
  load_positions(a, t, pos);
  const int4 *rows = (const int4 *)a.rows;
  int4 *out = (int4 *)a.x + (size_t)t * n16;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++)
      if (pos[r] >= 0) add_chunk(acc, rows[(size_t)(a.prefix[r] + pos[r]) * n16 + i]);
    out[i] = chunk_of(acc);
  }
}

/* ---------------------------------------------------------------------------------------------
 * Checks: one warp per row; a row counts once however many of its elements differ.
 * ------------------------------------------------------------------------------------------- */
/* Row i of rows must be x of (source expected[2i], token expected[2i + 1]). */
__global__ void check_rows_kernel(const int4 *rows, const int32_t *expected, int num_rows,
                                  int hidden, uint64_t seed, unsigned long long *wrong) {
  const int lane = threadIdx.x % 32, n16 = hidden / 8;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  for (int row = warp; row < num_rows; row += num_warps) {
    const int src = expected[2 * row], t = expected[2 * row + 1];
    bool bad = false;
    for (int i = lane; i < n16; i += 32)
      bad |= !same_chunk(rows[(size_t)row * n16 + i], expected_chunk(seed, src, t, i * 8, 1));
    if (__any_sync(kFullMask, bad) && lane == 0) atomicAdd(wrong, 1ull);
  }
}

/* Token t of out must be mult[t] x x of (rank, t). */
__global__ void check_scaled_kernel(const int4 *out, const int *mult, int num_tokens, int hidden,
                                    uint64_t seed, int rank, unsigned long long *wrong) {
  const int lane = threadIdx.x % 32, n16 = hidden / 8;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int num_warps = gridDim.x * blockDim.x / 32;
  for (int t = warp; t < num_tokens; t += num_warps) {
    const int m = mult[t];
    bool bad = false;
    for (int i = lane; i < n16; i += 32)
      bad |= !same_chunk(out[(size_t)t * n16 + i], expected_chunk(seed, rank, t, i * 8, m));
    if (__any_sync(kFullMask, bad) && lane == 0) atomicAdd(wrong, 1ull);
  }
}

/* Blocks of kRowThreads for n rows at one warp per row, capped. */
unsigned warp_per_row_blocks(int n) {
  const int warps_per_block = kRowThreads / 32;
  const int blocks = (n + warps_per_block - 1) / warps_per_block;
  return (unsigned)(blocks < 2048 ? blocks : 2048);
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = epx::globaltimer_ns();
  while (epx::globaltimer_ns() - start < ns) {
  }
}

}  // namespace

extern "C" cudaError_t bench_spin_launch(uint64_t ns, cudaStream_t stream) {
  spin_kernel<<<1, 32, 0, stream>>>(ns);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_push_launch(const bench_push_args_t *a, cudaStream_t stream) {
  push_kernel<<<a->num_blocks, kPushThreads, 0, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_fill_x_launch(void *x, int num_tokens, int hidden, uint64_t seed,
                                           int rank, cudaStream_t stream) {
  const size_t chunks = (size_t)num_tokens * (hidden / 8);
  if (chunks == 0) return cudaSuccess;
  const size_t blocks = (chunks + kRowThreads - 1) / kRowThreads;
  fill_x_kernel<<<(unsigned)(blocks < 8192 ? blocks : 8192), kRowThreads, 0, stream>>>(
      (int4 *)x, num_tokens, hidden, seed, rank);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_pack_launch(const bench_rows_args_t *a, cudaStream_t stream) {
  if (a->num_tokens == 0) return cudaSuccess;
  pack_kernel<<<a->num_tokens, kRowThreads, 0, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_reduce_launch(const bench_rows_args_t *a, cudaStream_t stream) {
  if (a->num_tokens == 0) return cudaSuccess;
  reduce_kernel<<<a->num_tokens, kRowThreads, 0, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_check_rows_launch(const void *rows, const int32_t *expected,
                                               int num_rows, int hidden, uint64_t seed,
                                               unsigned long long *wrong, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  check_rows_kernel<<<warp_per_row_blocks(num_rows), kRowThreads, 0, stream>>>(
      (const int4 *)rows, expected, num_rows, hidden, seed, wrong);
  return cudaGetLastError();
}

extern "C" cudaError_t bench_check_scaled_launch(const void *out, const int *mult, int num_tokens,
                                                 int hidden, uint64_t seed, int rank,
                                                 unsigned long long *wrong, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  check_scaled_kernel<<<warp_per_row_blocks(num_tokens), kRowThreads, 0, stream>>>(
      (const int4 *)out, mult, num_tokens, hidden, seed, rank, wrong);
  return cudaGetLastError();
}
