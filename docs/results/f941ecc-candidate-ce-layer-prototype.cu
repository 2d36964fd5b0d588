// docs/results/f941ecc-candidate-ce-layer-prototype.cu (session 18): written, compiled and reviewed (a helper
// read it for bounds, event logic and host lists; its findings are fixed). Run in session 19 on 4x H200:
// slower than the library's layer at both shapes (docs/results/ee0a183-4xH200-ce-layer-prototype.txt;
// docs/moe.md, "Copy engines beside the GEMM"). Build and run lines below, with this file's path in place
// of baseline/ce/ce_layer.cu; where libnccl is only libnccl.so.2 (the GPU machine's wheel), pass it to
// nvcc as -Xlinker <path>.
// ce_layer.cu - scratch (session 18): a timing prototype of the prefill MoE layer with its
// transfers on the copy engines, one process driving every visible GPU (peer access on).
//
// Per chunk c and GPU g (rank g of N; experts e in [g L, g L + L)):
//   compute stream: pack(c): each of g's (token, slot) rows whose expert is on rank r, FP8 codes and
//     scales, into g's send buffer block for r (ordered by local expert, then token; the block
//     for g itself straight into g's receive buffer)
//   comm streams (one per peer r): copies of r's block (codes, then scales) to r's receive
//                   buffer for chunk c, source g (cudaMemcpyPeerAsync: copy engines, no SM);
//                   event sent[g][c][r]
//   compute stream: wait sent[s][c][g] for every s; the FFN on the received rows as the layer runs it
//     (segment scales, gate/up grouped GEMM float32 out, SwiGLU + FP8 row kernel, down grouped
//     GEMM BF16 out: libepx's own launchers); the expert-side reduce: per source s and token of
//     s with experts here, the weighted sum of its rows, into block s of g's return buffer (its
//     own block straight into its home buffer)
//   comm streams:   copies of each return block back to its source; event returned[g][c][s]
//   compute stream: (after the next chunk's FFN) wait returned[r][c][g] for every r; the home
//     sum of the partial rows into out.
// Compute-stream order: pack(0), pack(1), FFN(0), pack(2), home(-), FFN(1), ... so that chunk
// c + 1's copies run beside chunk c's FFN.
// Timing only: the GEMMs run their segments as [expert] blocks of the right sizes over the
// [source][expert] receive layout (the real layer needs either segments per (expert, source) in
// the GEMM's tile lookup or an unpack pass; --unpack 1 adds such a pass: a gather copy of every
// received row). Counts are computed on the host beforehand (the real layer exchanges them: a
// small copy beside the rows). Nothing is checked.
//
// Build (repository root, after make lib; NL = libnccl.so of the toolkit or of the NCCL wheel):
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -Isrc/include \
//     baseline/ce/ce_layer.cu -o ce_layer build/lib/libepx.a $NL -lcuda -ldl -lpthread
// Run: ./ce_layer [deepseek|qwen3] [--tokens 4096] [--chunks 1,2,3,4] [--unpack 0|1]
#include "kernels/api.h"
#include "moe_prefill.h"
#include "moe_tiles.h"
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <random>
#include <vector>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      printf("CUDA %s at line %d: %s\n", cudaGetErrorString(e_), __LINE__, #x);          \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
#define EK(x)                                                                            \
  do {                                                                                   \
    if ((x) != EPX_OK) {                                                                 \
      printf("epx: %s at line %d\n", epx_last_error(), __LINE__);                        \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

__global__ void fill_bytes(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995, h ^= h >> 15;
    p[i] = (uint8_t)(h & 0x37) | (uint8_t)(h >> 24 & 0x80) | 0x08; /* small, no NaN codes */
  }
}
__global__ void fill_f(float *p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = v;
}

/* rows[i] <- x[tok[i]] (H bytes) and its H/128 scales; a warp a row */
__global__ void pack_rows(const uint8_t *x, const float *xs, int H, const int *tok, int n,
                          uint8_t *rows, float *scales) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int nw = gridDim.x * blockDim.x / 32;
  for (int i = warp; i < n; i += nw) {
    const uint4 *src = (const uint4 *)(x + (size_t)tok[i] * H);
    uint4 *dst = (uint4 *)(rows + (size_t)i * H);
    for (int c = lane; c < H / 16; c += 32) dst[c] = src[c];
    for (int c = lane; c < H / 128; c += 32)
      scales[(size_t)i * (H / 128) + c] = xs[(size_t)tok[i] * (H / 128) + c];
  }
}

