/* opts.c — the flag table's parser and help printer (see opts.h for the invariants).
 *
 * Integers are decimal, or an exact integer written as a number ("1e6"), as the binaries
 * accepted before they shared this parser; a fraction is refused rather than truncated. */
#include "common/opts.h"

#include <assert.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/version.h"

/* Where the help text starts: "  --flag META" is padded to this column. */
#define S_HELP_COL 29
/* A default that would take a help line past this column goes on a line of its own. */
#define S_HELP_WIDTH 100
/* getopt_long's value for table entry i. */
#define S_VAL0 256

static bool s_takes_arg(const zps_opt *e)
{
    switch (e->type) {
    case ZPS_OPT_SET:
    case ZPS_OPT_CLEAR: return false;
    case ZPS_OPT_FUNC: return e->meta != NULL;
    default: return true;
    }
}

static bool s_is_flag(const zps_opt *e) { return e->type != ZPS_OPT_TEXT; }

/* A table's own mistakes (a field size the type does not handle, a range the field cannot
 * hold, a FUNC without fn) are API misuse: asserts. */
static void s_assert_entry(const zps_opt *e)
{
    switch (e->type) {
    case ZPS_OPT_INT:
        assert(e->size == 8 || (e->size == 4 && e->lo >= INT32_MIN && e->hi <= INT32_MAX));
        break;
    case ZPS_OPT_UINT:
        assert(e->lo >= 0 && (e->size == 8 || (e->size == 4 && e->hi <= UINT32_MAX)));
        break;
    case ZPS_OPT_DOUBLE: assert(e->size == sizeof(double) || e->size == sizeof(float)); break;
    case ZPS_OPT_STRING: assert(e->size > 1); break;
    case ZPS_OPT_ARG: assert(e->size == sizeof(const char *)); break;
    case ZPS_OPT_SET:
    case ZPS_OPT_CLEAR: assert(e->size == sizeof(bool) || e->size == sizeof(int)); break;
    case ZPS_OPT_ENUM: assert(e->size == sizeof(int) && e->names); break;
    case ZPS_OPT_FUNC: assert(e->fn); break;
    default: break;
    }
    (void)e;
}

zps_status zps_opt_name_parse(const zps_opt_name *names, const char *s, int *out)
{
    for (; names->name; names++)
        if (strcmp(names->name, s) == 0) {
            *out = names->value;
            return ZPS_OK;
        }
    return ZPS_ERR_INVALID;
}

const char *zps_opt_name_of(const zps_opt_name *names, int value)
{
    for (; names->name; names++)
        if (names->value == value)
            return names->name;
    return NULL;
}

void zps_opt_names_join(const zps_opt_name *names, const char *sep, const char *last_sep,
                        char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = 0;
    for (const zps_opt_name *n = names; n->name && len < cap; n++) {
        const char *between = n == names ? "" : n[1].name ? sep : last_sep;
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", between, n->name);
    }
}

zps_status zps_opt_log_level(void *cfg, const char *arg, char *why, size_t cap)
{
    (void)cfg;
    if (zps_log_set_level_str(arg) == ZPS_OK)
        return ZPS_OK;
    snprintf(why, cap, "wants trace, debug, info, warn, error or off, got '%s'", arg);
    return ZPS_ERR_INVALID;
}

/* ---- values ---- */

/* A whole number in v: decimal, else an exactly integral number below 2^53. */
static bool s_whole(const char *v, bool is_unsigned, long long *s, unsigned long long *u)
{
    char *end;
    errno = 0;
    if (is_unsigned) {
        const char *p = v;
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p == '-')
            return false;
        *u = strtoull(v, &end, 10);
    } else {
        *s = strtoll(v, &end, 10);
    }
    if (end == v || errno)
        return false;
    if (*end == 0)
        return true;
    if (strpbrk(v, "xX")) /* strtod would read hexadecimal */
        return false;
    double d = strtod(v, &end);
    if (end == v || *end || !(fabs(d) < 9007199254740992.0) || d != floor(d))
        return false;
    *s = (long long)d;
    *u = (unsigned long long)(d < 0 ? 0 : d);
    return !(is_unsigned && d < 0);
}

