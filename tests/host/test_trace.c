/*
 * test_trace.c - host tests of in-kernel tracing's host side: the Chrome trace writer, clock
 * alignment and dropped-event accounting, on synthetic ranks (no GPU).
 *
 *   test                                  what
 *   trace_writer_output_is_valid_json     2 ranks: strict parse, structure (trace_check), every
 *                                         track named, spans nested, python3 json.tool agrees
 *   trace_clock_offset_median_and_spread  median over rounds, failed rounds skipped, spread
 *   trace_clocks_are_aligned              rank 1 runs 5 ms ahead and drifts: events that
 *                                         happened together get the same ts
 *   trace_dropped_events_are_reported     totals, per rank, a label on exactly that rank
 *   trace_empty_and_unaligned_ranks       no events, no clock: still a valid, complete file
 *   trace_api_refuses_bad_arguments       NULL group, before touching a GPU
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "common/runner.h"
#include "common/trace_check.h"
#include "trace.h"

/* The writer's output in memory, parsed; *text keeps the raw bytes (free both). */
/* Write ranks as the trace JSON into *text, parse it and run trace_check on it (facts out).
 * NULL, after saying why on stderr, when writing, parsing or checking fails. */
static json_value_t *write_and_check(int R, const epx__trace_rank_t *ranks, char **text,
                                     size_t *len, trace_facts_t *facts) {
  FILE *f = open_memstream(text, len);
  if (!f) return NULL;
  const epx_status_t st = epx__trace_write_json(f, R, ranks);
  fclose(f);
  if (st != EPX_OK) return NULL;
  char err[256];
  json_value_t *root = json_parse(*text, *len, err, sizeof err);
  if (!root) {
    fprintf(stderr, "  trace JSON does not parse: %s\n", err);
    return NULL;
  }
  if (trace_check(root, facts, err, sizeof err) != 0) {
    fprintf(stderr, "  trace check: %s\n", err);
    json_free(root);
    return NULL;
  }
  return root;
}

static epx__trace_event_t ev(unsigned long long start, unsigned dur, int tag, int block, int warp,
                             int arg) {
  epx__trace_event_t e;
  memset(&e, 0, sizeof e);
  e.start_ns = start;
  e.dur_ns = dur;
  e.tag = (unsigned short)tag;
  e.block = (unsigned short)block;
  e.warp = (unsigned short)warp;
  e.arg = arg;
  e.sm = (unsigned short)(block % 132);
  return e;
}

/* A rank whose clock reads `offset` ns ahead of rank 0's, constant. */
static epx__trace_rank_t rank_of(const epx__trace_event_t *events, int n, long long offset,
                                 unsigned long long sync0) {
  epx__trace_rank_t r;
  memset(&r, 0, sizeof r);
  r.events = events;
  r.num_events = (unsigned long long)n;
  r.capacity = 1024;
  r.clock_valid = 1;
  r.sync_local_ns[0] = sync0 + (unsigned long long)offset;
  r.offset_ns[0] = r.offset_ns[1] = offset;
  r.timer_tick_ns = 32;
  return r;
}

/* If python3 is installed, its json module must accept the text too. */
static int python_accepts(const char *text, size_t len) {
  if (system("command -v python3 >/dev/null 2>&1") != 0) return 1;
  char path[] = "/tmp/epx_trace_test_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return 0;
  const int ok = write(fd, text, len) == (ssize_t)len;
  close(fd);
  char cmd[256];
  snprintf(cmd, sizeof cmd, "python3 -m json.tool %s >/dev/null", path);
  const int rc = ok ? system(cmd) : -1;
  unlink(path);
  return rc == 0;
}

