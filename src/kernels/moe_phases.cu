/*
 * moe_phases.cu - the two small kernels of the prefill layer's phases by source (docs/moe.md,
 * "Phases by source"; api.h):
 *   parts: each local expert's segment cut into one part per source rank, expert-major, from the
 *          per-(expert, source) counts notify leaves in the handle's host counts: part (j, s) =
 *          [begin[j] + rows of sources < s for j, + rows of s for j); the last source's part of
 *          j also holds j's padding rows, so the parts tile [0, begin[L]) with no gap; and where
 *          each part's rows go in the phases' own row order ("phase rows": source by source,
 *          each part at a multiple of 4, as the FP8 GEMM's scale copies need). The row kernel
 *          writes h there, each phase's down projection reads and writes one source's block of
 *          it, and the expert-side reduce maps each expanded row to it.
 *   gate:  after a phase's expert-side reduce, this rank's gate word of that source is set (with
 *          release, GPU scope) for the gated combine running on another stream.
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"

namespace {

constexpr int kThreads = 256;

/* One block. The counts are read once, in parallel, into shared memory: they sit in mapped host
 * memory (written by notify before this kernel), where each read crosses PCIe (about 1 us), and
 * reading them where they are used, one thread a source, took 150 us at L 64, R 4 (4x H200). */
__global__ void __launch_bounds__(kThreads) moe_phase_parts_kernel(epx__moe_phase_parts_args_t a) {
  const int L = a.num_experts, R = a.num_sources;
  __shared__ int rows[EPX_MAX_EXPERTS]; /* [L][R]: L R = E <= EPX_MAX_EXPERTS */
  __shared__ int source_total[EPX_MAX_RANKS];
  for (int i = threadIdx.x; i < L * R; i += kThreads)
    rows[i] = *(volatile const int *)(a.source_counts + i);
  __syncthreads();
  for (int j = threadIdx.x; j < L; j += kThreads) {
    int row = __ldg(a.begin + j);
    for (int s = 0; s < R; s++) {
      const int n = rows[j * R + s];
      a.parts[(size_t)j * R + s] = row;
      a.part_count[(size_t)j * R + s] = n;
      row += n;
    }
  }
  if (threadIdx.x == 0) a.parts[(size_t)L * R] = __ldg(a.begin + L);
  if (threadIdx.x < R) { /* source s's phase rows, before the sources after it are placed */
    const int s = threadIdx.x;
    int row = 0;
    for (int j = 0; j < L; j++) row += (rows[j * R + s] + 3) / 4 * 4;
    source_total[s] = row;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    const int s = threadIdx.x;
    int row = 0;
    for (int q = 0; q < s; q++) row += source_total[q];
    for (int j = 0; j < L; j++) {
      a.phase_begin[(size_t)s * (L + 1) + j] = row;
      a.part_out[(size_t)j * R + s] = row;
      row += (rows[j * R + s] + 3) / 4 * 4;
    }
    a.phase_begin[(size_t)s * (L + 1) + L] = row;
  }
}

__global__ void moe_gate_kernel(unsigned *gate, unsigned value) {
  __threadfence(); /* every earlier kernel's writes on this stream are complete: publish them */
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gate), "r"(value) : "memory");
}

}  // namespace

extern "C" epx_status_t epx__moe_phase_parts_launch(const epx__moe_phase_parts_args_t *a,
                                                    cudaStream_t stream) {
  return epx::launch<moe_phase_parts_kernel>(dim3(1), kThreads, 0, stream, *a);
}

extern "C" epx_status_t epx__moe_gate_launch(unsigned *gate, unsigned value, cudaStream_t stream) {
  return epx::launch<moe_gate_kernel>(dim3(1), 1, 0, stream, gate, value);
}
