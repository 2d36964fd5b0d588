/*
 * test_expand_config.c - host tests of the expert-major layout's pure host parts (issue 16, item
 * 1): config.expand_max_rows is validated and named, it alone sizes the expand arrays of the
 * workspace (which never overlap the other normal-mode arrays), the layout region grows by the
 * per-expert scan columns, and the expand calls refuse bad handles before touching a GPU; and
 * config.expand_fan_out resolves (auto, named refusals, a 0.1.0 caller's padding ignored).
 */
#include <stddef.h>
#include <string.h>

#include "common/runner.h"
#include "config.h"
#include "expand.h"
#include "epx.h"
#include "workspace.h"

static epx_group_config_t expand_config(int rows) {
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  c.max_tokens_per_rank = 128;
  c.hidden = 1024;
  c.num_experts = 16;
  c.top_k = 4;
  c.expand_max_rows = rows;
  return c;
}

EPX_HOST_TEST(expand_config_is_validated_by_name, 10) {
  epx_group_config_t c = expand_config(-1);
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "config.expand_max_rows") != NULL);
  c = expand_config(EPX_MAX_EXPAND_ROWS + 1);
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_UNSUPPORTED);
  EXPECT(strstr(epx_last_error(), "config.expand_max_rows") != NULL);
  c = expand_config(1000);
  c.modes = EPX_MODE_LOW_LATENCY;
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "EPX_MODE_NORMAL") != NULL);
  c = expand_config(1000);
  c.dtypes = EPX_DTYPE_FP8_E4M3;
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "EPX_DTYPE_BF16") != NULL);
  c = expand_config(0);
  EXPECT_OK(epx_config_validate(&c, 4));
  c = expand_config(EPX_MAX_EXPAND_ROWS);
  EXPECT_OK(epx_config_validate(&c, 4));
  /* A config from before the field (a smaller size) means no expand buffer. */
  c = expand_config(77);
  c.size = offsetof(epx_group_config_t, expand_max_rows);
  size_t old_bytes = 0, none_bytes = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &old_bytes));
  c = expand_config(0);
  EXPECT_OK(epx_workspace_size(&c, 4, &none_bytes));
  EXPECT_EQ_INT(old_bytes, none_bytes);
  return TEST_PASS;
}

