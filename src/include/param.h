/*
 * param.h - environment knobs. Each knob is declared once with EPX_PARAM and listed in
 * docs/env.md; its value is read from the environment on first use and cached.
 */
#ifndef EPX_PARAM_H_
#define EPX_PARAM_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
/* Read env var `name` as an integer; `def` if unset or not a number. Not cached. */
int64_t epx__param_env_int(const char *name, int64_t def);
#ifdef __cplusplus
}
#endif

/* EPX_PARAM(Name, "ENV", default) defines `int64_t epx__param_Name(void)`, read once. */
#define EPX_PARAM(name, env, def)                      \
  static inline int64_t epx__param_##name(void) {      \
    static int64_t cached_;                            \
    static int loaded_;                                \
    if (!loaded_) {                                    \
      cached_ = epx__param_env_int("EPX_" env, (def)); \
      loaded_ = 1;                                     \
    }                                                  \
    return cached_;                                    \
  }

/* Every knob of the library (docs/env.md). */
EPX_PARAM(TimeoutMs, "TIMEOUT_MS", 5000)
EPX_PARAM(NumSms, "NUM_SMS", 24)
/* Normal-mode combine tuning: send with bulk copies (1) or loads/stores (0); warps of each
 * 16-warp block that send, the rest reduce (0 = the default of the send kind); rows per send
 * unit (a power of two <= EPX_COMBINE_CHUNK_ROWS); tokens per reduce unit. */
EPX_PARAM(CombineSendWarps, "COMBINE_SEND_WARPS", 0)
EPX_PARAM(CombineUnitRows, "COMBINE_UNIT_ROWS", 4)
EPX_PARAM(CombineReduceTokens, "COMBINE_REDUCE_TOKENS", 1)
EPX_PARAM(CombineSendBulk, "COMBINE_SEND_BULK", 1)
EPX_PARAM(CombineSendDynamic, "COMBINE_SEND_DYNAMIC", 1)
EPX_PARAM(CombineBulkStages, "COMBINE_BULK_STAGES", 4)
EPX_PARAM(CombineBulkLag, "COMBINE_BULK_LAG", 2)
EPX_PARAM(CombineBulkStoreDepth, "COMBINE_BULK_STORE_DEPTH", 1)
EPX_PARAM(TraceEvents, "TRACE_EVENTS", 1 << 16) /* = EPX_TRACE_DEFAULT_EVENTS */
EPX_PARAM(LlNumSms, "LL_NUM_SMS", 0)            /* 0: every SM of the GPU */
EPX_PARAM(LlRoute, "LL_ROUTE",
          0) /* 0: the library default; 1 DIRECT, 2 BY_RANK, 3 DISPATCH_BY_RANK */

#endif /* EPX_PARAM_H_ */
