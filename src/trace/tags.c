/*
 * tags.c - the names of the trace tags (label, category, argument name), as tables generated
 * from EPX_TRACE_TAG_MAP in trace_format.h, the one list of tags.
 * Invariant: a tag outside the list gets a fixed fallback name, never an out-of-bounds read.
 */
#include "trace.h"

static const char *const tag_labels[] = {
#define EPX_TRACE_TAG_LABEL_(name, cat, label, arg) label,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_LABEL_)
#undef EPX_TRACE_TAG_LABEL_
};
static const char *const tag_categories[] = {
#define EPX_TRACE_TAG_CAT_(name, cat, label, arg) cat,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_CAT_)
#undef EPX_TRACE_TAG_CAT_
};
static const char *const tag_args[] = {
#define EPX_TRACE_TAG_ARG_(name, cat, label, arg) arg,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_ARG_)
#undef EPX_TRACE_TAG_ARG_
};

const char *epx__trace_tag_label(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_labels[tag] : "tag";
}
const char *epx__trace_tag_category(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_categories[tag] : "epx";
}
const char *epx__trace_tag_arg(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_args[tag] : "arg";
}
