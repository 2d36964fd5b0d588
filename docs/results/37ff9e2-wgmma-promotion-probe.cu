// docs/results/37ff9e2-wgmma-promotion-probe.cu (session 19): how busy one SM's tensor cores stay under
// FP8 wgmma (E4M3, float32 accumulators, operands in shared memory) with and without a per-128-K
// promotion, at 1 or 2 consumer warpgroups. Scratch, not part of the library; results:
// docs/results/37ff9e2-H200-wgmma-promotion-probe.txt; docs/moe.md, "The promotion's ceiling".
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc <this file> -o wgbench
// (run from the repository root); run: ./wgbench (one GPU, ~1 s).
// scratch: wgmma issue efficiency, one SM's view. modes: 0 pure, 1 promote via partial (today),
// 2 rescale in place (wait all), 3 rescale in place pipelined by halves (wait<1>)
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "kernels/wgmma.cuh"
template <int N> struct W;
template <>
struct W<128> {
  static __device__ __forceinline__ void run(float *d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
template <>
struct W<192> {
  static __device__ __forceinline__ void run(float *d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}, %96, %97, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
template <>
struct W<256> {
  static __device__ __forceinline__ void run(float *d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
using namespace epx::wgmma;
constexpr int ITER = 4000;
template <int N, int MODE, int H, int NWG>
__global__ void __launch_bounds__(256, 1) k(long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  unsigned char *base = sm + ((1024u - ((uint32_t)__cvta_generic_to_shared(sm) & 1023u)) & 1023u);
  unsigned char *A = base, *B = base + 32768;
  float *sc = (float *)(base + 65536);
  for (int i = threadIdx.x; i < 65536 / 4; i += 256) ((uint32_t *)base)[i] = 0x38383838u;
  for (int i = threadIdx.x; i < 512; i += 256) sc[i] = 1.0f + 1e-7f * i;
  fence_proxy_async_smem();
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 4;
  if (wg >= NWG) return;
  constexpr int R = N / 2;
  constexpr int ACC = (MODE == 1 ? H * R : H * R);
  float acc[ACC];
  float part[MODE == 1 ? R : 1];
#pragma unroll
  for (int i = 0; i < ACC; i++) acc[i] = 0.f;
  part[0] = 0.f;
  const uint32_t b0 = (uint32_t)__cvta_generic_to_shared(B);
  long long c0 = clock64();
  for (int it = 0; it < ITER; it++) {
    const float *cb = sc + (it & 1) * 256;
    if constexpr (MODE == 0) {
#pragma unroll
      for (int h = 0; h < H; h++) {
        const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(A + (h * 128 + wg * 64) * 128);
        fence_regs<R>(acc + h * R);
        fence();
#pragma unroll
        for (int ks = 0; ks < 4; ks++) W<N>::run(acc + h * R, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), 1);
        commit();
      }
      wait<0>();
      fence_regs<ACC>(acc);
    } else if constexpr (MODE == 1) {
      if constexpr (N <= 160) {
#pragma unroll
        for (int h = 0; h < H; h++) {
          const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(A + (h * 128 + wg * 64) * 128);
          fence_regs<R>(part);
          fence();
#pragma unroll
          for (int ks = 0; ks < 4; ks++) W<N>::run(part, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), ks > 0);
          commit();
          wait<0>();
          fence_regs<R>(part);
          float *ah = acc + h * R;
#pragma unroll
          for (int j = 0; j < N / 8; j++) {
            const float2 c2 = *(const float2 *)(cb + 8 * j + 2 * t);
            ah[4 * j + 0] += part[4 * j + 0] * c2.x;
            ah[4 * j + 1] += part[4 * j + 1] * c2.y;
            ah[4 * j + 2] += part[4 * j + 2] * c2.x;
            ah[4 * j + 3] += part[4 * j + 3] * c2.y;
          }
        }
      }
    } else if constexpr (MODE == 2) {
#pragma unroll
      for (int h = 0; h < H; h++) {
        float *ah = acc + h * R;
#pragma unroll
        for (int j = 0; j < N / 8; j++) {
          const float2 c2 = *(const float2 *)(cb + 8 * j + 2 * t);
          ah[4 * j + 0] *= c2.x; ah[4 * j + 1] *= c2.y; ah[4 * j + 2] *= c2.x; ah[4 * j + 3] *= c2.y;
        }
        const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(A + (h * 128 + wg * 64) * 128);
        fence_regs<R>(ah);
        fence();
#pragma unroll
        for (int ks = 0; ks < 4; ks++) W<N>::run(ah, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), 1);
        commit();
      }
      wait<0>();
      fence_regs<ACC>(acc);
    } else if constexpr (MODE == 4 || MODE == 5) {  // ping-pong: the WGs take turns issuing (named barriers 1, 2)
      float *ah = acc;
      if (!(it == 0 && wg == 0)) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
      const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(A + (wg * 64) * 128);
      fence_regs<R>(ah);
      fence();
#pragma unroll
      for (int ks = 0; ks < 4; ks++) W<N>::run(ah, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), 1);
      commit();
      if (MODE == 5) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
      wait<0>();
      fence_regs<R>(ah);
      if (MODE == 4) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
#pragma unroll
      for (int j = 0; j < N / 8; j++) {
        const float2 c2 = *(const float2 *)(cb + 8 * j + 2 * t);
        ah[4 * j + 0] *= c2.x; ah[4 * j + 1] *= c2.y; ah[4 * j + 2] *= c2.x; ah[4 * j + 3] *= c2.y;
      }
    } else {  // MODE 3: H == 2, pipelined: rescale half h once its previous group is done
#pragma unroll
      for (int h = 0; h < H; h++) {
        float *ah = acc + h * R;
        wait<H - 1>();
        fence_regs<R>(ah);
#pragma unroll
        for (int j = 0; j < N / 8; j++) {
          const float2 c2 = *(const float2 *)(cb + 8 * j + 2 * t);
          ah[4 * j + 0] *= c2.x; ah[4 * j + 1] *= c2.y; ah[4 * j + 2] *= c2.x; ah[4 * j + 3] *= c2.y;
        }
        const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(A + (h * 128 + wg * 64) * 128);
        fence_regs<R>(ah);
        fence();
#pragma unroll
        for (int ks = 0; ks < 4; ks++) W<N>::run(ah, smem_desc(a0 + ks * 32), smem_desc(b0 + ks * 32), 1);
        commit();
      }
    }
  }
  if constexpr (MODE == 4 || MODE == 5) { if (wg == 0) asm volatile("bar.sync %0, 256;\n" ::"r"(1) : "memory"); }
  wait<0>();
  fence_regs<ACC>(acc);
  long long c1 = clock64();
  float s = 0;
#pragma unroll
  for (int i = 0; i < ACC; i++) s += acc[i];
  if (s == 12345.f) sink[threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) out[blockIdx.x * 2 + wg] = c1 - c0;
}
template <int N, int MODE, int H, int NWG>
void run(const char *name) {
  long long *d; float *sink;
  cudaMalloc(&d, 132 * 2 * 8); cudaMalloc(&sink, 4096);
  cudaMemset(d, 0, 132 * 16);
  auto kern = k<N, MODE, H, NWG>;
  int smem = 65536 + 4096 + 1024;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int rep = 0; rep < 3; rep++) {
    kern<<<132, 256, smem>>>(d, sink);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); exit(1); }
  }
  long long h[264]; cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  double mean = 0; int n = 0;
  for (int b = 0; b < 132; b++) for (int w = 0; w < NWG; w++) mean += h[b * 2 + w], n++;
  mean /= n;
  const double per_it = mean / ITER;
  const double tensor = (double)NWG * H * 4 * (N / 2);  // cycles of m64nNk32 at 8192 FLOP/clk
  printf("%-34s N %3d mode %d halves %d wgs %d: %7.1f cycles/iter, tensor work %6.0f, busy %5.1f%%\n",
         name, N, MODE, H, NWG, per_it, tensor, 100.0 * tensor / per_it);
  cudaFree(d); cudaFree(sink);
}
int main() {
  run<128, 0, 1, 1>("pure n128 1wg");
  run<128, 0, 1, 2>("pure n128 2wg");
  run<128, 0, 2, 1>("pure n128 tall 1wg");
  run<128, 0, 2, 2>("pure n128 tall 2wg");
  run<256, 0, 1, 1>("pure n256 1wg");
  run<256, 0, 1, 2>("pure n256 2wg");
  run<128, 1, 1, 2>("promote n128 (today, wide)");
  run<128, 1, 2, 2>("promote n128 tall (today)");
  run<128, 2, 2, 2>("rescale n128 tall");
  run<128, 3, 2, 2>("rescale n128 tall pipelined");
  run<128, 3, 2, 1>("rescale n128 tall pipelined 1wg");
  run<256, 2, 1, 2>("rescale n256");
  run<256, 2, 1, 1>("rescale n256 1wg");
  run<192, 2, 1, 2>("rescale n192");
  run<256, 4, 1, 2>("pingpong n256 arrive after wait");
  run<256, 5, 1, 2>("pingpong n256 arrive after issue");
  run<192, 4, 1, 2>("pingpong n192 arrive after wait");
  run<192, 5, 1, 2>("pingpong n192 arrive after issue");
  run<128, 4, 1, 2>("pingpong n128 arrive after wait");
  return 0;
}
