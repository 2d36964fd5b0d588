/*
 * registry.c - the set of live groups and handles (registry.h): a destroyed or foreign handle
 * is refused without being dereferenced.
 */
#include "registry.h"

#include <pthread.h>
#include <stdlib.h>

#include "checks.h"
#include "handle.h"

typedef struct live_node {
  const void *object; /* a live group or handle */
  unsigned long long serial;
  struct live_node *next;
} live_node_t;

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static live_node_t *live_objects;
static unsigned long long last_serial; /* under live_lock */

epx_status_t epx__registry_add(const void *object) {
  live_node_t *node = (live_node_t *)calloc(1, sizeof *node);
  if (!node) return epx__set_error(EPX_ERR_SYSTEM, "out of host memory");
  pthread_mutex_lock(&live_lock);
  node->object = object;
  node->serial = ++last_serial;
  node->next = live_objects;
  live_objects = node;
  pthread_mutex_unlock(&live_lock);
  return EPX_OK;
}

void epx__registry_remove(const void *object) {
  pthread_mutex_lock(&live_lock);
  live_node_t **pp = &live_objects, *found = NULL;
  while (*pp && (*pp)->object != object) pp = &(*pp)->next;
  if (*pp) {
    found = *pp;
    *pp = found->next;
  }
  pthread_mutex_unlock(&live_lock);
  free(found);
}

unsigned long long epx__registry_serial(const void *object) {
  pthread_mutex_lock(&live_lock);
  live_node_t *n = live_objects;
  while (n && n->object != object) n = n->next;
  const unsigned long long serial = n ? n->serial : 0;
  pthread_mutex_unlock(&live_lock);
  return serial;
}

int epx__registry_contains(const void *object) {
  return epx__registry_serial(object) != 0;
}

epx_status_t epx__group_check(epx_group_t g) {
  if (!g) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "group is NULL");
  if (!epx__registry_contains(g))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "group %p is not a live EPX group (destroyed, or never created)",
                          (void *)g);
  return EPX_OK;
}

epx_status_t epx__handle_check(epx_group_t g, epx_handle_t h) {
  EPX_CHECK(epx__group_check(g));
  if (!h) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "handle is NULL");
  if (!epx__registry_contains(h))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "handle %p is not a live EPX handle (destroyed, or never created)",
                          (void *)h);
  if (h->group != g)
    return epx__set_error(EPX_ERR_INVALID_USAGE, "handle %p belongs to another group (%p, not %p)",
                          (void *)h, (void *)h->group, (void *)g);
  if (h->group_serial != epx__registry_serial(g))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "handle %p belongs to a destroyed group that lived at this group's "
                          "address %p; create handles from the live group",
                          (void *)h, (void *)g);
  return EPX_OK;
}