EPX_HOST_TEST(expand_workspace_regions, 10) {
  const int R = 4, M = 128, H = 1024, E = 16, K = 4, X = 1000;
  const unsigned dtypes = EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3;
  epx__ws_layout_t a, b;
  epx__ws_layout_init(&a, R, M, H, E, K, dtypes, EPX_MODE_NORMAL, M, 0);
  epx__ws_layout_init(&b, R, M, H, E, K, dtypes, EPX_MODE_NORMAL, M, X);
  EXPECT_EQ_INT(a.expand_rows, 0);
  EXPECT_EQ_INT(b.expand_rows, X);
  /* x 1000 x 1024 x 2 = 2048000; scales 1000 x 8 x 4 = 32000; src_info 16000 -> 16128;
   * weights 4000 -> 4096; token_rows 512 x 4 x 4 = 8192; ready words 513 x 4 = 2052 -> 2304:
   * 2110720 bytes after the combine weights, the normal region rounded up to a page. */
  const size_t expand_bytes = 2048000 + 32000 + 16128 + 4096 + 8192 + 2304;
  const size_t end_a = a.combine_weights_offset + 2 * a.combine_weights_bytes;
  EXPECT_EQ_INT(b.expand_x_offset, end_a);
  EXPECT_EQ_INT(b.expand_scales_offset, b.expand_x_offset + 2048000);
  EXPECT_EQ_INT(b.expand_src_info_offset, b.expand_scales_offset + 32000);
  EXPECT_EQ_INT(b.expand_weights_offset, b.expand_src_info_offset + 16128);
  EXPECT_EQ_INT(b.expand_token_rows_offset, b.expand_weights_offset + 4096);
  EXPECT_EQ_INT(b.expand_ready_offset, b.expand_token_rows_offset + 8192);
  EXPECT_EQ_INT(b.normal_bytes, epx__align_up(end_a + expand_bytes, EPX_WS_ALIGN));
  EXPECT_EQ_INT(b.expand_x_offset % 256, 0);
  EXPECT_EQ_INT(b.expand_src_info_offset % 16, 0);
  /* Every other region is where it was. */
  EXPECT_EQ_INT(a.recv_x_offset, b.recv_x_offset);
  EXPECT_EQ_INT(a.combine_slab_offset, b.combine_slab_offset);
  EXPECT_EQ_INT(a.combine_weights_offset, b.combine_weights_offset);
  EXPECT_EQ_INT(a.normal_offset, b.normal_offset);
  /* The layout region holds E more scan columns; at the largest shape too. */
  EXPECT(b.expand_words_offset + (size_t)E * b.layout_tiles * 8 <= b.layout_bytes);
  EXPECT_EQ_INT(b.expand_words_offset,
                b.layout_words_offset + (EPX_MAX_RANKS + 1) * b.layout_tiles * 8);
  epx__ws_layout_t big;
  epx__ws_layout_init(&big, EPX_MAX_RANKS, EPX_MAX_TOKENS_PER_RANK, 7168, EPX_MAX_EXPERTS,
                      EPX_MAX_TOP_K, EPX_DTYPE_BF16, EPX_MODE_NORMAL, 128, 1 << 20);
  EXPECT_EQ_INT(big.layout_tiles, 128);
  EXPECT(big.expand_words_offset + (size_t)EPX_MAX_EXPERTS * 128 * 8 <= big.layout_bytes);
  EXPECT_EQ_INT(big.layout_bytes % EPX_WS_ALIGN, 0);
  EXPECT_EQ_INT(big.total_bytes % EPX_WS_ALIGN, 0);
  /* No expand region without normal mode. */
  epx__ws_layout_init(&b, R, M, H, E, K, dtypes, EPX_MODE_LOW_LATENCY, M, X);
  EXPECT_EQ_INT(b.expand_rows, 0);
  EXPECT_EQ_INT(b.normal_bytes, 0);
  /* The size query agrees. */
  epx_group_config_t c = expand_config(X);
  size_t bytes = 0, none = 0;
  EXPECT_OK(epx_workspace_size(&c, R, &bytes));
  c.expand_max_rows = 0;
  EXPECT_OK(epx_workspace_size(&c, R, &none));
  /* Each total is rounded up to EPX_WS_ALIGN: the difference is expand_bytes within a page
   * either way (plus the layout region's larger scan words). */
  EXPECT(bytes + EPX_WS_ALIGN > none + expand_bytes &&
         bytes < none + expand_bytes + 2 * EPX_WS_ALIGN);
  return TEST_PASS;
}

/* The notify region already holds R x (R + E) words per rank: the expand exchange's size. */
EPX_HOST_TEST(expand_notify_words_fit, 10) {
  epx__ws_layout_t l;
  epx__ws_layout_init(&l, EPX_MAX_RANKS, 4096, 7168, EPX_MAX_EXPERTS, 8, EPX_DTYPE_BF16,
                      EPX_MODE_NORMAL, 4096, 4096);
  EXPECT(l.notify_bytes >= (size_t)EPX_MAX_RANKS * (EPX_MAX_RANKS + EPX_MAX_EXPERTS) * 8);
  return TEST_PASS;
}

