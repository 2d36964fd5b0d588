/*
 * test_api.c - host tests of the public API that need no GPU: status strings, version, config
 * validation and workspace sizing, and argument checks that must refuse before touching a GPU.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/runner.h"
#include "epx.h"
#include "workspace.h"

static epx_group_config_t small_config(void) {
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  c.max_tokens_per_rank = 128;
  c.hidden = 1024;
  c.num_experts = 16;
  c.top_k = 4;
  return c;
}

EPX_HOST_TEST(status_strings_are_distinct_and_total, 10) {
  for (int s = 0; s < EPX_NUM_STATUS; s++) {
    const char *a = epx_status_string((epx_status_t)s);
    EXPECTF(a && *a, "status %d has no string", s);
    for (int u = 0; u < s; u++)
      EXPECTF(strcmp(a, epx_status_string((epx_status_t)u)) != 0, "%d and %d", s, u);
  }
  EXPECT(strcmp(epx_status_string(EPX_OK), "success") == 0);
  EXPECT(strstr(epx_status_string(EPX_ERR_TIMEOUT), "epx_group_get_async_error") != NULL);
  EXPECT(strcmp(epx_status_string((epx_status_t)-1), "unknown status code") == 0);
  EXPECT(strcmp(epx_status_string(EPX_NUM_STATUS), "unknown status code") == 0);
  return TEST_PASS;
}

EPX_HOST_TEST(version_matches_header, 10) {
  int v = -1;
  EXPECT_OK(epx_get_version(&v));
  EXPECT_EQ_INT(v, EPX_VERSION_CODE);
  EXPECT_STATUS(epx_get_version(NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "version") != NULL);
  return TEST_PASS;
}

/* Each bad field is refused with the expected status and a message naming the field. */
typedef struct {
  const char *field; /* what the message must name */
  int num_ranks;
  size_t offset; /* which int field of the config to set, or (size_t)-1 for none */
  long long value;
  size_t offset2; /* a second field, or (size_t)-1 */
  long long value2;
  epx_status_t want;
} config_case_t;

static void set_field(epx_group_config_t *c, size_t offset, long long value) {
  if (offset == (size_t)-1) return;
  if (offset == offsetof(epx_group_config_t, size))
    c->size = (size_t)value;
  else if (offset == offsetof(epx_group_config_t, dtypes) ||
           offset == offsetof(epx_group_config_t, modes))
    *(unsigned *)((char *)c + offset) = (unsigned)value;
  else
    *(int *)((char *)c + offset) = (int)value;
}

