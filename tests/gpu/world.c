/*
 * world.c - the GPU tests' random world and its device copies (see world.h).
 */
#include "gpu/world.h"

#include <stdlib.h>
#include <string.h>

void world_route_token(int64_t *ids, int K, int E, int R, route_t route, uint64_t *rng) {
  for (int k = 0; k < K; k++) {
    int64_t e = -1;
    if (route == ROUTE_ONE_EXPERT) {
      e = E / 2;
    } else if (route == ROUTE_DUPLICATES) {
      e = (k > 0 && epx_test_rand_int(rng, 3) == 0) ? ids[epx_test_rand_int(rng, k)]
                                                    : epx_test_rand_int(rng, E);
    } else if (route != ROUTE_EMPTY) {
      const int range = route == ROUTE_ONE_RANK ? E / R : E; /* ONE_RANK: only rank 0's experts */
      e = epx_test_rand_new_expert(rng, ids, k, range);
      if (e < 0 || (route == ROUTE_HOLES && epx_test_rand_int(rng, 4) == 0)) e = -1;
      if (route == ROUTE_BAD && epx_test_rand_int(rng, 16) == 0) {
        const int64_t bad[3] = {E, -2, 1 << 20};
        e = bad[epx_test_rand_int(rng, 3)];
      }
    }
    ids[k] = e;
  }
}

void world_free(world_t *w) {
  for (int s = 0; s < w->R; s++)
    free(w->idx[s]), free(w->w[s]), free(w->x[s]), free(w->x8[s]), free(w->sc[s]);
  memset(w, 0, sizeof *w);
}

long long world_first_bad_id(const world_t *w, int s) {
  const long long n = (long long)w->ranks[s].num_tokens * w->K;
  for (long long i = 0; i < n; i++)
    if (w->idx[s][i] < -1 || w->idx[s][i] >= w->E) return i;
  return -1;
}

/* One value of x and, for WORLD_NORMAL, of x8: the draws of each payload, in their order. */
static void draw_element(world_t *w, int s, size_t i, uint64_t *rng) {
  float v = 4.f * epx_test_rand_unit(rng) - 2.f;
  if (w->payload == WORLD_NORMAL) {
    w->x[s][i] = epx_ref_bf16_from_float(v);
    uint8_t b = (uint8_t)epx_test_rand(rng);
    if ((b & 0x7f) == 0x7f) b ^= 1; /* no NaN codes */
    w->x8[s][i] = b;
  } else {
    const int kind = epx_test_rand_int(rng, 64);
    if (kind == 0) v *= 300.f;
    if (kind == 1) v *= 1e-5f;
    w->x[s][i] = epx_ref_bf16_from_float(v);
  }
}

void world_make(world_t *w, int R, const world_spec_t *spec, world_payload_t payload,
                uint64_t *rng) {
  memset(w, 0, sizeof *w);
  w->R = R;
  w->E = spec->experts ? spec->experts : R;
  w->K = spec->top_k > w->E ? w->E : spec->top_k;
  w->H = spec->hidden;
  w->M = spec->max_tokens;
  w->L = w->E / R;
  w->payload = payload;
  const int normal = payload == WORLD_NORMAL;
  for (int s = 0; s < R; s++) {
    int T = spec->tokens >= 0 ? spec->tokens : epx_test_rand_int(rng, spec->max_tokens + 1);
    if (s == spec->empty_rank) T = 0;
    const size_t TK = (size_t)T * w->K, TH = (size_t)T * w->H, TG = (size_t)T * (w->H / 128);
    w->idx[s] = malloc(sizeof(int64_t) * (TK + 1));
    w->w[s] = malloc(sizeof(float) * (TK + 1));
    w->x[s] = malloc(sizeof(uint16_t) * (TH + 1));
    if (normal) {
      w->x8[s] = malloc(TH + 1);
      w->sc[s] = malloc(sizeof(float) * (TG + 1));
    }
    for (int t = 0; t < T; t++)
      world_route_token(w->idx[s] + (size_t)t * w->K, w->K, w->E, R, spec->route, rng);
    for (size_t i = 0; i < TK; i++) {
      const float u = epx_test_rand_unit(rng);
      w->w[s][i] = normal ? u : u + 0.01f;
    }
    for (size_t i = 0; i < TH; i++) draw_element(w, s, i, rng);
    if (normal)
      for (size_t i = 0; i < TG; i++) w->sc[s][i] = 0.01f + epx_test_rand_unit(rng);
    w->ranks[s] = (epx_ref_rank_t){T, w->idx[s], w->w[s], w->x[s], w->x8[s], w->sc[s]};
  }
  w->ref = (epx_ref_world_t){R, w->E, w->K, w->H, w->ranks};
}

int world_dev_alloc(const world_t *w, size_t y_rows, world_dev_t *d) {
  const size_t M = (size_t)w->M, H = (size_t)w->H, K = (size_t)w->K;
  memset(d, 0, sizeof *d);
  EXPECT_CUDA(cudaMalloc(&d->x, M * H * 2 + 16));
  EXPECT_CUDA(cudaMalloc(&d->idx, M * K * 8 + 16));
  EXPECT_CUDA(cudaMalloc(&d->w, M * K * 4 + 16));
  EXPECT_CUDA(cudaMalloc(&d->y, y_rows * H * 2 + 16));
  EXPECT_CUDA(cudaMalloc(&d->out, M * H * 2 + 16));
  if (w->payload == WORLD_NORMAL) {
    EXPECT_CUDA(cudaMalloc(&d->x8, M * H + 16));
    EXPECT_CUDA(cudaMalloc(&d->sc, M * (H / 128) * 4 + 16));
  }
  return TEST_PASS;
}

int world_upload(const world_t *w, int me, const world_dev_t *d) {
  const size_t T = (size_t)w->ranks[me].num_tokens, H = (size_t)w->H, K = (size_t)w->K;
  EXPECT_CUDA(cudaMemcpy(d->x, w->x[me], T * H * 2, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(d->idx, w->idx[me], T * K * 8, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(d->w, w->w[me], T * K * 4, cudaMemcpyHostToDevice));
  if (w->payload == WORLD_NORMAL) {
    EXPECT_CUDA(cudaMemcpy(d->x8, w->x8[me], T * H, cudaMemcpyHostToDevice));
    EXPECT_CUDA(cudaMemcpy(d->sc, w->sc[me], T * (H / 128) * 4, cudaMemcpyHostToDevice));
  }
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

int world_dev_make(const world_t *w, int me, size_t y_rows, world_dev_t *d) {
  if (world_dev_alloc(w, y_rows, d) != TEST_PASS) return TEST_FAIL;
  return world_upload(w, me, d);
}

void world_dev_free(world_dev_t *d) {
  cudaFree(d->x), cudaFree(d->x8), cudaFree(d->idx), cudaFree(d->w), cudaFree(d->sc),
      cudaFree(d->y), cudaFree(d->out);
  memset(d, 0, sizeof *d);
}
