/*
 * report.c - epx_bench's result rows: the table every rank keeps, its text form (printed by
 * rank 0 as rows are measured) and its JSON form (--json). Fields that do not apply to a row
 * are -1 (integers) or NAN (doubles) and print as "-" (text) or null (JSON); #wrong keeps -1
 * for "not checked". New columns go at the end of a line, so positions of the older ones hold.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

bench_row_t bench_row_init(const char *op) {
  bench_row_t r;
  memset(&r, 0, sizeof r);
  snprintf(r.op, sizeof r.op, "%s", op);
  r.tokens = r.hidden = r.top_k = r.experts = r.ranks = r.sms = -1;
  r.median_us = r.p99_us = r.min_us = r.max_us = r.bytes = r.gbps = NAN;
  r.push_gbps = r.ratio_ceiling = r.ratio_nccl = NAN;
  r.wrong = -1;
  r.kernel_us = r.kernel_median_us = r.copy_us = NAN;
  r.ktime = bench_ktime_none();
  return r;
}

bench_row_t bench_workload_row(const bench_rank_t *b, const char *op, int tokens) {
  bench_row_t row = bench_row_init(op);
  row.tokens = tokens;
  row.hidden = b->opt->hidden;
  row.top_k = b->opt->top_k;
  row.experts = b->opt->num_experts;
  row.ranks = b->num_ranks;
  return row;
}

int bench_table_add(bench_table_t *t, const bench_row_t *row) {
  if (t->num_rows == t->capacity) {
    int cap = t->capacity ? 2 * t->capacity : 32;
    bench_row_t *rows = (bench_row_t *)realloc(t->rows, (size_t)cap * sizeof *rows);
    if (!rows) {
      bench_report_failure(__FILE__, __LINE__, "realloc", "out of host memory");
      return -1;
    }
    t->rows = rows;
    t->capacity = cap;
  }
  t->rows[t->num_rows++] = *row;
  return 0;
}

void bench_table_free(bench_table_t *t) {
  free(t->rows);
  memset(t, 0, sizeof *t);
}

double bench_table_ceiling(const bench_table_t *t, int sms) {
  for (int i = 0; i < t->num_rows; i++)
    if (!strcmp(t->rows[i].op, BENCH_OP_CEILING) && t->rows[i].sms == sms) return t->rows[i].gbps;
  return NAN;
}

double bench_table_best_ceiling(const bench_table_t *t) {
  double best = NAN;
  for (int i = 0; i < t->num_rows; i++)
    if (!strcmp(t->rows[i].op, BENCH_OP_CEILING) && (isnan(best) || t->rows[i].gbps > best))
      best = t->rows[i].gbps;
  return best;
}

/* ---------------------------------------------------------------------------------------------
 * Text
 * ------------------------------------------------------------------------------------------- */
static const char *fmt_int(char *buf, size_t n, long long v) {
  if (v < 0) return "-";
  snprintf(buf, n, "%lld", v);
  return buf;
}

static const char *fmt_double(char *buf, size_t n, double v, int decimals) {
  if (isnan(v)) return "-";
  snprintf(buf, n, "%.*f", decimals, v);
  return buf;
}

#define ROW_FORMAT "%-28s %6s %6s %4s %7s %5s %4s %9s %9s %9s %9s %8s %9s %6s %6s %6s %9s %9s\n"

void bench_print_columns(FILE *f) {
  fprintf(f, ROW_FORMAT, "op", "tokens", "hidden", "topk", "experts", "ranks", "sms", "med_us",
          "p99_us", "min_us", "max_us", "GB/s", "push_GB/s", "x_ceil", "x_nccl", "wrong",
          "kernel_us", "kmed_us");
}