EPX_HOST_TEST(trace_writer_output_is_valid_json, 30) {
  const unsigned long long t0 = 1700000000000000000ull; /* %globaltimer counts from an epoch */
  /* Rank 0: a notify (with its wait nested), a dispatch block with two tokens and its wait. */
  const epx__trace_event_t e0[] = {
      ev(t0 + 1000, 5000, EPX_TRACE_NOTIFY, 0, 0, 300),
      ev(t0 + 2000, 3000, EPX_TRACE_NOTIFY_WAIT, 0, 0, 1),
      ev(t0 + 7000, 400, EPX_TRACE_DISPATCH_TOKEN, 0, 0, 0),
      ev(t0 + 6500, 2000, EPX_TRACE_DISPATCH_SEND, 0, 0, 2),
      ev(t0 + 7600, 300, EPX_TRACE_DISPATCH_TOKEN, 0, 0, 1),
      ev(t0 + 8500, 900, EPX_TRACE_DISPATCH_WAIT, 0, 0, 1),
      ev(t0 + 6600, 700, EPX_TRACE_DISPATCH_TOKEN, 3, 15, 17),
      ev(t0 + 100, 800, EPX_TRACE_BARRIER, 0, 0, 1),
      ev(t0 + 200, 10, 999, 1, 2, -1), /* an unknown tag is still written */
  };
  const epx__trace_event_t e1[] = {
      ev(t0 + 50, 900, EPX_TRACE_BARRIER, 0, 0, 0),
      ev(t0 + 1100, 4000, EPX_TRACE_LAYOUT, 0, 0, 4096),
  };
  epx__trace_rank_t ranks[2] = {rank_of(e0, 9, 0, t0), rank_of(e1, 2, 0, t0)};
  char *text = NULL;
  size_t len = 0;
  trace_facts_t facts;
  json_value_t *root = write_and_check(2, ranks, &text, &len, &facts);
  EXPECT(root != NULL);
  EXPECT_EQ_INT(facts.num_ranks, 2);
  EXPECT_EQ_INT(facts.events, 11);
  EXPECT_EQ_INT(facts.spans[0], 9);
  EXPECT_EQ_INT(facts.spans[1], 2);
  EXPECT_EQ_INT(facts.dropped, 0);
  EXPECT_EQ_INT(facts.clock_syncs[0], 1);
  EXPECT_EQ_INT(trace_count_spans(root, 0, "dispatch token"), 3);
  EXPECT_EQ_INT(trace_count_spans(root, -1, "barrier"), 2);
  EXPECT_EQ_INT(trace_count_spans(root, 0, "tag"), 1);
  /* Times: from the earliest point of the file, the clock sync at t0. */
  long long ts, dur, arg;
  EXPECT(trace_find_span(root, 0, "notify wait", &ts, &dur, &arg) == 0);
  EXPECT_EQ_INT(ts, 2000);
  EXPECT_EQ_INT(dur, 3000);
  EXPECT_EQ_INT(arg, 1);
  EXPECT(trace_find_span(root, 1, "layout", &ts, &dur, &arg) == 0);
  EXPECT_EQ_INT(ts, 1100);
  EXPECT_EQ_INT(arg, 4096);
  /* Track names: "block 3 warp 15" for tid 415. */
  EXPECT(strstr(text, "\"tid\":415,\"args\":{\"name\":\"block 3 warp 15\"}") != NULL);
  EXPECT(strstr(text, "\"args\":{\"token\":17,") != NULL);
  EXPECTF(python_accepts(text, len), "python3 -m json.tool rejects the trace");
  json_free(root);
  free(text);
  return TEST_PASS;
}

