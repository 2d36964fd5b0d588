/*
 * config.c - group configs: defaults for auto fields, validation against the compiled limits,
 * and the workspace size (through the one layout in workspace.h).
 *
 * Invalid values (negative, inconsistent) give EPX_ERR_INVALID_ARGUMENT; valid values beyond
 * what this build supports give EPX_ERR_UNSUPPORTED. Every message names the field.
 */
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "config.h"
#include "param.h"

#define KNOWN_DTYPES ((unsigned)(EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3))
#define KNOWN_MODES ((unsigned)(EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY))
#define MAX_SMS 1024
#define MAX_TIMEOUT_MS (3600 * 1000)
/* The route of EPX_LL_ROUTE_AUTO (docs/low-latency.md says how it was chosen). */
#define EPX_LL_ROUTE_DEFAULT EPX_LL_ROUTE_DISPATCH_BY_RANK

static epx_status_t validate(const epx_group_config_t *c, int num_ranks) {
  if (num_ranks < 1)
    return epx__set_error(EPX_ERR_UNSUPPORTED, "num_ranks = %d: a group needs 1 to %d ranks",
                          num_ranks, EPX_MAX_RANKS);
  if (num_ranks > EPX_MAX_RANKS)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "num_ranks = %d: this build supports at most %d ranks (one NVLink host)",
                          num_ranks, EPX_MAX_RANKS);
  EPX_ARG_CHECK(c->max_tokens_per_rank > 0, "config.max_tokens_per_rank = %d: must be > 0",
                c->max_tokens_per_rank);
  if (c->max_tokens_per_rank > EPX_MAX_TOKENS_PER_RANK)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "config.max_tokens_per_rank = %d: at most %d supported",
                          c->max_tokens_per_rank, EPX_MAX_TOKENS_PER_RANK);
  EPX_ARG_CHECK(c->hidden > 0 && c->hidden % 8 == 0,
                "config.hidden = %d: must be a positive multiple of 8", c->hidden);
  if (c->hidden > EPX_MAX_HIDDEN)
    return epx__set_error(EPX_ERR_UNSUPPORTED, "config.hidden = %d: at most %d supported",
                          c->hidden, EPX_MAX_HIDDEN);
  EPX_ARG_CHECK(
      c->dtypes != 0 && (c->dtypes & ~KNOWN_DTYPES) == 0,
      "config.dtypes = 0x%x: must be a combination of EPX_DTYPE_BF16 and EPX_DTYPE_FP8_E4M3",
      c->dtypes);
  EPX_ARG_CHECK(!(c->dtypes & EPX_DTYPE_FP8_E4M3) || c->hidden % 128 == 0,
                "config.hidden = %d: FP8 needs a multiple of 128 (one scale per 128 channels)",
                c->hidden);
  EPX_ARG_CHECK(c->num_experts > 0, "config.num_experts = %d: must be > 0", c->num_experts);
  if (c->num_experts > EPX_MAX_EXPERTS)
    return epx__set_error(EPX_ERR_UNSUPPORTED, "config.num_experts = %d: at most %d supported",
                          c->num_experts, EPX_MAX_EXPERTS);
  EPX_ARG_CHECK(c->num_experts % num_ranks == 0,
                "config.num_experts = %d: must be a multiple of the rank count %d", c->num_experts,
                num_ranks);
  EPX_ARG_CHECK(c->top_k > 0, "config.top_k = %d: must be > 0", c->top_k);
  if (c->top_k > EPX_MAX_TOP_K)
    return epx__set_error(EPX_ERR_UNSUPPORTED, "config.top_k = %d: at most %d supported", c->top_k,
                          EPX_MAX_TOP_K);
  EPX_ARG_CHECK(c->top_k <= c->num_experts, "config.top_k = %d: more than num_experts = %d",
                c->top_k, c->num_experts);
  EPX_ARG_CHECK(
      c->modes != 0 && (c->modes & ~KNOWN_MODES) == 0,
      "config.modes = 0x%x: must be a combination of EPX_MODE_NORMAL and EPX_MODE_LOW_LATENCY",
      c->modes);
  EPX_ARG_CHECK(c->num_sms > 0 && c->num_sms <= MAX_SMS,
                "config.num_sms = %d: must be 0 (auto) or 1..%d", c->num_sms, MAX_SMS);
  EPX_ARG_CHECK(c->timeout_ms > 0 && c->timeout_ms <= MAX_TIMEOUT_MS,
                "config.timeout_ms = %d: must be 0 (auto) or 1..%d", c->timeout_ms, MAX_TIMEOUT_MS);
  /* ll_num_sms may still be 0 here: group creation resolves it to the GPU's SM count. */
  EPX_ARG_CHECK(c->ll_num_sms >= 0 && c->ll_num_sms <= EPX_LL_MAX_BLOCKS,
                "config.ll_num_sms = %d: must be 0 (auto) or 1..%d", c->ll_num_sms,
                EPX_LL_MAX_BLOCKS);
  EPX_ARG_CHECK(c->ll_route == EPX_LL_ROUTE_DIRECT || c->ll_route == EPX_LL_ROUTE_BY_RANK ||
                    c->ll_route == EPX_LL_ROUTE_DISPATCH_BY_RANK,
                "config.ll_route = %d: must be 0 (auto), EPX_LL_ROUTE_DIRECT, "
                "EPX_LL_ROUTE_BY_RANK or EPX_LL_ROUTE_DISPATCH_BY_RANK",
                c->ll_route);
  EPX_ARG_CHECK(c->ll_max_tokens_per_rank > 0,
                "config.ll_max_tokens_per_rank = %d: must be 0 (auto: max_tokens_per_rank) or > 0",
                c->ll_max_tokens_per_rank);
  if (c->ll_max_tokens_per_rank > EPX_MAX_TOKENS_PER_RANK)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "config.ll_max_tokens_per_rank = %d: at most %d supported",
                          c->ll_max_tokens_per_rank, EPX_MAX_TOKENS_PER_RANK);
  EPX_ARG_CHECK(c->expand_fan_out == EPX_EXPAND_FAN_OUT_AFTER ||
                    c->expand_fan_out == EPX_EXPAND_FAN_OUT_DURING,
                "config.expand_fan_out = %d: must be 0 (auto), EPX_EXPAND_FAN_OUT_AFTER or "
                "EPX_EXPAND_FAN_OUT_DURING",
                c->expand_fan_out);
  EPX_ARG_CHECK(c->expand_max_rows >= 0,
                "config.expand_max_rows = %d: must be 0 (no expert-major dispatch) or > 0",
                c->expand_max_rows);
  if (c->expand_max_rows > EPX_MAX_EXPAND_ROWS)
    return epx__set_error(EPX_ERR_UNSUPPORTED, "config.expand_max_rows = %d: at most %d supported",
                          c->expand_max_rows, EPX_MAX_EXPAND_ROWS);
  if (c->expand_max_rows > 0) {
    EPX_ARG_CHECK(c->modes & EPX_MODE_NORMAL,
                  "config.expand_max_rows = %d: expert-major dispatch is normal mode; config.modes "
                  "= 0x%x lacks EPX_MODE_NORMAL",
                  c->expand_max_rows, c->modes);
    EPX_ARG_CHECK(c->dtypes & EPX_DTYPE_BF16,
                  "config.expand_max_rows = %d: expert-major combine needs EPX_DTYPE_BF16 in "
                  "config.dtypes = 0x%x (its partial rows are BF16)",
                  c->expand_max_rows, c->dtypes);
  }
  if (c->modes & EPX_MODE_LOW_LATENCY) {
    EPX_ARG_CHECK(c->hidden % 128 == 0,
                  "config.hidden = %d: low-latency mode needs a multiple of 128", c->hidden);
    const size_t bitmap = epx__ll_bitmap_bytes(c->num_experts, c->ll_max_tokens_per_rank);
    if (bitmap > EPX_LL_MAX_BITMAP_BYTES)
      return epx__set_error(EPX_ERR_UNSUPPORTED,
                            "config.ll_max_tokens_per_rank = %d with config.num_experts = %d: "
                            "low-latency dispatch keeps E x ceil(T/32) words (%zu bytes) in "
                            "shared memory, at most %d",
                            c->ll_max_tokens_per_rank, c->num_experts, bitmap,
                            EPX_LL_MAX_BITMAP_BYTES);
  }
  return EPX_OK;
}

