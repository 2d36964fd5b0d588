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
EPX_PARAM(TraceEvents, "TRACE_EVENTS", 1 << 16) /* = EPX_TRACE_DEFAULT_EVENTS */
EPX_PARAM(LlNumSms, "LL_NUM_SMS", 0)            /* 0: every SM of the GPU */
EPX_PARAM(LlRoute, "LL_ROUTE",
          0) /* 0: the library default; 1 DIRECT, 2 BY_RANK, 3 DISPATCH_BY_RANK */
EPX_PARAM(ExpandFanOut, "EXPAND_FAN_OUT", 0) /* 0: the library default; 1 AFTER, 2 DURING */
/* DURING: tokens a sending warp publishes per system-scope fence, 1..32 */
EPX_PARAM(ExpandPublishBatch, "EXPAND_PUBLISH_BATCH", 2)
/* DURING: the dispatch kernel's fan-out blocks (at most the SMs its sending blocks leave);
 * 0: the default, epx__expand_fan_out_blocks */
EPX_PARAM(ExpandFanOutBlocks, "EXPAND_FAN_OUT_BLOCKS", 0)
/* epx_moe_decode on a DIRECT combine: 1 the down projection sends its rows, 0 the combine does */
EPX_PARAM(MoeSendRows, "MOE_SEND_ROWS", 1)
/* 1: the experts' FFN kernels after its first, and in epx_moe_decode the FFN's first and the
 * combine, are launched early (programmatic dependent launch, kernels/launch.cuh); 0: none */
EPX_PARAM(EarlyLaunch, "EARLY_LAUNCH", 1)
/* epx_moe_prefill in phases by source: 1 each remote source's rows go back by the copy engines
 * (the GEMMs keep every SM), 0 the gated combine sends them on SMs beside the GEMMs */
EPX_PARAM(MoePhasesCopyEngine, "MOE_PHASES_COPY_ENGINE", 1)
/* epx_moe_prefill: the blocks of a combine that runs alone (the chain's, an overlapped call's
 * last, the phases'); 0: every SM of the GPU */
EPX_PARAM(MoeAloneCombineBlocks, "MOE_ALONE_COMBINE_BLOCKS", 0)
/* the prefill layer's row kernels (SwiGLU, quantize, scales): blocks of 256 threads per SM */
EPX_PARAM(MoeRowBlocksPerSm, "MOE_ROW_BLOCKS_PER_SM", 4)
/* the prefill layer's dispatch with nothing beside it: 0 the group's fan-out, 1 AFTER, 2 DURING
 * (read at group creation, which compares it across ranks: group.h alone_fan_out) */
EPX_PARAM(MoeAloneFanOut, "MOE_ALONE_FAN_OUT", 2)

#endif /* EPX_PARAM_H_ */