static zps_status s_integer(const zps_opt *e, void *field, const char *v, char *why, size_t cap)
{
    bool is_u = e->type == ZPS_OPT_UINT;
    long long s = 0;
    unsigned long long u = 0;
    bool ok = s_whole(v, is_u, &s, &u);
    double x = is_u ? (double)u : (double)s;
    if (!ok || x < e->lo || x > e->hi) {
        snprintf(why, cap, "wants an integer in [%.0f, %.0f], got '%s'", e->lo, e->hi, v);
        return ZPS_ERR_INVALID;
    }
    if (e->size == 8) {
        if (is_u) {
            uint64_t w = u;
            memcpy(field, &w, 8);
        } else {
            int64_t w = s;
            memcpy(field, &w, 8);
        }
    } else {
        if (is_u) {
            uint32_t w = (uint32_t)u;
            memcpy(field, &w, 4);
        } else {
            int32_t w = (int32_t)s;
            memcpy(field, &w, 4);
        }
    }
    return ZPS_OK;
}

static zps_status s_number(const zps_opt *e, void *field, const char *v, char *why, size_t cap)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x) || x < e->lo || x > e->hi) {
        snprintf(why, cap, "wants a number in [%g, %g], got '%s'", e->lo, e->hi, v);
        return ZPS_ERR_INVALID;
    }
    if (e->size == sizeof(float)) {
        float f = (float)x;
        memcpy(field, &f, sizeof f);
    } else {
        memcpy(field, &x, sizeof x);
    }
    return ZPS_OK;
}

static zps_status s_choice(const zps_opt *e, const char *v, int *out, char *why, size_t cap)
{
    if (zps_opt_name_parse(e->names, v, out) == ZPS_OK)
        return ZPS_OK;
    char list[256];
    zps_opt_names_join(e->names, ", ", " or ", list, sizeof list);
    snprintf(why, cap, "wants %s, got '%s'", list, v);
    return ZPS_ERR_INVALID;
}

static void s_set_bool(const zps_opt *e, void *field, int v)
{
    if (e->size == sizeof(bool)) {
        bool b = v != 0;
        memcpy(field, &b, sizeof b);
    } else {
        memcpy(field, &v, sizeof v);
    }
}

/* Checks v and stores it in e's field of cfg. */
static zps_status s_apply(const zps_opt *e, void *cfg, const char *v, char *why, size_t cap)
{
    void *field = (char *)cfg + e->off;
    int n;
    switch (e->type) {
    case ZPS_OPT_INT:
    case ZPS_OPT_UINT: return s_integer(e, field, v, why, cap);
    case ZPS_OPT_DOUBLE: return s_number(e, field, v, why, cap);
    case ZPS_OPT_STRING:
        if (e->names && s_choice(e, v, &n, why, cap) != ZPS_OK)
            return ZPS_ERR_INVALID;
        if (strlen(v) >= e->size) {
            snprintf(why, cap, "value is longer than %zu characters", e->size - 1);
            return ZPS_ERR_INVALID;
        }
        memcpy(field, v, strlen(v) + 1);
        return ZPS_OK;
    case ZPS_OPT_ARG: memcpy(field, &v, sizeof v); return ZPS_OK;
    case ZPS_OPT_SET: s_set_bool(e, field, 1); return ZPS_OK;
    case ZPS_OPT_CLEAR: s_set_bool(e, field, 0); return ZPS_OK;
    case ZPS_OPT_ENUM:
        if (s_choice(e, v, &n, why, cap) != ZPS_OK)
            return ZPS_ERR_INVALID;
        memcpy(field, &n, sizeof n);
        return ZPS_OK;
    case ZPS_OPT_FUNC: return e->fn(cfg, v, why, cap);
    default: return ZPS_ERR_INTERNAL;
    }
}

/* ---- parse ---- */

static size_t s_count(const zps_opts *o)
{
    size_t n = 0;
    while (o->opt[n].type != ZPS_OPT_END)
        n++;
    return n;
}

zps_status zps_opts_vfail(const zps_opts *o, int *exit_code, const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    fprintf(stderr, "%s: %s (see --help)\n", o->prog, msg);
    *exit_code = 2;
    return ZPS_ERR_INVALID;
}

zps_status zps_opts_fail(const zps_opts *o, int *exit_code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    zps_status st = zps_opts_vfail(o, exit_code, fmt, ap);
    va_end(ap);
    return st;
}

/* The program's own name: prog up to the first space ("zps-bench env" -> "zps-bench"). */
static void s_binary(const zps_opts *o, char *buf, size_t cap)
{
    snprintf(buf, cap, "%.*s", (int)strcspn(o->prog, " "), o->prog);
}

/* The long options whose names start with s (up to '=' or its end): 0 unknown, 1 an
 * abbreviation getopt took, more ambiguous; names the first two into a and b. */
