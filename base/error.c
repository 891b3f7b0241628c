#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char lf_errbuf[1024];

lf_status lf_error(lf_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(lf_errbuf, sizeof lf_errbuf, fmt, ap);
  va_end(ap);
  return s;
}

void lf_error_clear(void) {
  lf_errbuf[0] = '\0';
}

const char *lf_last_error(void) {
  return lf_errbuf;
}

const char *lf_status_str(lf_status s) {
  switch (s) {
  case LF_OK: return "ok";
  case LF_ERR_INVALID_ARG: return "invalid argument";
  case LF_ERR_IO: return "i/o error";
  case LF_ERR_FORMAT: return "malformed file";
  case LF_ERR_UNSUPPORTED: return "unsupported";
  case LF_ERR_SHAPE: return "wrong tensor shape or dtype";
  case LF_ERR_MISSING_TENSOR: return "missing tensor";
  case LF_ERR_OUT_OF_MEMORY: return "out of memory";
  case LF_ERR_CONTEXT_FULL: return "context full";
  case LF_ERR_QUEUE_FULL: return "queue full";
  case LF_ERR_NOT_FOUND: return "not found";
  case LF_ERR_BACKEND: return "backend error";
  case LF_ERR_UNAVAILABLE: return "unavailable";
  case LF_ERR_STATE: return "invalid state";
  case LF_ERR_INTERNAL: return "internal error";
  case LF_STATUS_COUNT: break;
  }
  return "unknown status";
}