EPX_HOST_TEST(config_validation_names_the_field, 10) {
#define F(name) offsetof(epx_group_config_t, name)
#define NONE ((size_t)-1)
  const config_case_t cases[] = {
      {"max_tokens_per_rank", 4, F(max_tokens_per_rank), 0, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"max_tokens_per_rank", 4, F(max_tokens_per_rank), EPX_MAX_TOKENS_PER_RANK + 1, NONE, 0,
       EPX_ERR_UNSUPPORTED},
      {"hidden", 4, F(hidden), 1001, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"hidden", 4, F(hidden), -8, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"hidden", 4, F(hidden), EPX_MAX_HIDDEN + 8, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"hidden", 4, F(hidden), 1000, F(dtypes), EPX_DTYPE_FP8_E4M3, EPX_ERR_INVALID_ARGUMENT},
      {"num_experts", 4, F(num_experts), 18, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"num_experts", 4, F(num_experts), 0, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"num_experts", 4, F(num_experts), 2048, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"top_k", 4, F(top_k), 0, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"top_k", 4, F(top_k), 17, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"top_k", 4, F(num_experts), 8, F(top_k), 9, EPX_ERR_INVALID_ARGUMENT},
      {"dtypes", 4, F(dtypes), 1 << 7, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"modes", 4, F(modes), 1 << 5, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"num_sms", 4, F(num_sms), -1, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"timeout_ms", 4, F(timeout_ms), -5, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"ll_num_sms", 4, F(ll_num_sms), -1, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"ll_num_sms", 4, F(ll_num_sms), 1025, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"ll_route", 4, F(ll_route), 4, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"ll_route", 4, F(ll_route), -1, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"expand_fan_out", 4, F(expand_fan_out), 3, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"expand_fan_out", 4, F(expand_fan_out), -1, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"hidden", 4, F(hidden), 1000, F(modes), EPX_MODE_LOW_LATENCY, EPX_ERR_INVALID_ARGUMENT},
      {"num_ranks", 0, NONE, 0, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"num_ranks", EPX_MAX_RANKS + 1, F(num_experts), 18, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"config.size", 4, F(size), 4, NONE, 0, EPX_ERR_INVALID_ARGUMENT},
      {"config.size", 4, F(size), sizeof(epx_group_config_t) + 8, NONE, 0, EPX_ERR_UNSUPPORTED},
      {"config.version", 4, F(version), (EPX_VERSION_MAJOR + 1) * 10000, NONE, 0,
       EPX_ERR_INVALID_ARGUMENT},
  };
#undef F
#undef NONE
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    epx_group_config_t c = small_config();
    set_field(&c, cases[i].offset, cases[i].value);
    set_field(&c, cases[i].offset2, cases[i].value2);
    epx_status_t s = epx_config_validate(&c, cases[i].num_ranks);
    EXPECTF(s == cases[i].want, "case %zu (%s): got %s, want %s; message: %s", i, cases[i].field,
            epx_status_string(s), epx_status_string(cases[i].want), epx_last_error());
    EXPECTF(strstr(epx_last_error(), cases[i].field) != NULL,
            "case %zu: message '%s' does not name %s", i, epx_last_error(), cases[i].field);
    size_t bytes = 12345;
    EXPECT_STATUS(epx_workspace_size(&c, cases[i].num_ranks, &bytes), cases[i].want);
  }
  /* Low-latency token bitmaps: 1024 experts x ceil(8192 / 32) words = 1 MiB of shared memory. */
  epx_group_config_t big = small_config();
  big.modes = EPX_MODE_LOW_LATENCY;
  big.num_experts = 1024;
  big.max_tokens_per_rank = 8192;
  EXPECT_STATUS(epx_config_validate(&big, 4), EPX_ERR_UNSUPPORTED);
  EXPECT(strstr(epx_last_error(), "max_tokens_per_rank") != NULL);
  big.max_tokens_per_rank = 1024; /* 128 KiB */
  EXPECT_OK(epx_config_validate(&big, 4));
  EXPECT_STATUS(epx_config_validate(NULL, 4), EPX_ERR_INVALID_ARGUMENT);
  epx_group_config_t ok = small_config();
  EXPECT_OK(epx_config_validate(&ok, 2));
  EXPECT_OK(epx_config_validate(&ok, 1)); /* a one-rank group (one GPU) is a group too */
  EXPECT_OK(epx_config_validate(&ok, 4));
  EXPECT_OK(epx_config_validate(&ok, 8));
  return TEST_PASS;
}

