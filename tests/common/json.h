/*
 * json.h - a small, strict JSON parser for the tests (RFC 8259: no trailing commas, no comments,
 * no leading zeros, escapes checked, nothing after the value but whitespace). It builds a tree
 * so tests can check what a trace file says, not only that it parses.
 */
#ifndef EPX_TESTS_JSON_H_
#define EPX_TESTS_JSON_H_

#include <stddef.h>

typedef enum {
  JSON_NULL,
  JSON_BOOL,
  JSON_NUMBER,
  JSON_STRING,
  JSON_ARRAY,
  JSON_OBJECT
} json_type_t;

typedef struct json_value {
  json_type_t type;
  int boolean;
  double number;
  long long integer; /* the number when it is an integer literal that fits, else 0 */
  int is_integer;
  char *string;              /* STRING (\u escapes outside ASCII decode to '?') */
  struct json_value **items; /* ARRAY elements, OBJECT values */
  char **keys;               /* OBJECT keys, parallel to items */
  size_t count;
} json_value_t;

/* Parse text[0, len). NULL on error, with a message naming the byte offset in err. */
json_value_t *json_parse(const char *text, size_t len, char *err, size_t err_len);
/* Read and parse a whole file. */
json_value_t *json_parse_file(const char *path, char *err, size_t err_len);
void json_free(json_value_t *v);
/* Member `key` of an object (the first if repeated), or NULL. */
const json_value_t *json_get(const json_value_t *object, const char *key);

#endif /* EPX_TESTS_JSON_H_ */