/* out[i] = sum over k < K with idx[i K + k] >= 0 of w[i K + k] x in[idx[i K + k]] (BF16 rows of H,
 * float32 sums); a warp a row, 8 columns a lane a step */
__global__ void sum_rows(const __nv_bfloat16 *in, int H, const int *idx, const float *w, int n,
                         int K, __nv_bfloat16 *out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int nw = gridDim.x * blockDim.x / 32;
  for (int i = warp; i < n; i += nw) {
    for (int c = lane * 8; c < H; c += 256) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < K; k++) {
        const int r = idx[(size_t)i * K + k];
        if (r < 0) continue;
        const float wk = w ? w[(size_t)i * K + k] : 1.f;
        const uint4 v = *(const uint4 *)(in + (size_t)r * H + c);
        const __nv_bfloat162 *p = (const __nv_bfloat162 *)&v;
        for (int q = 0; q < 4; q++) {
          const float2 f = __bfloat1622float2(p[q]);
          acc[2 * q] += wk * f.x, acc[2 * q + 1] += wk * f.y;
        }
      }
      uint4 o;
      __nv_bfloat162 *po = (__nv_bfloat162 *)&o;
      for (int q = 0; q < 4; q++) po[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      *(uint4 *)(out + (size_t)i * H + c) = o;
    }
  }
}

/* dst[i] <- src[perm[i]], rows of `bytes` (a multiple of 16); a warp a row */
__global__ void gather_rows(const uint8_t *src, size_t bytes, const int *perm, int n,
                            uint8_t *dst) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int nw = gridDim.x * blockDim.x / 32;
  for (int i = warp; i < n; i += nw) {
    const uint4 *s = (const uint4 *)(src + (size_t)perm[i] * bytes);
    uint4 *d = (uint4 *)(dst + (size_t)i * bytes);
    for (size_t c = lane; c < bytes / 16; c += 32) d[c] = s[c];
  }
}

/* Holds a stream until the host has queued a whole call on every GPU (then all start together,
 * as ranks in separate processes would); gives up after 5 s. */
__global__ void gate(const volatile int *flag, int want) {
  const long long t0 = clock64();
  while (*flag != want && clock64() - t0 < 10000000000ll) {
  }
}

struct Shape {
  const char *name;
  int H, I, E, K;
};

