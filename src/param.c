/*
 * param.c - reading environment knobs (see param.h; every knob is listed in docs/env.md).
 */
#include "param.h"

#include <errno.h>
#include <stdlib.h>

#include "debug.h"

int64_t epx__param_env_int(const char *name, int64_t def) {
  const char *s = getenv(name);
  if (!s || !*s) return def;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 0);
  if (errno || *end) {
    EPX_WARN("ignoring %s=%s: not an integer; using %lld", name, s, (long long)def);
    return def;
  }
  EPX_INFO(EPX_SUBSYS_INIT, "%s set by environment to %lld", name, v);
  return v;
}
