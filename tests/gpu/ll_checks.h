/*
 * ll_checks.h - what the low-latency GPU tests (test_ll.c) check against, on top of the world of
 * world.h (drawn with WORLD_LL): the CPU reference's receive arrays in EPX's fixed-slot layout
 * (tests/ref, EPX_REF_LL_FIXED), the expert outputs, and the checks of dispatch and combine
 * results, segment by segment, first mismatch printed.
 */
#ifndef EPX_TESTS_LL_CHECKS_H_
#define EPX_TESTS_LL_CHECKS_H_

#include <stdint.h>

#include "gpu/world.h"

/* What the reference says rank d receives, in the fixed-slot layout. */
typedef struct {
  uint16_t *x;       /* [L, R*M, H] (only segment rows written) */
  uint8_t *q;        /* [L, R*M, H] FP8 */
  float *sc;         /* [L, R*M, H/128] */
  int *count;        /* [L] */
  int *begin;        /* [L, R] */
  int *num;          /* [L, R] */
  int *sr, *st, *sk; /* [L, R*M] */
} ll_ref_recv_t;

/* The reference's receive arrays of rank d (fp8: also the FP8 rows and scales, UE8M0 scales if
 * ue8m0). Only the segments' rows are written. Free with ll_ref_recv_free. */
int ll_ref_recv(const world_t *w, int d, int fp8, int ue8m0, ll_ref_recv_t *r);
void ll_ref_recv_free(ll_ref_recv_t *r);

/* 0xff (NaN in BF16 and float32) over both low-latency buffers' receive arrays and
 * returned-rows areas of g, then a device barrier and a host barrier, so that no peer writes
 * before every rank has poisoned: a row a call fails to write then reads as NaN. Collective
 * (every rank of g calls it). */
int ll_poison(epx_test_rank_t *t, epx_group_t g);

/* The world as the live ranks see it once `dead` is masked: the dead rank sends nothing, and
 * slots naming its experts are empty. Shares the payload and weights of w; free with
 * ll_world_without_free. */
void ll_world_without(const world_t *w, int dead, world_t *out);
void ll_world_without_free(world_t *w);

/* y[d] = [L, R*M, H] BF16 expert outputs of every rank d (only segment rows set): a per-rank,
 * per-expert affine map of the received rows, so rows of one token differ from expert to expert
 * and from rank to rank. The caller frees y[0, R). */
int ll_expert_outputs(const world_t *w, uint16_t **y);
/* Identity experts: y[d] = the BF16 rows d received, so combine sums w * x over valid slots. */
int ll_identity_outputs(const world_t *w, uint16_t **y);
/* Upload rank me's expert outputs y[me] (its segment rows, per the reference) to dst
 * [L, R*M, H] BF16; synchronizes the device. */
int ll_upload_outputs(const world_t *w, int me, uint16_t *const *y, void *dst);

/* The GPU's receive arrays of rank me (res) against the reference, segment by segment: counts,
 * begins, sources, BF16 or FP8 rows and scales bit-exact. */
int ll_check_dispatch(const world_t *w, int me, const epx_ll_dispatch_result_t *res, int fp8,
                      int ue8m0, const char *label);
/* out (BF16, on the GPU) within BF16 rounding of the float64 reference: |got - ref| <= A/256
 * + 1e-6, A = sum over the token's valid slots of |w| * |y| (covers the rounding of partial sums
 * to BF16 on the expert side and of the result). */
int ll_check_combine(const world_t *w, int me, const void *out_dev, uint16_t *const *y,
                     const char *label);

/* Packed layout (test_ll_packed.c). What rank d receives in EPX's packed layout: the rows of
 * local expert j are [0, count[j]), source s's from begin[j][s] (sources in rank order), one row
 * per distinct (token, expert). Built by compacting the fixed-slot reference; when no token
 * lists an expert twice it is checked equal to the reference's EPX_REF_LL_PACKED (which gives
 * one row per (token, slot), so it differs only with duplicates). */
int ll_ref_recv_packed(const world_t *w, int d, int fp8, int ue8m0, ll_ref_recv_t *r);
/* The GPU's receive arrays of rank me against the reference of its layout (res->packed):
 * counts, begins, sources, rows and scales bit-exact (pack_scales: the UE8M0 words of
 * recv_x_scales_packed, byte i of word w = the exponent of group 4w + i, unused bytes 0). Packed:
 * also that up to 32 rows past recv_count[j] still hold the 0xff poison (nothing written past
 * the count), and, if layout_range_dev is set, (begin << 32) | num per (j, s). */
int ll_check_dispatch_layout(const world_t *w, int me, const epx_ll_dispatch_result_t *res, int fp8,
                             int ue8m0, int pack_scales, const long long *layout_range_dev,
                             const char *label);
/* Upload rank me's expert outputs y[me] (fixed-slot rows, as ll_expert_outputs makes them) to
 * dst in the packed rows; synchronizes the device. */
int ll_upload_outputs_packed(const world_t *w, int me, uint16_t *const *y, void *dst);

/* Combine-time weights of rank s, [T_s, K]: in [-1, 1.5), a fifth of them 0 (drawn from rng,
 * so draw every rank's on every rank to keep a shared rng in step). */
float *ll_draw_combine_weights(const world_t *w, int s, uint64_t *rng);

#endif /* EPX_TESTS_LL_CHECKS_H_ */
