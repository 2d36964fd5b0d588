/*
 * moe_test_hooks.h - failures the MoE layers can be told to fake, for the fault tests
 * (tests/gpu/test_moe_prefill.c, test_moe.c). Process-wide: each rank of epx_test is a process,
 * so one rank sets them and its peers run as usual. Nothing else sets them.
 */
#ifndef EPX_SRC_MOE_TEST_HOOKS_H_
#define EPX_SRC_MOE_TEST_HOOKS_H_

#ifdef __cplusplus
extern "C" {
#endif

/* epx_moe_prefill: the chunk whose FFN is treated as failed (not run, an error returned); -1:
 * none. */
extern int epx__moe_test_fail_chunk;
/* epx_moe_prefill in phases: the room for the phase rows (>= 0; -1: the plan's), so that a test
 * reaches the path where they do not fit (the FFN whole, then the reduces and gates). */
extern int epx__moe_test_phase_rows;
/* epx_moe_decode: 1 = its FFN is treated as failed (not run, an error returned); 0: off. */
extern int epx__moe_test_fail_decode_ffn;

#ifdef __cplusplus
}
#endif

#endif /* EPX_SRC_MOE_TEST_HOOKS_H_ */
