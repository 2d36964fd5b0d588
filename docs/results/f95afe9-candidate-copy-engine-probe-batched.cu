// docs/results/f95afe9-candidate-copy-engine-probe-batched.cu (session 18): 53cdb64-copy-engine-probe.cu plus an 8th
// argument: 1 = every piece in one cudaMemcpyBatchAsync (cudaMemcpyFlagPreferOverlapWithCompute), to measure
// what copies straight into an [expert][source] layout (one piece per expert) cost. Compiled, NOT RUN.
// Run: ./ce_probe n k L S y_fp32 MB_per_peer pieces batched
// scratch (session 18): can the copy engines carry a prefill layer's payload beside the grouped
// FP8 GEMM? Every GPU runs the GEMM (one shape) and/or copies B bytes to every peer with
// cudaMemcpyPeerAsync (copy engines, no SMs), alone and at once; events per device.
#include "kernels/api.h"
#include "moe_tiles.h"
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)
__global__ void fill_bytes(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = (uint8_t)(h & 0x77) | (uint8_t)(h >> 24 & 0x80) | 0x08;
  }
}
__global__ void fill_f(float *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = 1.f / 64;
}
struct Dev {
  epx__moe_gemm_fp8_args_t a;
  cudaStream_t gs, cs;
  cudaEvent_t g0, g1, c0, c1;
  uint8_t *send, *recv;
};
int main(int argc, char **argv) {
  // shape: n k L S y_fp32 ; bytes per peer (MB)
  int n = 4096, k = 7168, L = 64, S = 512, fp32 = 1; size_t mb = 64; int chunks = 1;
  if (argc >= 6) { n = atoi(argv[1]); k = atoi(argv[2]); L = atoi(argv[3]); S = atoi(argv[4]); fp32 = atoi(argv[5]); }
  if (argc >= 7) mb = atoi(argv[6]);
  if (argc >= 8) chunks = atoi(argv[7]);
  int batched = argc >= 9 ? atoi(argv[8]) : 0; /* 1: every piece in one cudaMemcpyBatchAsync */
  int N; CK(cudaGetDeviceCount(&N));
  const size_t B = mb << 20;
  std::vector<Dev> d(N);
  for (int i = 0; i < N; i++) {
    CK(cudaSetDevice(i));
    for (int j = 0; j < N; j++) if (j != i) { cudaError_t e = cudaDeviceEnablePeerAccess(j, 0); if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e); }
    cudaGetLastError();
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, i));
    const int kb4 = (k / 128 + 3) / 4 * 4;
    const size_t rows = (size_t)L * S, nw = (size_t)L * n * k, nx = rows * k;
    const size_t nws = (size_t)L * (n / 128) * kb4, nxs = rows * (k / 128);
    uint8_t *w, *x; float *ws, *xs; int *bd; void *y;
    CK(cudaMalloc(&w, nw)); CK(cudaMalloc(&x, nx)); CK(cudaMalloc(&ws, nws * 4)); CK(cudaMalloc(&xs, nxs * 4));
    CK(cudaMalloc(&bd, 4 * (L + 1))); CK(cudaMalloc(&y, rows * n * 4));
    fill_bytes<<<1024, 256>>>(w, nw, 1 + i); fill_bytes<<<1024, 256>>>(x, nx, 2 + i);
    fill_f<<<256, 256>>>(ws, nws); fill_f<<<256, 256>>>(xs, nxs);
    std::vector<int> b(L + 1); for (int j = 0; j <= L; j++) b[j] = j * S;
    CK(cudaMemcpy(bd, b.data(), 4 * (L + 1), cudaMemcpyHostToDevice));
    epx__moe_gemm_fp8_args_t &a = d[i].a; memset(&a, 0, sizeof a);
    a.w = w; a.w_stride = (size_t)n * k; a.w_scales = ws; a.ws_stride = (size_t)(n / 128) * kb4; a.ws_kb = kb4;
    a.x = x; a.x_scales = xs; a.y = y; a.y_fp32 = fp32; a.n = n; a.k = k; a.num_experts = L; a.begin = bd;
    a.x_rows = (int)rows; a.num_ctas = sms; a.tile_x = 128; a.tile_w = epx__moe_pick_tile_w(n, 128);
    CK(cudaStreamCreateWithFlags(&d[i].gs, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&d[i].cs, cudaStreamNonBlocking));
    CK(cudaEventCreate(&d[i].g0)); CK(cudaEventCreate(&d[i].g1)); CK(cudaEventCreate(&d[i].c0)); CK(cudaEventCreate(&d[i].c1));
    CK(cudaMalloc(&d[i].send, B * N)); CK(cudaMalloc(&d[i].recv, B * N));
    fill_bytes<<<1024, 256>>>(d[i].send, B * N, 7 + i);
    CK(cudaDeviceSynchronize());
  }
  auto gemm = [&](int i) { CK(cudaSetDevice(i)); CK(cudaEventRecord(d[i].g0, d[i].gs));
    if (epx__moe_gemm_fp8_launch(&d[i].a, d[i].gs) != EPX_OK) { printf("launch: %s\n", epx_last_error()); exit(1); }
    CK(cudaEventRecord(d[i].g1, d[i].gs)); };
  std::vector<void *> bd; std::vector<const void *> bs; std::vector<size_t> bz;
  auto copy = [&](int i) { CK(cudaSetDevice(i)); CK(cudaEventRecord(d[i].c0, d[i].cs));
    const size_t piece = B / chunks;
    bd.clear(), bs.clear(), bz.clear();
    for (int c = 0; c < chunks; c++)
      for (int o = 1; o < N; o++) { const int j = (i + o) % N;
        if (batched) {
          bd.push_back(d[j].recv + (size_t)i * B + c * piece), bs.push_back(d[i].send + (size_t)j * B + c * piece), bz.push_back(piece);
          continue;
        }
        CK(cudaMemcpyPeerAsync(d[j].recv + (size_t)i * B + c * piece, j, d[i].send + (size_t)j * B + c * piece, i, piece, d[i].cs)); }
    if (batched) {
      cudaMemcpyAttributes at; memset(&at, 0, sizeof at);
      at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      at.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t idx0 = 0;
      CK(cudaMemcpyBatchAsync(bd.data(), bs.data(), bz.data(), bz.size(), &at, &idx0, 1, d[i].cs));
    }
    CK(cudaEventRecord(d[i].c1, d[i].cs)); };
  auto sync = [&]() { for (int i = 0; i < N; i++) { CK(cudaSetDevice(i)); CK(cudaDeviceSynchronize()); } };
  auto ms = [&](cudaEvent_t a, cudaEvent_t b) { float m; CK(cudaEventElapsedTime(&m, a, b)); return m * 1000.f; };
  printf("# %d GPUs; GEMM n %d k %d L %d S %d fp32 %d tile_w %d; copies %zu MB to each peer in %d pieces (%s)\n", N, n, k, L, S, fp32, d[0].a.tile_w, mb, chunks, batched ? "one cudaMemcpyBatchAsync" : "cudaMemcpyPeerAsync each");
  for (int w = 0; w < 2; w++) { for (int i = 0; i < N; i++) { gemm(i); copy(i); } sync(); }
  const char *mode[3] = {"gemm alone", "copy alone", "both at once"};
  for (int rep = 0; rep < 3; rep++)
  for (int m = 0; m < 3; m++) {
    std::vector<float> tg, tc;
    for (int it = 0; it < 5; it++) {
      for (int i = 0; i < N; i++) { if (m != 1) gemm(i); if (m != 0) copy(i); }
      sync();
      float g = 0, c = 0;
      for (int i = 0; i < N; i++) { if (m != 1) g = std::max(g, ms(d[i].g0, d[i].g1)); if (m != 0) c = std::max(c, ms(d[i].c0, d[i].c1)); }
      tg.push_back(g); tc.push_back(c);
    }
    std::sort(tg.begin(), tg.end()); std::sort(tc.begin(), tc.end());
    const double out_gb = (double)B * (N - 1) / 1e9;
    printf("%-13s gemm %8.1f us   copy %8.1f us (%6.1f GB/s out of each GPU)\n", mode[m], tg[2], tc[2], tc[2] > 0 ? out_gb / (tc[2] * 1e-6) : 0.0);
  }
  return 0;
}