epx_status_t epx__config_resolve(const epx_group_config_t *in, int num_ranks,
                                 epx_group_config_t *out) {
  EPX_ARG_CHECK(in != NULL, "config is NULL");
  EPX_ARG_CHECK(in->size >= offsetof(epx_group_config_t, dtypes),
                "config.size = %zu: initialize the config with EPX_GROUP_CONFIG_INIT", in->size);
  if (in->size > sizeof(epx_group_config_t))
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "config.size = %zu: larger than this library's %zu; the application was "
                          "built against a newer epx.h",
                          in->size, sizeof(epx_group_config_t));
  EPX_ARG_CHECK(in->version / 10000 == EPX_VERSION_MAJOR,
                "config.version = %d: built against EPX major %d, this library is %d", in->version,
                in->version / 10000, EPX_VERSION_MAJOR);
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  memcpy(&c, in, in->size);
  c.size = sizeof c;
  if (c.dtypes == 0) c.dtypes = EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3;
  /* FP8 needs hidden % 128; an auto dtype set quietly drops FP8 where it cannot apply. */
  if (in->dtypes == 0 && c.hidden % 128 != 0) c.dtypes = EPX_DTYPE_BF16;
  if (c.modes == 0) c.modes = EPX_MODE_NORMAL;
  if (c.num_sms == EPX_AUTO) c.num_sms = (int)epx__param_NumSms();
  if (c.timeout_ms == EPX_AUTO) c.timeout_ms = (int)epx__param_TimeoutMs();
  if (c.ll_num_sms == EPX_AUTO) c.ll_num_sms = (int)epx__param_LlNumSms();
  if (c.ll_route == EPX_LL_ROUTE_AUTO) c.ll_route = (int)epx__param_LlRoute();
  if (c.ll_route == EPX_LL_ROUTE_AUTO) c.ll_route = EPX_LL_ROUTE_DEFAULT;
  /* An older caller's config ends before this field: EPX_GROUP_CONFIG_INIT left it auto. */
  if (c.ll_max_tokens_per_rank == EPX_AUTO) c.ll_max_tokens_per_rank = c.max_tokens_per_rank;
  /* Added in 0.1.1 inside what was the struct's tail padding (the size did not change): a
   * caller built against 0.1.0 left it undefined. */
  if (c.version < 101 || in->size < offsetof(epx_group_config_t, expand_fan_out) + sizeof(int))
    c.expand_fan_out = EPX_EXPAND_FAN_OUT_AUTO;
  if (c.expand_fan_out == EPX_EXPAND_FAN_OUT_AUTO)
    c.expand_fan_out = (int)epx__param_ExpandFanOut();
  if (c.expand_fan_out == EPX_EXPAND_FAN_OUT_AUTO) c.expand_fan_out = EPX_EXPAND_FAN_OUT_AFTER;
  EPX_CHECK(validate(&c, num_ranks));
  *out = c;
  return EPX_OK;
}

