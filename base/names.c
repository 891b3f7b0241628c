/* The names of the public enums (include/lfserve.h): policy, backend, eviction scope, KV dtype,
 * finish reason. One table each, indexed by value, and one parser that names the choices in its
 * error. They live in base/ so that every layer above (attention, engine, api, launch) can name
 * an enum without reaching up into api/.
 */
#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "lfserve.h"

static const char *const POLICY_NAMES[] = {"longflow", "full", "streaming", "h2o", "rkv"};
static const char *const BACKEND_NAMES[] = {"auto", "cpu", "cuda"};
static const char *const SCOPE_NAMES[] = {"head", "layer"};
static const char *const DTYPE_NAMES[] = {"bf16", "fp8", "int8", "int4", "k8v4"};
static const char *const FINISH_NAMES[LF_FINISH_COUNT] = {
    "none", "eos", "length", "cancelled", "error", "stop_id", "stop_sequence"};
#define N_NAMES(a) ((int)(sizeof(a) / sizeof((a)[0])))

_Static_assert(N_NAMES(POLICY_NAMES) == LF_POLICY_RKV + 1, "a name per lf_policy");
_Static_assert(N_NAMES(BACKEND_NAMES) == LF_BACKEND_CUDA + 1, "a name per lf_backend_kind");
_Static_assert(N_NAMES(SCOPE_NAMES) == LF_EVICT_LAYER + 1, "a name per lf_evict_scope");
_Static_assert(N_NAMES(DTYPE_NAMES) == LF_KV_K8V4 + 1, "a name per lf_kv_dtype");

static const char *name_of(const char *const *names, int n, int v) {
  return v >= 0 && v < n ? names[v] : "unknown";
}

/* The index of s in names[0..n), or -1 with an LF_ERR_INVALID_ARG naming the choices. */
static int name_parse(const char *const *names, int n, const char *what, const char *s) {
  char choices[128] = "";
  size_t used = 0;
  for (int i = 0; i < n; i++) {
    if (s && strcmp(s, names[i]) == 0) return i;
    used += (size_t)snprintf(choices + used, sizeof choices - used, "%s%s", i ? ", " : "",
                             names[i]);
  }
  lf_error(LF_ERR_INVALID_ARG, "unknown %s '%s' (%s)", what, s ? s : "(null)", choices);
  return -1;
}

#define NAMED_ENUM(type, fn, table, what)                                                      \
  const char *fn##_str(type v) { return name_of(table, N_NAMES(table), (int)v); }               \
  lf_status fn##_parse(const char *s, type *out) {                                              \
    const int i = name_parse(table, N_NAMES(table), what, s);                                   \
    if (i < 0) return LF_ERR_INVALID_ARG;                                                       \
    *out = (type)i;                                                                             \
    return LF_OK;                                                                               \
  }

NAMED_ENUM(lf_policy, lf_policy, POLICY_NAMES, "policy")
NAMED_ENUM(lf_backend_kind, lf_backend, BACKEND_NAMES, "backend")
NAMED_ENUM(lf_evict_scope, lf_evict_scope, SCOPE_NAMES, "eviction scope")
NAMED_ENUM(lf_kv_dtype, lf_kv_dtype, DTYPE_NAMES, "KV dtype")

const char *lf_finish_reason_str(lf_finish_reason r) {
  return name_of(FINISH_NAMES, LF_FINISH_COUNT, r);
}