/* Workspace size: hand-computed for a small config, 4 KiB multiples, growing with the maxima. */
EPX_HOST_TEST(workspace_size_matches_layout, 10) {
  epx_group_config_t c = small_config();
  c.dtypes = EPX_DTYPE_BF16;
  c.modes = EPX_MODE_NORMAL;
  size_t bytes = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &bytes));
  /* R=4, T=128, H=1024, E=16, K=4, BF16, normal mode:
   *   control 4096; notify 4*(4+16)*8 = 640 -> 4096; layout 256 + 9 x 1 tile x 8 -> 4096;
   *   normal, capacity 4*128 = 512 rows: recv_x 512*1024*2 = 1048576, topk idx 512*4*8 = 16384
   *   (room for int64 ids), weights 8192, src token 2048, combine slab 2 parities x 1048576,
   *   chunk counters 2 x 4 x 2 x 8 = 128 -> 256, combine weights 2 parities x 512*4*4 = 2 x 8192;
   *   sum 3188992 -> 779 pages (3190784).  Total 3203072. */
  EXPECT_EQ_INT(bytes, 3203072);
  EXPECT_STATUS(epx_workspace_size(&c, 4, NULL), EPX_ERR_INVALID_ARGUMENT);

  /* FP8 adds the scales array, 512 rows x 8 scales x 4 bytes = 16384: 3205376 -> 783 pages. */
  c.dtypes = EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3;
  size_t both = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &both));
  EXPECT_EQ_INT(both, 4096 + 4096 + 4096 + 783 * 4096);
  bytes = both;

  /* Low-latency adds two buffers and the epochs. L = 4 local experts, R*M = 512 rows each:
   *   x 2048 rows x 1024 x 2 = 4194304; scales 2048 x 8 x 4 = 65536; src_info 2048 x 16 = 32768;
   *   cnt, recv_count, recv_begin, recv_num 4 x 256 (each under 256 bytes);
   *   stage 512 rows x (144 + 2048 + 32) = 1138688; combine_in 4194304;
   *   combine_recv max(K x 2, R x 4) = 16 x 128 x 1024 = 2097152 (BY_RANK's float32 partials);
   *   my_ids, my_w 2 x 2048; dflag, cflag 2 x 4 x 1024 x 8 = 65536; sum 11793408 -> 2880 pages
   *   (11796480) per buffer; 2 buffers + epochs 2 x 2 x 1024 x 4 = 16384: 23609344. */
  c.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  size_t with_ll = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &with_ll));
  EXPECT_EQ_INT(with_ll, bytes + 23609344);
  /* ... and only low-latency mode: the control, notify and layout pages plus the same region. */
  c.modes = EPX_MODE_LOW_LATENCY;
  size_t ll_only = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &ll_only));
  EXPECT_EQ_INT(ll_only, 4096 + 4096 + 4096 + 23609344);

  /* Doubling the tokens grows the normal slab; the size is always a 4 KiB multiple. */
  c.modes = EPX_MODE_NORMAL;
  c.max_tokens_per_rank = 256;
  size_t bigger = 0;
  EXPECT_OK(epx_workspace_size(&c, 4, &bigger));
  EXPECT(bigger > bytes);
  EXPECT_EQ_INT(bigger % 4096, 0);

  /* The host layout agrees with the size query for a DeepEP-sized config. */
  epx_group_config_t d = EPX_GROUP_CONFIG_INIT;
  d.max_tokens_per_rank = 4096;
  d.hidden = 7168;
  d.num_experts = 256;
  d.top_k = 8;
  EXPECT_OK(epx_workspace_size(&d, 4, &bytes));
  epx__ws_layout_t l;
  epx__ws_layout_init(&l, 4, 4096, 7168, 256, 8, EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3,
                      EPX_MODE_NORMAL, 4096, 0);
  EXPECT_EQ_INT(bytes, l.total_bytes);
  EXPECT_EQ_INT(l.normal_offset % 4096, 0);
  EXPECT_EQ_INT(l.notify_offset % 4096, 0);
  EXPECT_EQ_INT(l.layout_offset % 4096, 0);
  EXPECT(l.normal_offset + l.normal_bytes <= l.total_bytes);
  /* The layout scan: 8 tiles of 512 tokens, 9 columns of words after the ticket's 256 bytes. */
  EXPECT_EQ_INT(l.layout_tiles, 8);
  EXPECT(l.layout_words_offset + (EPX_MAX_RANKS + 1) * l.layout_tiles * 8 <= l.layout_bytes);
  epx__ws_layout_init(&l, 8, EPX_MAX_TOKENS_PER_RANK, 7168, 256, 8, EPX_DTYPE_BF16, EPX_MODE_NORMAL,
                      128, 0);
  EXPECT_EQ_INT(l.layout_tiles, 128);
  EXPECT_EQ_INT(l.layout_bytes, 12288); /* 256 + 9 x 128 x 8 = 9472 */
  return TEST_PASS;
}

