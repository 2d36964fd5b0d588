/*
 * json.c - the tests' strict JSON parser (see json.h): recursive descent, depth-limited.
 */
#include "common/json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

typedef struct {
  const char *p, *end, *begin;
  char *err;
  size_t err_len;
  int failed;
} parser_t;

static void fail(parser_t *ps, const char *what) {
  if (ps->failed) return;
  ps->failed = 1;
  snprintf(ps->err, ps->err_len, "%s at byte %ld", what, (long)(ps->p - ps->begin));
}

static void skip_ws(parser_t *ps) {
  while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
    ps->p++;
}

static int literal(parser_t *ps, const char *word) {
  const size_t n = strlen(word);
  if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return 0;
  ps->p += n;
  return 1;
}

static json_value_t *new_value(parser_t *ps, json_type_t type) {
  json_value_t *v = (json_value_t *)calloc(1, sizeof *v);
  if (!v) fail(ps, "out of memory");
  if (v) v->type = type;
  return v;
}

static int hex4(parser_t *ps, unsigned *out) {
  if (ps->end - ps->p < 4) return 0;
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    const char c = ps->p[i];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f')
      v |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      v |= (unsigned)(c - 'A' + 10);
    else
      return 0;
  }
  ps->p += 4;
  *out = v;
  return 1;
}

/* A string starting at the opening quote; returns the decoded copy. */
static char *parse_string(parser_t *ps) {
  ps->p++; /* the opening quote */
  char *out = (char *)malloc((size_t)(ps->end - ps->p) + 1);
  size_t n = 0;
  if (!out) {
    fail(ps, "out of memory");
    return NULL;
  }
  while (ps->p < ps->end) {
    const unsigned char c = (unsigned char)*ps->p;
    if (c == '"') {
      ps->p++;
      out[n] = '\0';
      return out;
    }
    if (c < 0x20) {
      fail(ps, "control character in a string");
      break;
    }
    if (c != '\\') {
      out[n++] = (char)c;
      ps->p++;
      continue;
    }
    ps->p++;
    if (ps->p >= ps->end) break;
    const char e = *ps->p++;
    unsigned u;
    switch (e) {
      case '"':
      case '\\':
      case '/':
        out[n++] = e;
        break;
      case 'b':
        out[n++] = '\b';
        break;
      case 'f':
        out[n++] = '\f';
        break;
      case 'n':
        out[n++] = '\n';
        break;
      case 'r':
        out[n++] = '\r';
        break;
      case 't':
        out[n++] = '\t';
        break;
      case 'u':
        if (!hex4(ps, &u)) {
          fail(ps, "bad \\u escape");
          free(out);
          return NULL;
        }
        out[n++] = u < 0x80 ? (char)u : '?';
        break;
      default:
        fail(ps, "bad escape in a string");
        free(out);
        return NULL;
    }
  }
  fail(ps, "unterminated string");
  free(out);
  return NULL;
}

static int is_digit(char c) {
  return c >= '0' && c <= '9';
}

static json_value_t *parse_number(parser_t *ps) {
  const char *start = ps->p;
  int integer = 1;
  if (ps->p < ps->end && *ps->p == '-') ps->p++;
  if (ps->p < ps->end && *ps->p == '0') {
    ps->p++;
  } else if (ps->p < ps->end && is_digit(*ps->p)) {
    while (ps->p < ps->end && is_digit(*ps->p)) ps->p++;
  } else {
    fail(ps, "bad number");
    return NULL;
  }
  if (ps->p < ps->end && *ps->p == '.') {
    integer = 0;
    ps->p++;
    if (ps->p >= ps->end || !is_digit(*ps->p)) {
      fail(ps, "bad fraction");
      return NULL;
    }
    while (ps->p < ps->end && is_digit(*ps->p)) ps->p++;
  }
  if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
    integer = 0;
    ps->p++;
    if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-')) ps->p++;
    if (ps->p >= ps->end || !is_digit(*ps->p)) {
      fail(ps, "bad exponent");
      return NULL;
    }
    while (ps->p < ps->end && is_digit(*ps->p)) ps->p++;
  }
  char buf[64];
  const size_t len = (size_t)(ps->p - start);
  if (len >= sizeof buf) {
    fail(ps, "number too long");
    return NULL;
  }
  memcpy(buf, start, len);
  buf[len] = '\0';
  json_value_t *v = new_value(ps, JSON_NUMBER);
  if (!v) return NULL;
  v->number = strtod(buf, NULL);
  if (integer) {
    errno = 0;
    const long long x = strtoll(buf, NULL, 10);
    if (errno == 0) v->integer = x, v->is_integer = 1;
  }
  return v;
}

static json_value_t *parse_value(parser_t *ps, int depth);

