/*
 * agree.cu - the bounded agreement of a live group: every rank learns every rank's few words
 * through the control region of the symmetric workspace, or learns within the group's budget
 * that some rank did not come (agree.h, epx__agree_group).
 *
 * It replaces an NCCL collective wherever a step of a live group needs all ranks' words (the
 * trace dump, clear_peer_mask): an NCCL collective with a dead or stalled peer waits forever.
 * One warp; lane p talks to rank p. Lane p writes this rank's words into rank p's inbox of
 * the epoch's parity, then 2 x epoch into p's flag of that parity (release, system scope), then
 * waits for p's flag in our inbox to say the same epoch. If any lane fails (a timeout, or a
 * peer that gave this epoch up), every lane marks the epoch given up in every peer
 * (2 x epoch + 1), so that a rank arriving later fails it too instead of going on to a step
 * this rank will not take.
 * Ranks in `skip` (the caller gave up on them in an earlier agreement of the same step) are
 * neither written to nor waited for.
 * Invariant: the epoch lives in this rank's control region and only this kernel advances it;
 * every rank runs it once per agreement, even when its own part failed (its words say so). A
 * flag of another epoch than ours means the ranks fell out of step (one went on after an
 * agreement that another gave up at its very deadline): it fails at once, never reads words.
 */
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

__global__ void agree_kernel(epx__kernel_ctx_t ctx, const long long *mine, int n, long long *all,
                             unsigned skip, int *outcome) {
  const int lane = threadIdx.x;
  epx__control_t *own = epx::control_of(ctx);
  const uint64_t epoch = own->agree_epoch + 1, go = 2 * epoch, given_up = go + 1;
  const int parity = (int)(epoch & 1);
  __syncwarp();
  if (lane == 0) own->agree_epoch = epoch;
  const bool talk = lane < ctx.num_ranks && !((skip >> lane) & 1u);
  bool ok = true, timed_out = false;
  if (talk) {
    epx__control_t *peer = epx::control_of(ctx, lane);
    volatile long long *inbox = peer->agree_words[parity][ctx.rank];
    for (int w = 0; w < n; w++) inbox[w] = mine[w];
    epx::st_release_sys((uint64_t *)&peer->agree_flag[parity][ctx.rank], go);
    const uint64_t *flag = (const uint64_t *)&own->agree_flag[parity][lane];
    uint64_t seen = 0;
    const epx::WaitResult r = epx::wait_until(
        ctx.timeout_ns,
        [&] {
          seen = epx::ld_acquire_sys(flag);
          return seen >= go;
        },
        epx::NeverAbandon());
    timed_out = r != epx::WaitResult::kReady;
    ok = !timed_out && seen == go;
    if (ok) {
      const volatile long long *words = own->agree_words[parity][lane];
      for (int w = 0; w < n; w++) all[lane * n + w] = words[w];
      /* A peer that gave an agreement of ours up goes on without us and may already be
       * writing its next-but-one words here: the flag unchanged after the read vouches for
       * them (the fence keeps the word loads before the second flag load). */
      __threadfence_system();
      ok = epx::ld_acquire_sys(flag) == go;
    }
  }
  const unsigned failed = __ballot_sync(0xffffffffu, !ok);
  if (failed && talk)
    epx::st_release_sys((uint64_t *)&epx::control_of(ctx, lane)->agree_flag[parity][ctx.rank],
                        given_up);
  if (timed_out) epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_BARRIER, lane, -1, (long long)go);
  if (lane == 0) {
    outcome[0] = failed ? __ffs(failed) - 1 : -1;
    outcome[1] = (int)failed;
  }
}

}  // namespace

extern "C" epx_status_t epx__agree_launch(const epx__kernel_ctx_t *ctx, const long long *mine,
                                          int n, long long *all, unsigned skip, int *outcome,
                                          cudaStream_t stream) {
  return epx::launch<agree_kernel>(1, 32, 0, stream, *ctx, mine, n, all, skip, outcome);
}
