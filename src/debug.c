/*
 * debug.c - EPX_DEBUG / EPX_DEBUG_SUBSYS logging to stderr (see debug.h).
 */
#include "debug.h"

#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int level = EPX_LOG_WARN;
static unsigned subsys_mask = (unsigned)EPX_SUBSYS_ALL;
static int log_rank = -1;

static unsigned parse_subsys(const char *s) {
  static const struct {
    const char *name;
    unsigned bit;
  } names[] = {{"INIT", EPX_SUBSYS_INIT},
               {"GROUP", EPX_SUBSYS_GROUP},
               {"TRANSPORT", EPX_SUBSYS_TRANSPORT},
               {"KERNEL", EPX_SUBSYS_KERNEL},
               {"ALL", (unsigned)EPX_SUBSYS_ALL}};
  unsigned mask = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      if (!strcasecmp(tok, names[i].name)) mask |= names[i].bit;
  return mask ? mask : (unsigned)EPX_SUBSYS_ALL;
}

static void init_log(void) {
  const char *env = getenv("EPX_DEBUG");
  if (env) {
    if (!strcasecmp(env, "NONE"))
      level = EPX_LOG_NONE;
    else if (!strcasecmp(env, "WARN"))
      level = EPX_LOG_WARN;
    else if (!strcasecmp(env, "INFO"))
      level = EPX_LOG_INFO;
    else if (!strcasecmp(env, "TRACE"))
      level = EPX_LOG_TRACE;
  }
  const char *sub = getenv("EPX_DEBUG_SUBSYS");
  if (sub) subsys_mask = parse_subsys(sub);
}

int epx__log_level(void) {
  pthread_once(&init_once, init_log);
  return level;
}

void epx__log_set_rank(int rank) {
  log_rank = rank;
}

void epx__log(int msg_level, unsigned subsys, const char *file, int line, const char *fmt, ...) {
  if (epx__log_level() < msg_level) return;
  if (msg_level > EPX_LOG_WARN && !(subsys & subsys_mask)) return;
  static const char *const names[] = {"NONE", "WARN", "INFO", "TRACE"};
  char host[64] = "?";
  gethostname(host, sizeof host - 1);
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *base = strrchr(file, '/');
  fprintf(stderr, "%s:%d:%d EPX %s %s:%d %s\n", host, (int)getpid(), log_rank, names[msg_level],
          base ? base + 1 : file, line, msg);
}
