/*
 * test_group.c - multi-GPU tests of the group: create/destroy cycles without leaks, refusal of
 * mismatched or invalid configs on every rank (no hang), queries, the bounded barrier and its
 * timeout path, and use after destroy.
 *
 *   test                               config (T, H, E, K)        what
 *   group_create_destroy_100_cycles    128, 1024, 4R, 4           free memory equal after 1 and 100
 *   group_refuses_mismatched_config    64, 1024/2048 on rank 1    INVALID_USAGE on all ranks
 *   group_refuses_invalid_config_on_one_rank  top_k 0 on rank 0   INVALID_ARGUMENT / INVALID_USAGE
 *   barrier_orders_peer_writes         64, 512, 2R, 2             500 rounds write-barrier-check
 *   barrier_times_out_on_missing_peer  timeout 500 ms             TIMEOUT names the peer, <
 * budget+1s
 *   stale_handle_refused_by_new_group  64, 512, 2R, 2             a destroyed group's handle is
 *                                                                  refused by its successor
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "gpu/gpu_util.h"

EPX_GPU_TEST(group_create_destroy_100_cycles, 300) {
  epx_group_config_t c = gpu_test_config(128, 1024, 4 * t->num_ranks, 4);
  size_t free_after_first = 0, free_now = 0, total = 0;
  for (int cycle = 0; cycle < 100; cycle++) {
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &c, &g));
    int rank = -1, size = -1;
    EXPECT_OK(epx_group_rank(g, &rank));
    EXPECT_OK(epx_group_size(g, &size));
    EXPECT_EQ_INT(rank, t->rank);
    EXPECT_EQ_INT(size, t->num_ranks);
    size_t ws = 0, want = 0;
    EXPECT_OK(epx_group_workspace_bytes(g, &ws));
    EXPECT_OK(epx_workspace_size(&c, t->num_ranks, &want));
    EXPECT_EQ_INT(ws, want);
    epx_group_config_t got;
    EXPECT_OK(epx_group_get_config(g, &got));
    EXPECT_EQ_INT(got.hidden, 1024);
    EXPECT_EQ_INT(got.timeout_ms, 2000);
    EXPECT(got.num_sms > 0);
    EXPECT_OK(epx_group_barrier(g, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    EXPECT_OK(epx_group_destroy(g));
    /* Use after destroy is refused, not a crash. */
    EXPECT_STATUS(epx_group_barrier(g, t->stream), EPX_ERR_INVALID_USAGE);
    EXPECT_CUDA(cudaMemGetInfo(&free_now, &total));
    if (cycle == 0) free_after_first = free_now;
  }
  long long leaked = (long long)free_after_first - (long long)free_now;
  printf(
      "  rank %d: free device memory after cycle 1: %zu, after cycle 100: %zu (delta %lld bytes)\n",
      t->rank, free_after_first, free_now, leaked);
  /* Any per-cycle leak of 10 KiB or more over 99 cycles exceeds this bound. */
  EXPECTF(leaked < (1 << 20), "leaked %lld bytes over 99 create/destroy cycles", leaked);
  return TEST_PASS;
}