static int s_prefix_matches(const struct option *lo, const char *s, const char **a,
                            const char **b)
{
    size_t len = strcspn(s, "=");
    int n = 0;
    for (; lo->name; lo++) {
        if (strncmp(lo->name, s, len) != 0)
            continue;
        if (strlen(lo->name) == len) /* exact: the only match */
            return *a = lo->name, 1;
        if (n == 0)
            *a = lo->name;
        else if (n == 1)
            *b = lo->name;
        n++;
    }
    return n;
}

/* getopt_long (opterr 0) returned '?' or ':' for the option it just read: says why, in one
 * line naming the option as the user wrote it. */
static zps_status s_refuse(const zps_opts *o, const struct option *lo, int c, int argc,
                           char **argv, int *exit_code)
{
    const char *arg = optind > 0 && optind <= argc ? argv[optind - 1] : "";
    if (strncmp(arg, "--", 2) != 0) /* a short option: only -h exists */
        return zps_opts_fail(o, exit_code, c == ':' ? "option '-%c' needs a value"
                                                    : "unknown option '-%c'", optopt);
    const zps_opt *e = optopt >= S_VAL0 ? &o->opt[optopt - S_VAL0] : NULL;
    const char *name = e ? e->name : optopt == 'h' ? "help" : optopt == 'V' ? "version" : NULL;
    if (c == ':')
        return zps_opts_fail(o, exit_code, "--%s needs a value%s%s", name ? name : arg + 2,
                             e && e->meta ? ": " : "", e && e->meta ? e->meta : "");
    if (name) /* --flag=VALUE for a flag without one */
        return zps_opts_fail(o, exit_code, "--%s takes no value, got '%s'", name, arg);
    const char *a = NULL, *b = NULL;
    int len = (int)strcspn(arg, "=");
    if (s_prefix_matches(lo, arg + 2, &a, &b) > 1)
        return zps_opts_fail(o, exit_code, "option '%.*s' is ambiguous (--%s, --%s, ...)", len,
                             arg, a, b);
    return zps_opts_fail(o, exit_code, "unknown option '%.*s'", len, arg);
}

/* Leaves getopt as a fresh process finds it (permuting, nothing pending), so a sub-command's
 * own parser may start with optind = 1 after an in_order parse: glibc re-reads the ordering
 * ('+') only when optind is 0. */
static void s_getopt_reset(char *prog)
{
    static const struct option none[] = {{NULL, 0, NULL, 0}};
    char *argv[] = {prog, NULL};
    optind = 0;
    getopt_long(1, argv, "", none, NULL);
    optind = 1;
}

zps_status zps_opts_parse(const zps_opts *o, void *cfg, int argc, char **argv, int *first_arg,
                          int *exit_code)
{
    size_t n = s_count(o), k = 0;
    struct option *lo = zps_xcalloc(n + 3, sizeof *lo);
    for (size_t i = 0; i < n; i++) {
        const zps_opt *e = &o->opt[i];
        s_assert_entry(e);
        if (s_is_flag(e))
            lo[k++] = (struct option){e->name, s_takes_arg(e) ? required_argument : no_argument,
                                      NULL, S_VAL0 + (int)i};
    }
    lo[k++] = (struct option){"help", no_argument, NULL, 'h'};
    lo[k] = (struct option){"version", no_argument, NULL, 'V'};
    *exit_code = -1;
    zps_status st = ZPS_OK;
    optind = 0; /* 0, not 1: glibc then forgets the previous argv (tests parse many) */
    opterr = 0; /* s_refuse says why, naming the program rather than argv[0]'s path */
    int c;
    /* +: stop at the first argument; ':' a missing value returns ':' rather than '?' */
    const char *shorts = o->in_order ? "+:h" : ":h";
    while (st == ZPS_OK && (c = getopt_long(argc, argv, shorts, lo, NULL)) != -1) {
        if (c == 'h') {
            zps_opts_usage(o, stdout);
            *exit_code = 0;
            break;
        }
        if (c == 'V') {
            char bin[64];
            s_binary(o, bin, sizeof bin);
            printf("%s\n", zps_version_line(bin));
            *exit_code = 0;
            break;
        }
        if (c < S_VAL0) {
            st = s_refuse(o, lo, c, argc, argv, exit_code);
            break;
        }
        const zps_opt *e = &o->opt[c - S_VAL0];
        char why[512];
        if (s_apply(e, cfg, optarg, why, sizeof why) != ZPS_OK)
            st = zps_opts_fail(o, exit_code, "--%s %s", e->name, why);
    }
    free(lo);
    *first_arg = optind;
    s_getopt_reset(argv[0]);
    if (st == ZPS_OK && *exit_code < 0 && !o->in_order && argc - *first_arg > o->max_args)
        st = zps_opts_fail(o, exit_code, "unexpected argument '%s'",
                           argv[*first_arg + o->max_args]);
    return st;
}