template <typename T>
static T *dev_copy(const std::vector<T> &v) {
  T *p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct Chunk { /* one GPU's buffers and lists for one chunk */
  int t0, T;
  /* as a source: per destination r, the tokens of its rows (ordered by local expert, token) */
  std::vector<std::vector<int>> to_tok;
  std::vector<int *> to_tok_d;
  uint8_t *send = nullptr; /* [rows to remote ranks, by r] x H */
  float *send_s = nullptr;
  std::vector<size_t> send_off; /* rows before r's block */
  /* as a receiver: blocks by source s */
  std::vector<int> from_rows; /* rows from s */
  std::vector<size_t> recv_off;
  int recv_rows = 0, gemm_rows = 0; /* received; padded per expert (the GEMMs' rows) */
  uint8_t *recv = nullptr, *recv_perm = nullptr;
  float *recv_s = nullptr;
  int *perm_d = nullptr;
  std::vector<int> begin; /* [L + 1], padded to EPX__MOE_ALIGN */
  int *begin_d = nullptr, *count_d = nullptr;
  float *xs_seg = nullptr, *h_s = nullptr;
  float *gu = nullptr;
  uint8_t *h = nullptr;
  __nv_bfloat16 *y = nullptr;
  /* expert-side reduce: per source s, its tokens with experts here: K row indices, K weights */
  std::vector<int> red_rows; /* per s */
  std::vector<size_t> red_off;
  int *red_idx_d = nullptr;
  float *red_w_d = nullptr;
  __nv_bfloat16 *red = nullptr; /* [sum over s] x H, block s for s */
  /* home: back[r block] x H from each rank r; per token of the chunk N indices into back */
  std::vector<int> back_rows;
  std::vector<size_t> back_off;
  __nv_bfloat16 *back = nullptr;
  int *home_idx_d = nullptr;
  cudaEvent_t packed, reduced;
  std::vector<cudaEvent_t> sent, returned; /* [peer] */
};

struct Gpu {
  uint8_t *x, *w_gu, *w_dn;
  float *xs, *ws_gu, *ws_dn;
  __nv_bfloat16 *out;
  cudaStream_t gs;
  std::vector<cudaStream_t> cs; /* [peer]: one copy stream each */
  cudaEvent_t t0, t1;
  std::vector<Chunk> ch;
  int sms;
};

int main(int argc, char **argv) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 0); /* no first-launch module load behind the gate */
  const Shape shapes[] = {{"deepseek", 7168, 2048, 256, 8}, {"qwen3", 2048, 768, 128, 8}};
  Shape sh = shapes[0];
  int T = 4096, unpack = 0;
  std::vector<int> chunk_list = {1, 2, 3, 4};
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "qwen3")) sh = shapes[1];
    else if (!strcmp(argv[i], "deepseek")) sh = shapes[0];
    else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--unpack") && i + 1 < argc) unpack = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--chunks") && i + 1 < argc) {
      chunk_list.clear();
      for (char *p = strtok(argv[++i], ","); p; p = strtok(nullptr, ",")) chunk_list.push_back(atoi(p));
    } else {
      printf("usage: %s [deepseek|qwen3] [--tokens 4096] [--chunks 1,2,3,4] [--unpack 0|1]\n", argv[0]);
      return 2;
    }
  }
  int N = 0;
  CK(cudaGetDeviceCount(&N));
  const int H = sh.H, I = sh.I, E = sh.E, K = sh.K, L = E / N;
  if (E % N) return printf("experts %d over %d GPUs\n", E, N), 1;
  const int kb_h = H / 128, kb_i = I / 128, kb4_h = (kb_h + 3) / 4 * 4, kb4_i = (kb_i + 3) / 4 * 4;

  /* routing: K distinct experts a token, uniform; weights uniform in (0, 1) */
  std::mt19937 rng(12345);
  std::vector<std::vector<int>> topk(N, std::vector<int>((size_t)T * K));
  std::vector<std::vector<float>> topw(N, std::vector<float>((size_t)T * K));
  for (int g = 0; g < N; g++)
    for (int t = 0; t < T; t++) {
      std::vector<int> pick;
      while ((int)pick.size() < K) {
        const int e = (int)(rng() % E);
        if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
      }
      for (int k = 0; k < K; k++)
        topk[g][(size_t)t * K + k] = pick[k], topw[g][(size_t)t * K + k] = (rng() % 1000 + 1) / 1000.f;
    }

  std::vector<Gpu> gpu(N);
  for (int g = 0; g < N; g++) {
    CK(cudaSetDevice(g));
    for (int j = 0; j < N; j++)
      if (j != g) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
      }
    (void)cudaGetLastError();
    Gpu &G = gpu[g];
    CK(cudaDeviceGetAttribute(&G.sms, cudaDevAttrMultiProcessorCount, g));
    const size_t nw_gu = (size_t)L * 2 * I * H, nw_dn = (size_t)L * H * I;
    CK(cudaMalloc(&G.x, (size_t)T * H));
    CK(cudaMalloc(&G.xs, (size_t)T * kb_h * 4));
    CK(cudaMalloc(&G.w_gu, nw_gu));
    CK(cudaMalloc(&G.w_dn, nw_dn));
    CK(cudaMalloc(&G.ws_gu, (size_t)L * (2 * I / 128) * kb4_h * 4));
    CK(cudaMalloc(&G.ws_dn, (size_t)L * (H / 128) * kb4_i * 4));
    CK(cudaMalloc(&G.out, (size_t)T * H * 2));
    fill_bytes<<<1024, 256>>>(G.x, (size_t)T * H, 1 + g);
    fill_bytes<<<1024, 256>>>(G.w_gu, nw_gu, 11 + g);
    fill_bytes<<<1024, 256>>>(G.w_dn, nw_dn, 21 + g);
    fill_f<<<256, 256>>>(G.xs, (size_t)T * kb_h, 1.f / 64);
    fill_f<<<256, 256>>>(G.ws_gu, (size_t)L * (2 * I / 128) * kb4_h, 1.f / 64);
    fill_f<<<256, 256>>>(G.ws_dn, (size_t)L * (H / 128) * kb4_i, 1.f / 64);
    CK(cudaStreamCreateWithFlags(&G.gs, cudaStreamNonBlocking));
    G.cs.assign(N, nullptr);
    for (int r = 0; r < N; r++) CK(cudaStreamCreateWithFlags(&G.cs[r], cudaStreamNonBlocking));
    CK(cudaEventCreate(&G.t0));
    CK(cudaEventCreate(&G.t1));
    CK(cudaDeviceSynchronize());
  }
  int *flag = nullptr;
  CK(cudaHostAlloc((void **)&flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  *flag = 0;
  int round = 0;
  printf("# ce_layer: %s (H %d, I %d, E %d, top-%d), %d GPUs, %d tokens a GPU, unpack %d\n", sh.name,
         H, I, E, K, N, T, unpack);
  printf("%-6s %-12s %9s %9s %9s\n", "chunks", "variant", "median_us", "min_us", "max_us");

  for (int C : chunk_list) {
    /* ---- lists and buffers for C chunks ---- */
    for (int g = 0; g < N; g++) {
      CK(cudaSetDevice(g));
      gpu[g].ch.assign(C, Chunk());
    }
    for (int c = 0; c < C; c++) {
      const int t0 = (int)((long long)T * c / C), t1 = (int)((long long)T * (c + 1) / C);
      /* as sources: rows to each rank, by (local expert, token); the token and slot of each */
      std::vector<std::vector<std::vector<std::pair<int, int>>>> rows_to(
          N, std::vector<std::vector<std::pair<int, int>>>(N)); /* [g][r] (token, slot) */
      for (int g = 0; g < N; g++)
        for (int r = 0; r < N; r++) {
          auto &v = rows_to[g][r];
          for (int el = 0; el < L; el++)
            for (int t = t0; t < t1; t++)
              for (int k = 0; k < K; k++)
                if (topk[g][(size_t)t * K + k] == r * L + el) v.push_back({t, k});
        }
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        Chunk &ch = gpu[g].ch[c];
        ch.t0 = t0, ch.T = t1 - t0;
        ch.to_tok.assign(N, {});
        ch.to_tok_d.assign(N, nullptr);
        ch.send_off.assign(N + 1, 0);
        for (int r = 0; r < N; r++) {
          for (auto &p : rows_to[g][r]) ch.to_tok[r].push_back(p.first);
          ch.to_tok_d[r] = dev_copy(ch.to_tok[r]);
          ch.send_off[r + 1] = ch.send_off[r] + (r == g ? 0 : ch.to_tok[r].size());
        }
        CK(cudaMalloc(&ch.send, std::max<size_t>(1, ch.send_off[N]) * H));
        CK(cudaMalloc(&ch.send_s, std::max<size_t>(1, ch.send_off[N]) * kb_h * 4));
        /* as the receiver */
        ch.from_rows.assign(N, 0);
        ch.recv_off.assign(N + 1, 0);
        std::vector<int> count(L, 0);
        for (int s = 0; s < N; s++) {
          ch.from_rows[s] = (int)rows_to[s][g].size();
          ch.recv_off[s + 1] = ch.recv_off[s] + ch.from_rows[s];
          for (auto &p : rows_to[s][g]) count[topk[s][(size_t)p.first * K + p.second] - g * L]++;
        }
        ch.recv_rows = (int)ch.recv_off[N];
        ch.begin.assign(L + 1, 0);
        for (int e = 0; e < L; e++)
          ch.begin[e + 1] = ch.begin[e] + (count[e] + EPX__MOE_ALIGN - 1) / EPX__MOE_ALIGN * EPX__MOE_ALIGN;
        ch.gemm_rows = std::max(ch.begin[L], ch.recv_rows);
        const size_t R = (size_t)ch.gemm_rows + 256; /* the GEMM reads whole boxes past the end */
        CK(cudaMalloc(&ch.recv, R * H));
        CK(cudaMalloc(&ch.recv_s, R * kb_h * 4));
        CK(cudaMemset(ch.recv, 0, R * H));
        CK(cudaMemset(ch.recv_s, 0, R * kb_h * 4));
        if (unpack) {
          CK(cudaMalloc(&ch.recv_perm, R * H));
          std::vector<int> perm(ch.recv_rows); /* a shuffle: the reorder's traffic */
          for (int i = 0; i < ch.recv_rows; i++) perm[i] = i;
          std::shuffle(perm.begin(), perm.end(), rng);
          ch.perm_d = dev_copy(perm);
        }
        ch.begin_d = dev_copy(ch.begin);
        ch.count_d = dev_copy(count);
        CK(cudaMalloc(&ch.xs_seg, R * kb_h * 4));
        CK(cudaMalloc(&ch.gu, R * 2 * I * 4));
        CK(cudaMalloc(&ch.h, R * I));
        CK(cudaMalloc(&ch.h_s, R * kb_i * 4));
        CK(cudaMalloc(&ch.y, R * H * 2));
        CK(cudaMemset(ch.y, 0, R * H * 2));
        /* expert-side reduce lists: per source s, its tokens with experts here (token order) */
        ch.red_rows.assign(N, 0);
        ch.red_off.assign(N + 1, 0);
        std::vector<int> ridx;
        std::vector<float> rw;
        for (int s = 0; s < N; s++) {
          /* row positions of (token, slot) in s's block, by token */
          std::vector<std::vector<std::pair<int, int>>> by_tok(t1 - t0);
          for (size_t i = 0; i < rows_to[s][g].size(); i++) {
            auto &p = rows_to[s][g][i];
            by_tok[p.first - t0].push_back({(int)(ch.recv_off[s] + i), p.second});
          }
          for (int t = 0; t < t1 - t0; t++) {
            if (by_tok[t].empty()) continue;
            for (int k = 0; k < K; k++) {
              if (k < (int)by_tok[t].size()) {
                ridx.push_back(by_tok[t][k].first);
                rw.push_back(topw[s][(size_t)(t + t0) * K + by_tok[t][k].second]);
              } else {
                ridx.push_back(-1);
                rw.push_back(0.f);
              }
            }
            ch.red_rows[s]++;
          }
          ch.red_off[s + 1] = ch.red_off[s] + ch.red_rows[s];
        }
        ch.red_idx_d = dev_copy(ridx);
        ch.red_w_d = dev_copy(rw);
        CK(cudaMalloc(&ch.red, std::max<size_t>(1, ch.red_off[N]) * H * 2));
        CK(cudaEventCreateWithFlags(&ch.packed, cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&ch.reduced, cudaEventDisableTiming));
        ch.sent.assign(N, nullptr);
        ch.returned.assign(N, nullptr);
        for (int r = 0; r < N; r++) {
          CK(cudaEventCreateWithFlags(&ch.sent[r], cudaEventDisableTiming));
          CK(cudaEventCreateWithFlags(&ch.returned[r], cudaEventDisableTiming));
        }
      }
      /* home lists: each rank r returns red block g to g; back[g] = blocks by r */
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        Chunk &ch = gpu[g].ch[c];
        ch.back_rows.assign(N, 0);
        ch.back_off.assign(N + 1, 0);
        for (int r = 0; r < N; r++) {
          ch.back_rows[r] = gpu[r].ch[c].red_rows[g];
          ch.back_off[r + 1] = ch.back_off[r] + ch.back_rows[r];
        }
        CK(cudaMalloc(&ch.back, std::max<size_t>(1, ch.back_off[N]) * H * 2));
        /* per token of the chunk: its index in each rank's block (or -1), N entries */
        std::vector<int> hidx((size_t)(t1 - t0) * N, -1);
        for (int r = 0; r < N; r++) {
          int i = 0;
          for (int t = t0; t < t1; t++) {
            bool any = false;
            for (int k = 0; k < K; k++) any |= topk[g][(size_t)t * K + k] / L == r;
            if (any) hidx[(size_t)(t - t0) * N + r] = (int)ch.back_off[r] + i++;
          }
        }
        ch.home_idx_d = dev_copy(hidx);
      }
    }
    for (int g = 0; g < N; g++) {
      CK(cudaSetDevice(g));
      CK(cudaDeviceSynchronize());
    }

    /* ---- the pieces ---- */
    auto pack = [&](int g, int c) {
      Chunk &ch = gpu[g].ch[c];
      for (int r = 0; r < N; r++) {
        const int n = (int)ch.to_tok[r].size();
        if (!n) continue;
        uint8_t *rows = r == g ? ch.recv + ch.recv_off[g] * H : ch.send + ch.send_off[r] * H;
        float *sc = r == g ? ch.recv_s + ch.recv_off[g] * kb_h : ch.send_s + ch.send_off[r] * kb_h;
        pack_rows<<<std::min(2 * gpu[g].sms, (n + 7) / 8), 256, 0, gpu[g].gs>>>(
            gpu[g].x, gpu[g].xs, H, ch.to_tok_d[r], n, rows, sc);
      }
      CK(cudaGetLastError());
    };
    auto send = [&](int g, int c) { /* on g's copy stream for each peer; sent[r] after r's */
      Chunk &ch = gpu[g].ch[c];
      for (int o = 1; o < N; o++) {
        const int r = (g + o) % N;
        const size_t n = ch.to_tok[r].size();
        Chunk &rc = gpu[r].ch[c];
        if (n) {
          CK(cudaMemcpyPeerAsync(rc.recv + rc.recv_off[g] * H, r, ch.send + ch.send_off[r] * H, g, n * H,
                                 gpu[g].cs[r]));
          CK(cudaMemcpyPeerAsync(rc.recv_s + rc.recv_off[g] * kb_h, r, ch.send_s + ch.send_off[r] * kb_h, g,
                                 n * kb_h * 4, gpu[g].cs[r]));
        }
        CK(cudaEventRecord(ch.sent[r], gpu[g].cs[r]));
      }
    };
    auto ffn = [&](int g, int c) { /* on g's compute stream */
      Gpu &G = gpu[g];
      Chunk &ch = G.ch[c];
      const uint8_t *x = ch.recv;
      if (unpack && ch.recv_rows) {
        gather_rows<<<2 * G.sms, 256, 0, G.gs>>>(ch.recv, H, ch.perm_d, ch.recv_rows, ch.recv_perm);
        /* and the scales (in place of a second buffer: timing only) */
        gather_rows<<<2 * G.sms, 256, 0, G.gs>>>((const uint8_t *)ch.recv_s, (size_t)kb_h * 4, ch.perm_d,
                                                 ch.recv_rows, (uint8_t *)ch.xs_seg);
        CK(cudaGetLastError());
        x = ch.recv_perm;
      }
      const epx__moe_segment_scales_launch_args_t sa = {ch.recv_s, ch.xs_seg, ch.gemm_rows, kb_h, L,
                                                        ch.begin_d, ch.count_d, 2 * G.sms};
      EK(epx__moe_segment_scales_launch(&sa, G.gs));
      const int tx = epx__moe_pick_tile_x(ch.begin.data(), L);
      epx__moe_gemm_fp8_args_t a;
      memset(&a, 0, sizeof a);
      a.w = G.w_gu, a.w_stride = (size_t)2 * I * H, a.w_scales = G.ws_gu;
      a.ws_stride = (size_t)(2 * I / 128) * kb4_h, a.ws_kb = kb4_h;
      a.x = x, a.x_scales = ch.xs_seg, a.y = ch.gu, a.y_fp32 = 1, a.n = 2 * I, a.k = H;
      a.num_experts = L, a.begin = ch.begin_d, a.x_rows = ch.gemm_rows, a.num_ctas = G.sms;
      a.tile_x = tx, a.tile_w = epx__moe_pick_tile_w(2 * I, tx);
      if (ch.gemm_rows) EK(epx__moe_gemm_fp8_launch(&a, G.gs));
      epx__moe_rows_launch_args_t ra;
      memset(&ra, 0, sizeof ra);
      ra.in = ch.gu, ra.in_fp32 = 1, ra.swiglu = 1, ra.quantize = 1, ra.out = ch.h, ra.scales = ch.h_s;
      ra.cols = I, ra.num_rows = ch.gemm_rows, ra.num_experts = L, ra.begin = ch.begin_d;
      ra.count = ch.count_d, ra.num_blocks = 2 * G.sms;
      if (ch.gemm_rows) EK(epx__moe_rows_launch(&ra, G.gs));
      a.w = G.w_dn, a.w_stride = (size_t)H * I, a.w_scales = G.ws_dn;
      a.ws_stride = (size_t)(H / 128) * kb4_i, a.ws_kb = kb4_i;
      a.x = ch.h, a.x_scales = ch.h_s, a.y = ch.y, a.y_fp32 = 0, a.n = H, a.k = I;
      a.tile_w = epx__moe_pick_tile_w(H, tx);
      if (ch.gemm_rows) EK(epx__moe_gemm_fp8_launch(&a, G.gs));
      /* the expert-side reduce: block s of red for each source; g's own straight into back */
      for (int s = 0; s < N; s++) {
        const int nr = ch.red_rows[s];
        if (!nr) continue;
        __nv_bfloat16 *dst = s == g ? ch.back + ch.back_off[g] * H : ch.red + ch.red_off[s] * H;
        sum_rows<<<std::min(2 * G.sms, (nr + 7) / 8), 256, 0, G.gs>>>(
            ch.y, H, ch.red_idx_d + ch.red_off[s] * K, ch.red_w_d + ch.red_off[s] * K, nr, K, dst);
      }
      CK(cudaGetLastError());
    };
    auto ret = [&](int g, int c) { /* on g's copy stream for each peer s: red block s to s */
      Chunk &ch = gpu[g].ch[c];
      for (int o = 1; o < N; o++) {
        const int s = (g + o) % N;
        const size_t n = ch.red_rows[s];
        Chunk &sc = gpu[s].ch[c];
        if (n)
          CK(cudaMemcpyPeerAsync(sc.back + sc.back_off[g] * H, s, ch.red + ch.red_off[s] * H, g, n * H * 2,
                                 gpu[g].cs[s]));
        CK(cudaEventRecord(ch.returned[s], gpu[g].cs[s]));
      }
    };
    auto home = [&](int g, int c) { /* on g's compute stream */
      Chunk &ch = gpu[g].ch[c];
      if (!ch.T) return;
      sum_rows<<<std::min(2 * gpu[g].sms, (ch.T + 7) / 8), 256, 0, gpu[g].gs>>>(
          ch.back, H, ch.home_idx_d, nullptr, ch.T, N, gpu[g].out + (size_t)ch.t0 * H);
      CK(cudaGetLastError());
    };

    /* ---- one layer call: every GPU's work queued, chunk by chunk ---- */
    auto layer = [&]() {
      auto send_after_pack = [&](int g, int c) {
        CK(cudaEventRecord(gpu[g].ch[c].packed, gpu[g].gs));
        for (int r = 0; r < N; r++)
          if (r != g) CK(cudaStreamWaitEvent(gpu[g].cs[r], gpu[g].ch[c].packed, 0));
        send(g, c);
      };
      auto wait_returned = [&](int g, int c) {
        for (int r = 0; r < N; r++)
          if (r != g) CK(cudaStreamWaitEvent(gpu[g].gs, gpu[r].ch[c].returned[g], 0));
      };
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        gate<<<1, 1, 0, gpu[g].gs>>>(flag, round);
        CK(cudaEventRecord(gpu[g].t0, gpu[g].gs));
        for (int c = 0; c < std::min(C, 2); c++) pack(g, c), send_after_pack(g, c);
      }
      for (int c = 0; c < C; c++) {
        for (int g = 0; g < N; g++) {
          CK(cudaSetDevice(g));
          for (int s = 0; s < N; s++)
            if (s != g) CK(cudaStreamWaitEvent(gpu[g].gs, gpu[s].ch[c].sent[g], 0));
          ffn(g, c);
          CK(cudaEventRecord(gpu[g].ch[c].reduced, gpu[g].gs));
          for (int r = 0; r < N; r++)
            if (r != g) CK(cudaStreamWaitEvent(gpu[g].cs[r], gpu[g].ch[c].reduced, 0));
          ret(g, c);
          if (c + 2 < C) pack(g, c + 2), send_after_pack(g, c + 2);
          if (c >= 1) wait_returned(g, c - 1), home(g, c - 1);
        }
      }
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        wait_returned(g, C - 1);
        home(g, C - 1);
        CK(cudaEventRecord(gpu[g].t1, gpu[g].gs));
      }
    };
    /* the FFN pieces alone (no waits, no copies) and the copies alone */
    auto ffn_only = [&]() {
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        gate<<<1, 1, 0, gpu[g].gs>>>(flag, round);
        CK(cudaEventRecord(gpu[g].t0, gpu[g].gs));
        for (int c = 0; c < C; c++) ffn(g, c);
        CK(cudaEventRecord(gpu[g].t1, gpu[g].gs));
      }
    };
    auto copies_only = [&]() {
      for (int g = 0; g < N; g++) {
        CK(cudaSetDevice(g));
        gate<<<1, 1, 0, gpu[g].gs>>>(flag, round);
        CK(cudaEventRecord(gpu[g].t0, gpu[g].gs));
        for (int r = 0; r < N; r++)
          if (r != g) CK(cudaStreamWaitEvent(gpu[g].cs[r], gpu[g].t0, 0));
        for (int c = 0; c < C; c++) send(g, c), ret(g, c);
        for (int r = 0; r < N; r++)
          if (r != g) CK(cudaStreamWaitEvent(gpu[g].gs, gpu[g].ch[C - 1].returned[r], 0));
        CK(cudaEventRecord(gpu[g].t1, gpu[g].gs));
      }
    };
    auto timed = [&](const char *name, auto fn) {
      std::vector<float> v;
      for (int it = 0; it < 7; it++) {
        for (int g = 0; g < N; g++) {
          CK(cudaSetDevice(g));
          CK(cudaDeviceSynchronize());
        }
        round++;
        fn();
        *flag = round; /* every GPU's call is queued: release them */
        float worst = 0;
        for (int g = 0; g < N; g++) {
          CK(cudaSetDevice(g));
          CK(cudaEventSynchronize(gpu[g].t1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, gpu[g].t0, gpu[g].t1));
          worst = std::max(worst, ms * 1000.f);
        }
        if (it >= 2) v.push_back(worst); /* two warm-ups */
      }
      std::sort(v.begin(), v.end());
      printf("%-6d %-12s %9.1f %9.1f %9.1f\n", C, name, v[v.size() / 2], v.front(), v.back());
      fflush(stdout);
    };
    timed("layer", layer);
    timed("ffn_only", ffn_only);
    timed("copies_only", copies_only);

    /* free this chunk count's buffers */
    for (int g = 0; g < N; g++) {
      CK(cudaSetDevice(g));
      CK(cudaDeviceSynchronize());
      for (Chunk &ch : gpu[g].ch) {
        for (int *p : ch.to_tok_d) cudaFree(p);
        void *bufs[] = {ch.send, ch.send_s, ch.recv, ch.recv_perm, ch.recv_s, ch.perm_d, ch.begin_d,
                        ch.count_d, ch.xs_seg, ch.h_s, ch.gu, ch.h, ch.y, ch.red_idx_d, ch.red_w_d,
                        ch.red, ch.back, ch.home_idx_d};
        for (void *p : bufs)
          if (p) cudaFree(p);
        cudaEventDestroy(ch.packed), cudaEventDestroy(ch.reduced);
        for (int r = 0; r < N; r++) cudaEventDestroy(ch.sent[r]), cudaEventDestroy(ch.returned[r]);
      }
      gpu[g].ch.clear();
    }
  }
  return 0;
}
