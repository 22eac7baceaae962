/* opts_json.c — a settings struct as JSON, made from the same flag table as the parser and
 * the help (see opts.h, zps_opts_json): a metrics file's start record then lists every
 * flag, each under the name the user types, and a new flag appears there without anyone
 * remembering to add it. */
#include "common/opts.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "common/log.h"

static const char *const s_levels[] = {"trace", "debug", "info", "warn", "error", "off"};

const char *zps_opt_log_level_show(const void *cfg)
{
    (void)cfg;
    int l = zps_log_threshold;
    return l >= 0 && l <= ZPS_LOG_OFF ? s_levels[l] : NULL;
}

/* An integer field of 4 or 8 bytes, signed or not, as JSON. */
static void s_integer(zps_json *j, const zps_opt *e, const void *field)
{
    if (e->size == 8) {
        uint64_t u;
        memcpy(&u, field, 8);
        if (e->type == ZPS_OPT_UINT)
            zps_json_raw(j, "%llu", (unsigned long long)u);
        else
            zps_json_raw(j, "%lld", (long long)(int64_t)u);
    } else {
        uint32_t u;
        memcpy(&u, field, 4);
        if (e->type == ZPS_OPT_UINT)
            zps_json_raw(j, "%u", (unsigned)u);
        else
            zps_json_raw(j, "%d", (int)(int32_t)u);
    }
}

/* A SET or CLEAR field (bool or int) as true when the flag's effect is on. */
static void s_flag(zps_json *j, const zps_opt *e, const void *field)
{
    bool on;
    if (e->size == sizeof(bool)) {
        memcpy(&on, field, sizeof on);
    } else {
        int v;
        memcpy(&v, field, sizeof v);
        on = v != 0;
    }
    if (e->type == ZPS_OPT_CLEAR)
        on = !on;
    zps_json_raw(j, "%s", on ? "true" : "false");
}

static void s_value(zps_json *j, const zps_opt *e, const void *cfg)
{
    const void *field = (const char *)cfg + e->off;
    const char *s;
    int32_t i32;
    switch (e->type) {
    case ZPS_OPT_INT:
    case ZPS_OPT_UINT: s_integer(j, e, field); break;
    case ZPS_OPT_DOUBLE:
        if (e->size == sizeof(float)) {
            float f;
            memcpy(&f, field, sizeof f);
            zps_json_num(j, f, 7); /* what a user types; 9 would show 0.100000001 */
        } else {
            double x;
            memcpy(&x, field, sizeof x);
            zps_json_num(j, x, 15); /* 0.3, not 0.29999999999999999 */
        }
        break;
    case ZPS_OPT_STRING: zps_json_str(j, field); break;
    case ZPS_OPT_ARG:
        memcpy(&s, field, sizeof s);
        zps_json_str(j, s);
        break;
    case ZPS_OPT_SET:
    case ZPS_OPT_CLEAR: s_flag(j, e, field); break;
    case ZPS_OPT_ENUM:
        memcpy(&i32, field, sizeof i32);
        zps_json_str(j, zps_opt_name_of(e->names, i32));
        break;
    case ZPS_OPT_FUNC: zps_json_str(j, e->show ? e->show(cfg) : NULL); break;
    default: zps_json_raw(j, "null"); break;
    }
}

void zps_opts_json(const zps_opts *o, const void *cfg, zps_json *j)
{
    const char *sep = "";
    zps_json_raw(j, "{");
    for (const zps_opt *e = o->opt; e->type != ZPS_OPT_END; e++) {
        if (e->type == ZPS_OPT_TEXT)
            continue;
        zps_json_raw(j, "%s\"%s\":", sep, e->name);
        s_value(j, e, cfg);
        sep = ",";
    }
    zps_json_raw(j, "}");
}
