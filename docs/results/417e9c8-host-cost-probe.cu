// 417e9c8-host-cost-probe.cu (session 26): host cost of the CUDA runtime calls EPX's launch path
// makes, us per call, median of 5 x 2000, after 2000 small allocations. Build: nvcc -arch=sm_90 -O2
// -o hostcost this.cu
#include <cstdio>
#include <ctime>
#include <algorithm>
#include <cuda_runtime.h>
__global__ void empty_k(int *p) {
  if (p && threadIdx.x == 1234) *p = 1;
}
__global__ void big_k(int *p) {
  extern __shared__ int s[];
  if (p && threadIdx.x == 1234) *p = s[0];
}
static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}
template <class F>
double cost(F f) {
  double r[5];
  for (int k = 0; k < 5; k++) {
    double t0 = now();
    for (int i = 0; i < 2000; i++) f();
    cudaDeviceSynchronize();
    r[k] = (now() - t0) / 2000;
  }
  std::sort(r, r + 5);
  return r[2];
}
int main() {
  cudaSetDevice(0);
  int *d;
  cudaMalloc(&d, 1 << 20);
  // many allocations, as a process with a model has
  void *many[2000];
  for (int i = 0; i < 2000; i++) cudaMalloc(&many[i], 1 << 16);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaFuncSetAttribute(big_k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  printf("pointer_attributes %.2f\n", cost([&] {
           cudaPointerAttributes a;
           cudaPointerGetAttributes(&a, (char *)many[777] + 64);
         }));
  printf("stream_is_capturing %.2f\n", cost([&] {
           cudaStreamCaptureStatus c;
           cudaStreamIsCapturing(s, &c);
         }));
  printf("get_device %.2f\n", cost([&] {
           int x;
           cudaGetDevice(&x);
         }));
  printf("func_set_attribute %.2f\n", cost([&] {
           cudaFuncSetAttribute(big_k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
         }));
  printf("func_get_attributes %.2f\n", cost([&] {
           cudaFuncAttributes fa;
           cudaFuncGetAttributes(&fa, big_k);
         }));
  printf("launch_empty %.2f\n", cost([&] { empty_k<<<132, 256, 0, s>>>(d); }));
  printf("launch_ex_empty %.2f\n", cost([&] {
           cudaLaunchConfig_t c = {};
           c.gridDim = 132;
           c.blockDim = 256;
           c.stream = s;
           cudaLaunchKernelEx(&c, empty_k, d);
         }));
  printf("launch_big_smem %.2f\n", cost([&] { big_k<<<132, 256, 200 * 1024, s>>>(d); }));
  printf("set_attr+launch_big %.2f\n", cost([&] {
           cudaFuncSetAttribute(big_k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
           big_k<<<132, 256, 200 * 1024, s>>>(d);
         }));
  printf("memset_async %.2f\n", cost([&] { cudaMemsetAsync(d, 0, 4096, s); }));
  printf("event_record %.2f\n", cost([&] { cudaEventRecord(e, s); }));
  printf("stream_wait_event %.2f\n", cost([&] { cudaStreamWaitEvent(s, e, 0); }));
  printf("get_last_error %.2f\n", cost([&] { cudaGetLastError(); }));
  cudaDeviceSynchronize();
  printf("done %s\n", cudaGetErrorString(cudaGetLastError()));
}