EPX_HOST_TEST(trace_clock_offset_median_and_spread, 10) {
  const unsigned long long ref[5] = {1000, 2000, 3000, 4000, 5000};
  const unsigned long long mine[5] = {1510, 2500, 0, 4490, 9000}; /* one failed, one outlier */
  long long off = -1, spread = -1;
  EXPECT_EQ_INT(epx__trace_clock_offset(mine, ref, 5, &off, &spread), 4);
  EXPECT_EQ_INT(off, 505); /* median of 490, 500, 510, 4000: between the middle two */
  EXPECT_EQ_INT(spread, 3510);
  const unsigned long long late[3] = {900, 1900, 2950}; /* a clock behind the reference */
  EXPECT_EQ_INT(epx__trace_clock_offset(late, ref, 3, &off, &spread), 3);
  EXPECT_EQ_INT(off, -100);
  EXPECT_EQ_INT(spread, 50);
  const unsigned long long none[3] = {0, 0, 0};
  EXPECT_EQ_INT(epx__trace_clock_offset(none, ref, 3, &off, &spread), 0);
  EXPECT_EQ_INT(off, 0);

  /* The model keeps every round's offset (for the file): round 2 of the start sync has no stamp,
   * the dump sync none at all. */
  enum { K = EPX_TRACE_SYNC_ROUNDS };
  unsigned long long r0[2 * K], r1[2 * K];
  memset(r0, 0, sizeof r0);
  memset(r1, 0, sizeof r1);
  for (int k = 0; k < K; k++) r0[k] = 1000 * (k + 1), r1[k] = 1000 * (k + 1) + 7 * k;
  r1[2] = 0;
  epx__trace_rank_t model;
  epx__trace_clock_model(r1, r0, &model);
  EXPECT_EQ_INT(model.round_used[0], ((1u << K) - 1u) & ~4u);
  EXPECT_EQ_INT(model.round_used[1], 0);
  EXPECT_EQ_INT(model.round_offset_ns[0][K - 1], 7 * (K - 1));
  EXPECT_EQ_INT(model.round_offset_ns[0][1], 7);
  return TEST_PASS;
}

EPX_HOST_TEST(trace_clocks_are_aligned, 10) {
  /* True time T (rank 0's clock). Rank 1's clock = T + 5 ms at the start sync (T = S0), and
   * T + 5 ms + 400 ns at the dump sync (T = S0 + 1 ms): it drifts 400 ns per ms. */
  const unsigned long long S0 = 1700000000000000000ull, S1 = S0 + 1000000;
  const long long o0 = 5000000, o1 = 5000400;
  epx__trace_rank_t r1;
  memset(&r1, 0, sizeof r1);
  r1.clock_valid = 1;
  r1.sync_local_ns[0] = S0 + o0;
  r1.sync_local_ns[1] = S1 + o1;
  r1.offset_ns[0] = o0;
  r1.offset_ns[1] = o1;
  r1.round_used[0] = 0x3u; /* rounds 0 and 1 of the start sync; the rest null */
  r1.round_offset_ns[0][0] = o0;
  r1.round_offset_ns[0][1] = o0 + 10;
  /* Midway, the offset is halfway; before and after the window it is held. */
  const unsigned long long mid = S0 + 500000;
  EXPECT_EQ_INT(epx__trace_align(&r1, mid + o0 + 200), (long long)mid);
  EXPECT_EQ_INT(epx__trace_align(&r1, S0 - 777 + o0), (long long)(S0 - 777));
  EXPECT_EQ_INT(epx__trace_align(&r1, S1 + 999 + o1), (long long)(S1 + 999));
  r1.clock_valid = 0; /* unaligned: taken as is */
  EXPECT_EQ_INT(epx__trace_align(&r1, 12345), 12345);
  r1.clock_valid = 1;

  /* Both ranks run the same barrier at true time [S0 + 250 us, S0 + 260 us); rank 1 stamps it
   * with its own clock (offset there: 5 ms + 100 ns). In the file the two must line up. */
  const unsigned long long start = S0 + 250000, end_true = S0 + 260000;
  const epx__trace_event_t e0[] = {ev(start, 10000, EPX_TRACE_BARRIER, 0, 0, 1)};
  const epx__trace_event_t e1[] = {ev(start + o0 + 100, 10000, EPX_TRACE_BARRIER, 0, 0, 0)};
  epx__trace_rank_t ranks[2] = {rank_of(e0, 1, 0, S0), r1};
  ranks[0].sync_local_ns[1] = S1;
  ranks[1].events = e1;
  ranks[1].num_events = 1;
  ranks[1].capacity = 16;
  char *text = NULL;
  size_t len = 0;
  trace_facts_t facts;
  json_value_t *root = write_and_check(2, ranks, &text, &len, &facts);
  EXPECT(root != NULL);
  long long ts0, dur0, ts1, dur1, arg;
  EXPECT(trace_find_span(root, 0, "barrier", &ts0, &dur0, &arg) == 0);
  EXPECT(trace_find_span(root, 1, "barrier", &ts1, &dur1, &arg) == 0);
  EXPECT_EQ_INT(ts0 + dur0, (long long)(end_true - S0)); /* origin: the start sync */
  EXPECT_EQ_INT(ts1, ts0);
  EXPECT_EQ_INT(dur1, dur0);
  /* The offsets are in the file for the reader. */
  EXPECT(strstr(text, "\"clock_offset_ns\":[5000000,5000400]") != NULL);
  EXPECT(strstr(text, "\"clock_round_offsets_ns\":[[5000000,5000010,null") != NULL);
  json_free(root);
  free(text);
  return TEST_PASS;
}