void bench_print_row(FILE *f, const bench_row_t *r) {
  char b[17][32];
  fprintf(f, ROW_FORMAT, r->op, fmt_int(b[0], 32, r->tokens), fmt_int(b[1], 32, r->hidden),
          fmt_int(b[2], 32, r->top_k), fmt_int(b[3], 32, r->experts), fmt_int(b[4], 32, r->ranks),
          fmt_int(b[5], 32, r->sms), fmt_double(b[6], 32, r->median_us, 1),
          fmt_double(b[14], 32, r->p99_us, 1), fmt_double(b[7], 32, r->min_us, 1),
          fmt_double(b[8], 32, r->max_us, 1), fmt_double(b[9], 32, r->gbps, 1),
          fmt_double(b[10], 32, r->push_gbps, 1), fmt_double(b[11], 32, r->ratio_ceiling, 2),
          fmt_double(b[12], 32, r->ratio_nccl, 2),
          r->wrong < 0 ? "-1" : fmt_int(b[13], 32, r->wrong),
          fmt_double(b[15], 32, r->kernel_us, 1), fmt_double(b[16], 32, r->kernel_median_us, 1));
  fflush(f);
}

/* ---------------------------------------------------------------------------------------------
 * JSON
 * ------------------------------------------------------------------------------------------- */
/* Each field after the first is written as `, "key": value`. */
static void json_int(FILE *f, const char *key, long long v, int null_if_negative) {
  if (v < 0 && null_if_negative)
    fprintf(f, ", \"%s\": null", key);
  else
    fprintf(f, ", \"%s\": %lld", key, v);
}

static void json_double(FILE *f, const char *key, double v) {
  if (isnan(v) || isinf(v))
    fprintf(f, ", \"%s\": null", key);
  else
    fprintf(f, ", \"%s\": %.6g", key, v);
}

/* A JSON string; kernel names come from the GPU's records, so escape what JSON needs. */
static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    const unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      fprintf(f, "\\%c", c);
    else if (c < 0x20)
      fprintf(f, "\\u%04x", c);
    else
      fputc(c, f);
  }
  fputc('"', f);
}

/* `, "kernel_calls": N, "kernels": [...]`: this rank's (rank 0's) breakdown, or
 * `, "kernels": null` without kernel time. */
static void json_kernels(FILE *f, const bench_ktime_summary_t *k) {
  if (k->num_calls <= 0) {
    fputs(", \"kernels\": null", f);
    return;
  }
  fprintf(f, ", \"kernel_calls\": %d, \"kernels\": [", k->num_calls);
  for (int i = 0; i < k->num_parts; i++) {
    const bench_ktime_part_t *p = &k->parts[i];
    fputs(i ? ", {\"name\": " : "{\"name\": ", f);
    json_string(f, p->name);
    fprintf(f, ", \"copy\": %s, \"per_call\": %.6g, \"us\": %.6g}", p->is_copy ? "true" : "false",
            p->launches_per_call, p->us_per_call);
  }
  fputs("]", f);
}

static void json_row(FILE *f, const bench_row_t *r) {
  fprintf(f, "  {\"op\": \"%s\"", r->op); /* op names are fixed ASCII without quotes */
  json_int(f, "tokens", r->tokens, 1);
  json_int(f, "hidden", r->hidden, 1);
  json_int(f, "topk", r->top_k, 1);
  json_int(f, "experts", r->experts, 1);
  json_int(f, "ranks", r->ranks, 1);
  json_int(f, "sms", r->sms, 1);
  json_double(f, "median_us", r->median_us);
  json_double(f, "p99_us", r->p99_us);
  json_double(f, "min_us", r->min_us);
  json_double(f, "max_us", r->max_us);
  json_double(f, "bytes", r->bytes);
  json_double(f, "gbps", r->gbps);
  json_double(f, "push_gbps", r->push_gbps);
  json_double(f, "ratio_ceiling", r->ratio_ceiling);
  json_double(f, "ratio_nccl", r->ratio_nccl);
  json_int(f, "wrong", r->wrong, 0);
  json_double(f, "kernel_us", r->kernel_us);
  json_double(f, "kernel_median_us", r->kernel_median_us);
  json_double(f, "copy_us", r->copy_us);
  json_kernels(f, &r->ktime);
  fputs("}", f);
}

int bench_write_json(const bench_table_t *t, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) {
    perror(path);
    return -1;
  }
  fputs("[\n", f);
  for (int i = 0; i < t->num_rows; i++) {
    json_row(f, &t->rows[i]);
    fputs(i + 1 < t->num_rows ? ",\n" : "\n", f);
  }
  fputs("]\n", f);
  if (fclose(f)) {
    perror(path);
    return -1;
  }
  return 0;
}