/* Calls that must be refused without a GPU: NULL and foreign handles, NULL arguments. */
EPX_HOST_TEST(argument_checks_without_gpu, 10) {
  EXPECT_OK(epx_group_destroy(NULL));
  int rank = -1;
  EXPECT_STATUS(epx_group_rank(NULL, &rank), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "group") != NULL);
  /* A pointer that was never a group: refused by the live-group registry, not dereferenced. */
  epx_group_t bogus = (epx_group_t)(void *)&rank;
  EXPECT_STATUS(epx_group_rank(bogus, &rank), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_group_destroy(bogus), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_group_barrier(bogus, NULL), EPX_ERR_INVALID_USAGE);
  epx_layout_args_t la = EPX_LAYOUT_ARGS_INIT;
  EXPECT_STATUS(epx_layout(bogus, &la, NULL), EPX_ERR_INVALID_USAGE);
  epx_async_error_t err;
  EXPECT_STATUS(epx_group_get_async_error(bogus, &err), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_group_clear_async_error(NULL), EPX_ERR_INVALID_ARGUMENT);
  epx_ll_dispatch_args_t lda = EPX_LL_DISPATCH_ARGS_INIT;
  epx_ll_dispatch_result_t lres;
  EXPECT_STATUS(epx_ll_dispatch(bogus, &lda, &lres, NULL), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_ll_dispatch(NULL, &lda, &lres, NULL), EPX_ERR_INVALID_ARGUMENT);
  epx_ll_combine_args_t lca = EPX_LL_COMBINE_ARGS_INIT;
  EXPECT_STATUS(epx_ll_combine(bogus, &lca, NULL), EPX_ERR_INVALID_USAGE);
  epx_ll_hook_t hook = {4};
  EXPECT_STATUS(epx_ll_recv(bogus, &hook, NULL), EPX_ERR_INVALID_USAGE);
  unsigned mask = 0;
  EXPECT_STATUS(epx_group_get_peer_mask(bogus, &mask), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_group_clear_peer_mask(NULL), EPX_ERR_INVALID_ARGUMENT);
  epx_group_config_t c = small_config();
  epx_group_t g = bogus;
  EXPECT_STATUS(epx_group_create(NULL, &c, &g), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "comm") != NULL);
  return TEST_PASS;
}

/* config.ll_max_tokens_per_rank: validated and named like max_tokens_per_rank; 0 and a config
 * from before the field (a smaller size) both mean max_tokens_per_rank; it alone sizes the
 * low-latency region and the dispatch's shared-memory bitmaps. */
EPX_HOST_TEST(ll_max_tokens_config, 10) {
  epx_group_config_t c = small_config();
  c.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  c.ll_max_tokens_per_rank = -1;
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "config.ll_max_tokens_per_rank = -1") != NULL);
  c.ll_max_tokens_per_rank = EPX_MAX_TOKENS_PER_RANK + 1;
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_UNSUPPORTED);
  EXPECT(strstr(epx_last_error(), "config.ll_max_tokens_per_rank") != NULL);
  /* The bitmap limit follows the low-latency maximum, not the normal one. */
  c.num_experts = 1024;
  c.max_tokens_per_rank = 8192;
  c.ll_max_tokens_per_rank = 128;
  EXPECT_OK(epx_config_validate(&c, 4));
  c.max_tokens_per_rank = 128;
  c.ll_max_tokens_per_rank = 8192;
  EXPECT_STATUS(epx_config_validate(&c, 4), EPX_ERR_UNSUPPORTED);
  EXPECT(strstr(epx_last_error(), "config.ll_max_tokens_per_rank = 8192") != NULL);

  /* Auto, explicit max_tokens_per_rank and an older caller's config: the same workspace. */
  epx_group_config_t a = small_config();
  a.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  epx_group_config_t e = a, old = a;
  e.ll_max_tokens_per_rank = a.max_tokens_per_rank;
  old.size = offsetof(epx_group_config_t, ll_max_tokens_per_rank);
  old.ll_max_tokens_per_rank = -7; /* past old.size: never read */
  size_t auto_bytes = 0, explicit_bytes = 1, old_bytes = 2;
  EXPECT_OK(epx_workspace_size(&a, 4, &auto_bytes));
  EXPECT_OK(epx_workspace_size(&e, 4, &explicit_bytes));
  EXPECT_OK(epx_workspace_size(&old, 4, &old_bytes));
  EXPECT_EQ_INT(auto_bytes, explicit_bytes);
  EXPECT_EQ_INT(old_bytes, explicit_bytes);
  /* A larger normal maximum leaves the low-latency region alone, and the other way round. */
  epx_workspace_sizes_t s0 = EPX_WORKSPACE_SIZES_INIT, s1 = EPX_WORKSPACE_SIZES_INIT;
  EXPECT_OK(epx_workspace_size_by_mode(&e, 4, &s0));
  e.max_tokens_per_rank *= 4;
  EXPECT_OK(epx_workspace_size_by_mode(&e, 4, &s1));
  EXPECT_EQ_INT(s1.low_latency_bytes, s0.low_latency_bytes);
  EXPECT(s1.normal_bytes > s0.normal_bytes);
  e.max_tokens_per_rank /= 4;
  e.ll_max_tokens_per_rank *= 4;
  EXPECT_OK(epx_workspace_size_by_mode(&e, 4, &s1));
  EXPECT_EQ_INT(s1.normal_bytes, s0.normal_bytes);
  EXPECT(s1.low_latency_bytes > s0.low_latency_bytes);
  return TEST_PASS;
}

