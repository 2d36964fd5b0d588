/*
 * debug.h - logging. EPX_DEBUG=WARN|INFO|TRACE selects the level (default: WARN);
 * EPX_DEBUG_SUBSYS=INIT,GROUP,... limits INFO/TRACE lines to some subsystems. Lines go to
 * stderr as "host:pid:rank EPX LEVEL message".
 */
#ifndef EPX_DEBUG_H_
#define EPX_DEBUG_H_

typedef enum {
  EPX_LOG_NONE = 0,
  EPX_LOG_WARN = 1,
  EPX_LOG_INFO = 2,
  EPX_LOG_TRACE = 3
} epx__log_level_t;

enum {
  EPX_SUBSYS_INIT = 1 << 0,
  EPX_SUBSYS_GROUP = 1 << 1,
  EPX_SUBSYS_TRANSPORT = 1 << 2,
  EPX_SUBSYS_KERNEL = 1 << 3,
  EPX_SUBSYS_ALL = ~0
};

#ifdef __cplusplus
extern "C" {
#endif
void epx__log(int level, unsigned subsys, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int epx__log_level(void);
/* The rank to print in log lines (set once a group knows it; -1 before). */
void epx__log_set_rank(int rank);
#ifdef __cplusplus
}
#endif

#define EPX_WARN(...) epx__log(EPX_LOG_WARN, EPX_SUBSYS_ALL, __FILE__, __LINE__, __VA_ARGS__)
#define EPX_INFO(subsys, ...)                                            \
  do {                                                                   \
    if (epx__log_level() >= EPX_LOG_INFO)                                \
      epx__log(EPX_LOG_INFO, (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define EPX_TRACE(subsys, ...)                                            \
  do {                                                                    \
    if (epx__log_level() >= EPX_LOG_TRACE)                                \
      epx__log(EPX_LOG_TRACE, (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#endif /* EPX_DEBUG_H_ */