static int push(parser_t *ps, json_value_t *parent, char *key, json_value_t *item) {
  json_value_t **items =
      (json_value_t **)realloc(parent->items, (parent->count + 1) * sizeof *parent->items);
  if (items) parent->items = items;
  char **keys = parent->type == JSON_OBJECT
                    ? (char **)realloc(parent->keys, (parent->count + 1) * sizeof *parent->keys)
                    : NULL;
  if (keys) parent->keys = keys;
  if (!items || (parent->type == JSON_OBJECT && !keys)) {
    fail(ps, "out of memory");
    free(key);
    json_free(item);
    return 0;
  }
  parent->items[parent->count] = item;
  if (parent->type == JSON_OBJECT) parent->keys[parent->count] = key;
  parent->count++;
  return 1;
}

/* Array or object: the opening bracket is at ps->p. */
static json_value_t *parse_container(parser_t *ps, int depth, int object) {
  json_value_t *v = new_value(ps, object ? JSON_OBJECT : JSON_ARRAY);
  if (!v) return NULL;
  const char close = object ? '}' : ']';
  ps->p++;
  skip_ws(ps);
  if (ps->p < ps->end && *ps->p == close) {
    ps->p++;
    return v;
  }
  for (;;) {
    char *key = NULL;
    skip_ws(ps);
    if (object) {
      if (ps->p >= ps->end || *ps->p != '"') {
        fail(ps, "expected a member name");
        break;
      }
      key = parse_string(ps);
      if (!key) break;
      skip_ws(ps);
      if (ps->p >= ps->end || *ps->p != ':') {
        fail(ps, "expected ':'");
        free(key);
        break;
      }
      ps->p++;
    }
    json_value_t *item = parse_value(ps, depth + 1);
    if (!item) {
      free(key);
      break;
    }
    if (!push(ps, v, key, item)) break;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ',') {
      ps->p++;
      continue;
    }
    if (ps->p < ps->end && *ps->p == close) {
      ps->p++;
      return v;
    }
    fail(ps, object ? "expected ',' or '}'" : "expected ',' or ']'");
    break;
  }
  json_free(v);
  return NULL;
}

static json_value_t *parse_value(parser_t *ps, int depth) {
  if (depth > MAX_DEPTH) {
    fail(ps, "nested too deeply");
    return NULL;
  }
  skip_ws(ps);
  if (ps->p >= ps->end) {
    fail(ps, "unexpected end");
    return NULL;
  }
  const char c = *ps->p;
  if (c == '{' || c == '[') return parse_container(ps, depth, c == '{');
  if (c == '"') {
    char *s = parse_string(ps);
    if (!s) return NULL;
    json_value_t *v = new_value(ps, JSON_STRING);
    if (!v) {
      free(s);
      return NULL;
    }
    v->string = s;
    return v;
  }
  if (c == '-' || is_digit(c)) return parse_number(ps);
  json_value_t *v = NULL;
  if (literal(ps, "true")) {
    if ((v = new_value(ps, JSON_BOOL))) v->boolean = 1;
  } else if (literal(ps, "false")) {
    v = new_value(ps, JSON_BOOL);
  } else if (literal(ps, "null")) {
    v = new_value(ps, JSON_NULL);
  } else {
    fail(ps, "unexpected character");
  }
  return v;
}

json_value_t *json_parse(const char *text, size_t len, char *err, size_t err_len) {
  parser_t ps = {text, text + len, text, err, err_len, 0};
  if (err_len) err[0] = '\0';
  json_value_t *v = parse_value(&ps, 0);
  if (v) {
    skip_ws(&ps);
    if (ps.p != ps.end) {
      fail(&ps, "trailing characters after the value");
      json_free(v);
      v = NULL;
    }
  }
  return v;
}

json_value_t *json_parse_file(const char *path, char *err, size_t err_len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, err_len, "cannot open %s: %s", path, strerror(errno));
    return NULL;
  }
  size_t cap = 1 << 16, n = 0;
  char *buf = (char *)malloc(cap);
  while (buf) {
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    char *bigger = (char *)realloc(buf, cap * 2);
    if (!bigger) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = bigger;
    cap *= 2;
  }
  const int read_error = ferror(f);
  fclose(f);
  if (!buf || read_error) {
    snprintf(err, err_len, "cannot read %s", path);
    free(buf);
    return NULL;
  }
  json_value_t *v = json_parse(buf, n, err, err_len);
  free(buf);
  return v;
}

void json_free(json_value_t *v) {
  if (!v) return;
  for (size_t i = 0; i < v->count; i++) {
    json_free(v->items[i]);
    if (v->keys) free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v->string);
  free(v);
}

const json_value_t *json_get(const json_value_t *object, const char *key) {
  if (!object || object->type != JSON_OBJECT) return NULL;
  for (size_t i = 0; i < object->count; i++)
    if (!strcmp(object->keys[i], key)) return object->items[i];
  return NULL;
}