EPX_HOST_TEST(expand_calls_refuse_without_gpu, 10) {
  int word = 0;
  epx_group_t bogus = (epx_group_t)(void *)&word;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  epx_dispatch_expand_result_t res;
  EXPECT_STATUS(epx_dispatch_expand(NULL, NULL, &a, &res, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_STATUS(epx_dispatch_expand(bogus, NULL, &a, &res, NULL), EPX_ERR_INVALID_USAGE);
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  EXPECT_EQ_INT(ca.size, sizeof(epx_combine_expand_args_t));
  EXPECT_EQ_INT(ca.weighted, 1);
  EXPECT_STATUS(epx_combine_expand(NULL, NULL, &ca, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_STATUS(epx_combine_expand(bogus, NULL, &ca, NULL), EPX_ERR_INVALID_USAGE);
  return TEST_PASS;
}

/* expand_fan_out: auto resolves to AFTER; a caller built against 0.1.0 (version 100) had tail
 * padding where the field now is, so whatever it holds is read as auto. */
/* DURING's fan-out blocks and publish batch from their knobs: the defaults, values in range
 * kept, the rest clamped (an H200: 132 SMs, num_sms 24 senders). */
EPX_HOST_TEST(expand_during_knobs_clamp, 10) {
  /* Defaults (top-8): the measured optima at EP2 and EP4, and the line's value elsewhere. */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 2, 8, 0), 66);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, 0), 48);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 8, 8, 0), 41);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 1, 8, 0), 107); /* d = K - 1 */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 1, 0), 36);  /* d = 0: 1.5 x num_sms */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, -5), 48); /* negative: the default */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 66, 2, 8, 0), 66);  /* the SMs left (what group
                                                                         creation allows at least) */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 1, 8, 8, 0), 2);
  /* The knob: kept in 1..the SMs left, clamped above. */
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, 72), 72);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, 1), 1);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, 108), 108);
  EXPECT_EQ_INT(epx__expand_fan_out_blocks(132, 24, 4, 8, 109), 108);
  EXPECT_EQ_INT(epx__expand_publish_batch(2), 2);
  EXPECT_EQ_INT(epx__expand_publish_batch(0), 1);
  EXPECT_EQ_INT(epx__expand_publish_batch(-7), 1);
  EXPECT_EQ_INT(epx__expand_publish_batch(32), 32);
  EXPECT_EQ_INT(epx__expand_publish_batch(1000), 32);
  return TEST_PASS;
}

EPX_HOST_TEST(expand_fan_out_resolves, 10) {
  epx_group_config_t c = expand_config(100), r;
  EXPECT_OK(epx__config_resolve(&c, 4, &r));
  EXPECT_EQ_INT(r.expand_fan_out, EPX_EXPAND_FAN_OUT_AFTER);
  c.expand_fan_out = EPX_EXPAND_FAN_OUT_DURING;
  EXPECT_OK(epx__config_resolve(&c, 4, &r));
  EXPECT_EQ_INT(r.expand_fan_out, EPX_EXPAND_FAN_OUT_DURING);
  c.version = 100;
  c.expand_fan_out = 0x5a5a5a5a;
  EXPECT_OK(epx__config_resolve(&c, 4, &r));
  EXPECT_EQ_INT(r.expand_fan_out, EPX_EXPAND_FAN_OUT_AFTER);
  c.version = EPX_VERSION_CODE;
  EXPECT_STATUS(epx__config_resolve(&c, 4, &r), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "config.expand_fan_out") != NULL);
  return TEST_PASS;
}

/* The prefill layer's fan-out for a dispatch alone (EPX_MOE_ALONE_FAN_OUT, compared at group
 * creation): the knob where it names a mode, else the group's; DURING only where 2 x num_sms
 * blocks fit the GPU. */
EPX_HOST_TEST(expand_alone_fan_out_resolves, 10) {
  const int A = EPX_EXPAND_FAN_OUT_AFTER, D = EPX_EXPAND_FAN_OUT_DURING;
  EXPECT_EQ_INT(epx__expand_alone_fan_out(2, A, 24, 132), D); /* the default knob */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(1, D, 24, 132), A); /* the knob over the config */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(0, D, 24, 132), D); /* 0: the group's */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(0, A, 24, 132), A);
  EXPECT_EQ_INT(epx__expand_alone_fan_out(7, A, 24, 132), A); /* not a mode: the group's */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(2, A, 66, 132), D); /* 2 x 66 = 132 fits */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(2, A, 67, 132), A); /* 134 blocks do not */
  EXPECT_EQ_INT(epx__expand_alone_fan_out(0, D, 67, 132), A);
  return TEST_PASS;
}
