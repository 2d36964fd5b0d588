/*
 * check.c - failure reports and flag parsing shared by every benchmark program (check.h).
 */
#include "check.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

const char *bench_program = "epx_bench";
int bench_log_rank = -1;

void bench_report_failure(const char *file, int line, const char *expr, const char *why) {
  if (bench_log_rank >= 0)
    fprintf(stderr, "%s rank %d: %s:%d: %s: %s\n", bench_program, bench_log_rank, file, line, expr,
            why);
  else
    fprintf(stderr, "%s: %s:%d: %s: %s\n", bench_program, file, line, expr, why);
}

int bench_parse_int(const char *flag, const char *s, int lo, int hi, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    fprintf(stderr, "%s: %s %s: expected an integer in [%d, %d]\n", bench_program, flag, s, lo, hi);
    return -1;
  }
  *out = (int)v;
  return 0;
}

int bench_parse_list(const char *flag, const char *s, int lo, int hi, int max, int *out,
                     int *count) {
  char buf[256];
  if (strlen(s) >= sizeof buf) {
    fprintf(stderr, "%s: %s: list too long\n", bench_program, flag);
    return -1;
  }
  strcpy(buf, s);
  *count = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (*count == max) {
      fprintf(stderr, "%s: %s: at most %d values\n", bench_program, flag, max);
      return -1;
    }
    if (bench_parse_int(flag, tok, lo, hi, &out[(*count)++])) return -1;
  }
  if (*count == 0) {
    fprintf(stderr, "%s: %s: empty list\n", bench_program, flag);
    return -1;
  }
  return 0;
}