EPX_HOST_TEST(trace_dropped_events_are_reported, 10) {
  const unsigned long long t0 = 1000000;
  epx__trace_event_t e[4];
  for (int i = 0; i < 4; i++) e[i] = ev(t0 + 1000 * i, 500, EPX_TRACE_DISPATCH_TOKEN, 0, 1, i);
  epx__trace_rank_t ranks[3] = {rank_of(e, 4, 0, t0), rank_of(e, 4, 0, t0), rank_of(e, 2, 0, t0)};
  ranks[1].capacity = 4;
  ranks[1].num_dropped = 7; /* 11 claimed, 4 kept */
  char *text = NULL;
  size_t len = 0;
  trace_facts_t facts;
  json_value_t *root = write_and_check(3, ranks, &text, &len, &facts);
  EXPECT(root != NULL);
  EXPECT_EQ_INT(facts.events, 10);
  EXPECT_EQ_INT(facts.dropped, 7);
  EXPECT_EQ_INT(facts.dropped_per_rank[1], 7);
  EXPECT(!facts.labelled[0] && facts.labelled[1] && !facts.labelled[2]);
  EXPECT(strstr(text, "DROPPED 7 events: buffer of 4 full") != NULL);
  json_free(root);
  free(text);
  return TEST_PASS;
}

EPX_HOST_TEST(trace_empty_and_unaligned_ranks, 10) {
  epx__trace_rank_t ranks[3];
  memset(ranks, 0, sizeof ranks);
  for (int q = 0; q < 3; q++) ranks[q].capacity = 8; /* no events, no clock syncs */
  char *text = NULL;
  size_t len = 0;
  trace_facts_t facts;
  json_value_t *root = write_and_check(3, ranks, &text, &len, &facts);
  EXPECT(root != NULL);
  EXPECT_EQ_INT(facts.num_ranks, 3);
  EXPECT_EQ_INT(facts.events, 0);
  EXPECT(strstr(text, "\"clock_aligned\":false") != NULL);
  EXPECTF(python_accepts(text, len), "python3 -m json.tool rejects the empty trace");
  json_free(root);
  free(text);

  /* The checker itself refuses what the viewers would mangle. */
  static const char *bad[] = {
      "{\"traceEvents\":[],}",                   /* trailing comma */
      "{\"otherData\":{},\"traceEvents\":[]} x", /* trailing characters */
      "{\"a\":01}",                              /* leading zero */
      "{\"a\":\"\\q\"}",                         /* bad escape */
  };
  char why[256];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    json_value_t *v = json_parse(bad[i], strlen(bad[i]), why, sizeof why);
    EXPECTF(v == NULL, "accepted %s", bad[i]);
  }
  return TEST_PASS;
}

EPX_HOST_TEST(trace_api_refuses_bad_arguments, 10) {
  EXPECT_STATUS(epx_trace_start(NULL, 0, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "group") != NULL);
  epx_trace_summary_t s;
  EXPECT_STATUS(epx_trace_dump(NULL, "/tmp/x.json", &s, NULL), EPX_ERR_INVALID_ARGUMENT);
  /* Tag names are distinct, and unknown tags have a fallback. */
  for (int a = 0; a < EPX_TRACE_NUM_TAGS; a++)
    for (int b = 0; b < a; b++)
      EXPECTF(strcmp(epx__trace_tag_label(a), epx__trace_tag_label(b)) != 0, "tags %d, %d", a, b);
  EXPECT(strcmp(epx__trace_tag_label(EPX_TRACE_NUM_TAGS), "tag") == 0);
  EXPECT(sizeof(epx__trace_event_t) == 24);
  return TEST_PASS;
}