/* ---- help ---- */

/* The default of e in the defaulted struct d, or "" for none. */
static void s_default(const zps_opt *e, const void *d, char *buf, size_t cap)
{
    const void *field = (const char *)d + e->off;
    buf[0] = 0;
    if (e->dflt) {
        snprintf(buf, cap, "%s", e->dflt);
        return;
    }
    int32_t i32;
    int64_t i64;
    double x;
    float f;
    const char *s;
    switch (e->type) {
    case ZPS_OPT_INT:
    case ZPS_OPT_UINT:
        if (e->size == 8) {
            memcpy(&i64, field, 8);
            if (e->type == ZPS_OPT_UINT)
                snprintf(buf, cap, "%llu", (unsigned long long)i64);
            else
                snprintf(buf, cap, "%lld", (long long)i64);
        } else {
            memcpy(&i32, field, 4);
            if (e->type == ZPS_OPT_UINT)
                snprintf(buf, cap, "%u", (unsigned)i32);
            else
                snprintf(buf, cap, "%d", (int)i32);
        }
        break;
    case ZPS_OPT_DOUBLE:
        if (e->size == sizeof f) {
            memcpy(&f, field, sizeof f);
            x = f;
        } else {
            memcpy(&x, field, sizeof x);
        }
        snprintf(buf, cap, "%g", x);
        break;
    case ZPS_OPT_STRING: snprintf(buf, cap, "%s", (const char *)field); break;
    case ZPS_OPT_ARG:
        memcpy(&s, field, sizeof s);
        snprintf(buf, cap, "%s", s ? s : "");
        break;
    case ZPS_OPT_ENUM:
        memcpy(&i32, field, sizeof i32);
        s = zps_opt_name_of(e->names, i32);
        snprintf(buf, cap, "%s", s ? s : "");
        break;
    default: break;
    }
}

static void s_usage_line(const zps_opt *e, const void *d, FILE *f)
{
    char meta[256], dflt[512];
    if (e->meta)
        snprintf(meta, sizeof meta, " %s", e->meta);
    else if (e->names && (e->type == ZPS_OPT_ENUM || e->type == ZPS_OPT_STRING)) {
        meta[0] = ' ';
        zps_opt_names_join(e->names, "|", "|", meta + 1, sizeof meta - 1);
    } else {
        meta[0] = 0;
    }
    int col = fprintf(f, "  --%s%s", e->name, meta);
    if (col >= S_HELP_COL - 1) { /* a long flag: its help goes on the next line */
        fputc('\n', f);
        col = 0;
    }
    fprintf(f, "%*s", S_HELP_COL - col, "");
    col = S_HELP_COL;
    for (const char *h = e->help ? e->help : ""; *h; h++) {
        fputc(*h, f);
        col++;
        if (*h == '\n')
            col = fprintf(f, "%*s", S_HELP_COL, "");
    }
    s_default(e, d, dflt, sizeof dflt);
    if (!dflt[0]) {
        fputc('\n', f);
        return;
    }
    char tail[600];
    int n = snprintf(tail, sizeof tail, "(default%s %s)", e->dflt ? ":" : "", dflt);
    if (col > S_HELP_COL && col + 1 + n > S_HELP_WIDTH)
        fprintf(f, "\n%*s", S_HELP_COL, "");
    else if (col > S_HELP_COL)
        fputc(' ', f);
    fprintf(f, "%s\n", tail);
}

void zps_opts_usage(const zps_opts *o, FILE *f)
{
    void *d = zps_xcalloc(1, o->cfg_size);
    o->defaults(d);
    fputs(o->usage, f);
    for (const zps_opt *e = o->opt; e->type != ZPS_OPT_END; e++) {
        if (e->type == ZPS_OPT_TEXT)
            fprintf(f, "%s\n", e->help);
        else
            s_usage_line(e, d, f);
    }
    fprintf(f, "  --help%*sthis help\n", S_HELP_COL - 8, "");
    fprintf(f, "  --version%*sthe version and git commit\n", S_HELP_COL - 11, "");
    if (o->more_help)
        o->more_help(f);
    free(d);
}