void epx__config_layout(const epx_group_config_t *c, int num_ranks, epx__ws_layout_t *layout) {
  epx__ws_layout_init(layout, num_ranks, c->max_tokens_per_rank, c->hidden, c->num_experts,
                      c->top_k, c->dtypes, c->modes, c->ll_max_tokens_per_rank, c->expand_max_rows);
}

EPX_EXPORT epx_status_t epx_config_validate(const epx_group_config_t *config, int num_ranks) {
  epx_group_config_t c;
  return epx__config_resolve(config, num_ranks, &c);
}

EPX_EXPORT epx_status_t epx_workspace_size(const epx_group_config_t *config, int num_ranks,
                                           size_t *bytes) {
  EPX_ARG_CHECK(bytes != NULL, "epx_workspace_size: bytes is NULL");
  epx_group_config_t c;
  EPX_CHECK(epx__config_resolve(config, num_ranks, &c));
  epx__ws_layout_t l;
  epx__config_layout(&c, num_ranks, &l);
  *bytes = l.total_bytes;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_workspace_size_by_mode(const epx_group_config_t *config, int num_ranks,
                                                   epx_workspace_sizes_t *sizes) {
  static const char fn[] = "epx_workspace_size_by_mode";
  EPX_CHECK(epx__check_not_null(fn, "sizes", sizes));
  EPX_CHECK(epx__check_struct_size(fn, "sizes", sizes->size, sizeof(epx_workspace_sizes_t),
                                   "EPX_WORKSPACE_SIZES_INIT"));
  epx_group_config_t c;
  EPX_CHECK(epx__config_resolve(config, num_ranks, &c));
  epx__ws_layout_t l;
  epx__config_layout(&c, num_ranks, &l);
  sizes->total_bytes = l.total_bytes;
  sizes->normal_bytes = l.normal_bytes;
  sizes->low_latency_bytes = l.ll_bytes;
  sizes->common_bytes = l.total_bytes - l.normal_bytes - l.ll_bytes;
  return EPX_OK;
}