EPX_PEER_TEST(group_refuses_mismatched_config, 120) {
  epx_group_config_t c = gpu_test_config(64, 1024, 4 * t->num_ranks, 4);
  if (t->rank == 1) c.hidden = 2048;
  epx_group_t g = (epx_group_t)(void *)&c;
  EXPECT_STATUS(epx_group_create(t->comm, &c, &g), EPX_ERR_INVALID_USAGE);
  EXPECT(g == NULL);
  EXPECTF(strstr(epx_last_error(), "config.hidden") != NULL, "message: %s", epx_last_error());
  /* The communicator is still usable: a matching config works right after. */
  c.hidden = 1024;
  EXPECT_OK(epx_group_create(t->comm, &c, &g));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_PEER_TEST(group_refuses_invalid_config_on_one_rank, 120) {
  epx_group_config_t c = gpu_test_config(64, 1024, 4 * t->num_ranks, 4);
  if (t->rank == 0) c.top_k = 0;
  epx_group_t g = NULL;
  epx_status_t want = t->rank == 0 ? EPX_ERR_INVALID_ARGUMENT : EPX_ERR_INVALID_USAGE;
  EXPECT_STATUS(epx_group_create(t->comm, &c, &g), want);
  EXPECTF(strstr(epx_last_error(), t->rank == 0 ? "top_k" : "rank 0") != NULL, "message: %s",
          epx_last_error());
  /* Beyond what was compiled: refused as unsupported on every rank. */
  c = gpu_test_config(64, 1024, 4 * t->num_ranks, EPX_MAX_TOP_K + 1);
  EXPECT_STATUS(epx_group_create(t->comm, &c, &g),
                t->rank == 0 ? EPX_ERR_UNSUPPORTED : EPX_ERR_INVALID_USAGE);
  /* More SMs than the GPU has. */
  c = gpu_test_config(64, 1024, 4 * t->num_ranks, 4);
  c.num_sms = 1000;
  EXPECT_STATUS(epx_group_create(t->comm, &c, &g),
                t->rank == 0 ? EPX_ERR_INVALID_ARGUMENT : EPX_ERR_INVALID_USAGE);
  return TEST_PASS;
}

/* Each round: write a round-specific value into every peer's slot, barrier, check that all R
 * slots of this rank hold it. Rank 0 is delayed in odd rounds so that the barrier has to wait. */
EPX_GPU_TEST(barrier_orders_peer_writes, 120) {
  epx_group_config_t c = gpu_test_config(64, 512, 2 * t->num_ranks, 2);
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &c, &g));
  int *wrong_dev = NULL, wrong[500];
  EXPECT_CUDA(cudaMalloc((void **)&wrong_dev, sizeof wrong));
  uint64_t base = t->seed | 1;
  for (int round = 0; round < 500; round++) {
    uint64_t value = base + (uint64_t)round;
    if (t->rank == 0 && round % 2) EXPECT_CUDA(test_spin_ns(20000, t->stream));
    EXPECT_CUDA(test_write_peer_slots(g, value, t->stream));
    EXPECT_OK(epx_group_barrier(g, t->stream));
    EXPECT_CUDA(test_count_wrong_slots(g, value, wrong_dev + round, t->stream));
    /* A second barrier keeps fast ranks from overwriting before slow ones have checked. */
    EXPECT_OK(epx_group_barrier(g, t->stream));
  }
  EXPECT_CUDA(cudaMemcpyAsync(wrong, wrong_dev, sizeof wrong, cudaMemcpyDeviceToHost, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  for (int round = 0; round < 500; round++)
    EXPECTF(wrong[round] == 0, "round %d: %d stale slots", round, wrong[round]);
  EXPECT_NO_ASYNC_ERROR(g, __func__);
  EXPECT_CUDA(cudaFree(wrong_dev));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* The last rank skips a barrier; the others must come back with TIMEOUT naming it, within the
 * budget + 1 s, and the context must stay usable (the group can be destroyed cleanly). */
EPX_PEER_TEST(barrier_times_out_on_missing_peer, 120) {
  epx_group_config_t c = gpu_test_config(64, 512, 2 * t->num_ranks, 2);
  c.timeout_ms = 500;
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &c, &g));
  const int missing = t->num_ranks - 1;
  if (t->rank != missing) {
    double t0 = epx_test_now_s();
    EXPECT_OK(epx_group_barrier(g, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    double waited = epx_test_now_s() - t0;
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    printf("  rank %d: returned after %.3f s: %s\n", t->rank, waited, err.message);
    EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
    EXPECT_EQ_INT(err.stage, EPX_STAGE_BARRIER);
    EXPECT_EQ_INT(err.peer, missing);
    EXPECTF(waited < 0.5 + 1.0, "took %.3f s, budget 0.5 s", waited);
    EXPECT(strstr(err.message, "barrier") != NULL);
    EXPECT_OK(epx_group_clear_async_error(g));
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECT_EQ_INT(err.status, EPX_OK);
  }
  /* Everyone meets again on the host (NCCL) before destroying; the work queue stays usable. */
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* A handle outliving its group is refused by the group that replaces it, whether or not the new
 * group reuses the old one's address (it often does: same size, freed just before), and the new
 * group's own handle works. */
EPX_GPU_TEST(stale_handle_refused_by_new_group, 120) {
  const epx_group_config_t c = gpu_test_config(64, 512, 2 * t->num_ranks, 2);
  int same_address = 0;
  for (int round = 0; round < 4; round++) {
    epx_group_t old_group = NULL, g = NULL;
    epx_handle_t stale = NULL, fresh = NULL;
    EXPECT_OK(epx_group_create(t->comm, &c, &old_group));
    EXPECT_OK(epx_handle_create(old_group, &stale));
    EXPECT_OK(epx_group_destroy(old_group)); /* the handle is left behind on purpose */
    EXPECT_OK(epx_group_create(t->comm, &c, &g));
    same_address += g == old_group;
    epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
    EXPECT_STATUS(epx_combine(g, stale, &ca, t->stream), EPX_ERR_INVALID_USAGE);
    EXPECTF(strstr(epx_last_error(), "handle") != NULL, "message: %s", epx_last_error());
    epx_dispatch_result_t res;
    EXPECT_STATUS(epx_dispatch_cached(g, stale, NULL, EPX_DTYPE_BF16, NULL, &res, t->stream),
                  EPX_ERR_INVALID_USAGE);
    EXPECT_OK(epx_handle_create(g, &fresh));
    EXPECT_OK(epx_group_barrier(g, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    EXPECT_OK(epx_handle_destroy(fresh));
    EXPECT_OK(epx_group_destroy(g));
  }
  printf("  rank %d: the new group reused the old address in %d of 4 rounds\n", t->rank,
         same_address);
  return TEST_PASS;
}