/* epx_workspace_size_by_mode: the parts add up to epx_workspace_size and to the layout, a mode
 * not asked for is 0; the server (both modes, 4096 prefill / 128 decode tokens, hidden
 * 7168, 256 experts, top-8, 8 ranks) before and after separate maxima (docs/low-latency.md). */
EPX_HOST_TEST(workspace_size_by_mode, 10) {
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  c.max_tokens_per_rank = 4096;
  c.hidden = 7168;
  c.num_experts = 256;
  c.top_k = 8;
  c.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  epx_workspace_sizes_t before = EPX_WORKSPACE_SIZES_INIT, after = EPX_WORKSPACE_SIZES_INIT;
  EXPECT_OK(epx_workspace_size_by_mode(&c, 8, &before)); /* ll_max auto: 4096 */
  c.ll_max_tokens_per_rank = 128;
  EXPECT_OK(epx_workspace_size_by_mode(&c, 8, &after));
  const epx_workspace_sizes_t *both[2] = {&before, &after};
  const int ll_max[2] = {4096, 128};
  for (int i = 0; i < 2; i++) {
    const epx_workspace_sizes_t *s = both[i];
    EXPECT_EQ_INT(s->total_bytes, s->common_bytes + s->normal_bytes + s->low_latency_bytes);
    epx__ws_layout_t l;
    epx__ws_layout_init(&l, 8, 4096, 7168, 256, 8, EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3,
                        EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY, ll_max[i], 0);
    EXPECT_EQ_INT(s->total_bytes, l.total_bytes);
    EXPECT_EQ_INT(s->normal_bytes, l.normal_bytes);
    EXPECT_EQ_INT(s->low_latency_bytes, l.ll_bytes);
    EXPECT_EQ_INT(s->common_bytes, l.control_bytes + l.notify_bytes + l.layout_bytes);
    printf(
        "  both modes, 8 ranks, normal 4096 / low-latency %d tokens: total %zu bytes (%.2f GiB)"
        " = common %zu + normal %zu (%.2f GiB) + low-latency %zu (%.2f GiB)\n",
        ll_max[i], s->total_bytes, s->total_bytes / 1073741824.0, s->common_bytes, s->normal_bytes,
        s->normal_bytes / 1073741824.0, s->low_latency_bytes, s->low_latency_bytes / 1073741824.0);
  }
  size_t bytes = 0;
  EXPECT_OK(epx_workspace_size(&c, 8, &bytes));
  EXPECT_EQ_INT(bytes, after.total_bytes);
  EXPECT_EQ_INT(before.normal_bytes, after.normal_bytes);
  EXPECT(after.low_latency_bytes * 16 < before.low_latency_bytes);
  /* One mode only: the other counts 0. */
  c.modes = EPX_MODE_NORMAL;
  EXPECT_OK(epx_workspace_size_by_mode(&c, 8, &after));
  EXPECT_EQ_INT(after.low_latency_bytes, 0);
  EXPECT(after.normal_bytes > 0);
  c.modes = EPX_MODE_LOW_LATENCY;
  EXPECT_OK(epx_workspace_size_by_mode(&c, 8, &after));
  EXPECT_EQ_INT(after.normal_bytes, 0);
  EXPECT(after.low_latency_bytes > 0);
  /* Bad arguments, named. */
  EXPECT_STATUS(epx_workspace_size_by_mode(&c, 8, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "sizes") != NULL);
  epx_workspace_sizes_t raw;
  memset(&raw, 0, sizeof raw);
  EXPECT_STATUS(epx_workspace_size_by_mode(&c, 8, &raw), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "EPX_WORKSPACE_SIZES_INIT") != NULL);
  c.ll_max_tokens_per_rank = -3;
  EXPECT_STATUS(epx_workspace_size_by_mode(&c, 8, &after), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "ll_max_tokens_per_rank") != NULL);
  return TEST_PASS;
}
