/* session 27: the tile-width picker (src/include/moe_tiles.h) run on the host over
 * epx_moe_prefill_bench's own routing (route() below repeats bench/moe/moe_common.c's moe_route,
 * whose file needs CUDA: seeds 77 + rank, 4096 tokens a rank, top-8), rank 0's experts [0, E/R),
 * each chunk's segments rounded up to 4 rows.
 * Build: gcc -O2 -Isrc/include docs/results/f119165-picker-on-bench-routing.c
 * Its output with f119165's costs (1400, 1200, 1000, 1150), then (2 chunks) with c3780b7's (1220,
 * 1100, 1000, 1000), below. */
// clang-format off
//   deepseek R2 chunks 1 chunk 0: segments 228..308, pick 128
//   deepseek R2 chunks 2 chunk 0: segments 108..164, pick 160
//   deepseek R2 chunks 2 chunk 1: segments 100..152, pick 128
//   deepseek R4 chunks 1 chunk 0: segments 452..572, pick 128
//   deepseek R4 chunks 2 chunk 0: segments 220..308, pick 128
//   deepseek R4 chunks 2 chunk 1: segments 232..284, pick 128
//   qwen3 R2 chunks 1 chunk 0: segments 464..576, pick 128
//   qwen3 R2 chunks 2 chunk 0: segments 224..300, pick 128
//   qwen3 R2 chunks 2 chunk 1: segments 220..296, pick 128
//   qwen3 R4 chunks 1 chunk 0: segments 964..1108, pick 128
//   qwen3 R4 chunks 2 chunk 0: segments 472..584, pick 128
//   qwen3 R4 chunks 2 chunk 1: segments 488..552, pick 128
//   -- c3780b7's costs, 2 chunks:
//   deepseek R2 chunks 2 chunk 0: segments 108..164, pick 160
//   deepseek R2 chunks 2 chunk 1: segments 100..152, pick 160
//   deepseek R4 chunks 2 chunk 0: segments 220..308, pick 128
//   deepseek R4 chunks 2 chunk 1: segments 232..284, pick 96
//   qwen3 R2 chunks 2 chunk 0: segments 224..300, pick 128
//   qwen3 R2 chunks 2 chunk 1: segments 220..296, pick 128
//   qwen3 R4 chunks 2 chunk 0: segments 472..584, pick 128
//   qwen3 R4 chunks 2 chunk 1: segments 488..552, pick 128
// clang-format on
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include "moe_tiles.h"
#define K 8
static void route(int64_t *ids, int T, int E, uint64_t seed) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      int e, dup;
      do {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        e = (int)((s >> 33) % (uint64_t)E);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= ids[t * K + j] == e;
      } while (dup);
      ids[t * K + k] = e;
      (void)(s >> 40);
    }
}

int main(void) {
  const char *names[2] = {"deepseek", "qwen3"};
  int Es[2] = {256, 128};
  for (int si = 0; si < 2; si++)
    for (int R = 2; R <= 4; R += 2)
      for (int n = 1; n <= 2; n++) {
        int E = Es[si], L = E / R, T = 4096;
        int64_t *ids[4];
        for (int r = 0; r < R; r++) {
          ids[r] = malloc(sizeof(int64_t) * T * K);
          route(ids[r], T, E, 77u + r);
        }
        for (int c = 0; c < n; c++) {
          int t0 = c * (T / n), Tc = T / n;
          int cnt[256] = {0};
          for (int r = 0; r < R; r++)
            for (int t = t0; t < t0 + Tc; t++)
              for (int k = 0; k < K; k++) {
                int e = (int)ids[r][t * K + k];
                if (e < L) cnt[e]++;
              }
          int begin[257];
          begin[0] = 0;
          for (int j = 0; j < L; j++) begin[j + 1] = begin[j] + (cnt[j] + 3) / 4 * 4;
          int pick = epx__moe_pick_tile_x(begin, L);
          int mn = 1 << 30, mx = 0;
          for (int j = 0; j < L; j++) {
            int v = begin[j + 1] - begin[j];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
          }
          printf("%s R%d chunks %d chunk %d: segments %d..%d, pick %d\n", names[si], R, n, c, mn,
                 mx, pick);
        }
      }
  return 0;
}
