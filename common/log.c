/* log.c — see log.h. Error and warning lines also carry file:line. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

volatile int zps_log_threshold = ZPS_LOG_INFO;
static char s_role[32] = "zps";
static int s_index = -1;
static _Atomic int s_errors; // error lines written (zps_log_errors)

static const char s_letters[] = "TDIWE";
static const char *const s_names[] = {"trace", "debug", "info", "warn", "error", "off"};

zps_status zps_log_level_parse(const char *s, zps_log_level *out)
{
    if (!s)
        return ZPS_ERR_INVALID;
    for (int i = 0; i <= ZPS_LOG_OFF; i++) {
        if (strcasecmp(s, s_names[i]) == 0) {
            *out = (zps_log_level)i;
            return ZPS_OK;
        }
    }
    if (strcasecmp(s, "warning") == 0) {
        *out = ZPS_LOG_WARN;
        return ZPS_OK;
    }
    return ZPS_ERR_INVALID;
}

void zps_log_set_level(zps_log_level level) { zps_log_threshold = (int)level; }

zps_status zps_log_set_level_str(const char *s)
{
    zps_log_level l;
    zps_status st = zps_log_level_parse(s, &l);
    if (st == ZPS_OK)
        zps_log_set_level(l);
    return st;
}

void zps_log_set_role(const char *role, int index)
{
    if (role)
        snprintf(s_role, sizeof s_role, "%s", role);
    s_index = index;
}

void zps_log_init(const char *role, int index)
{
    if (role)
        snprintf(s_role, sizeof s_role, "%s", role);
    s_index = index;
    const char *env = getenv("ZPS_LOG");
    if (env && *env && zps_log_set_level_str(env) != ZPS_OK)
        zps_log(ZPS_WARN, "log", "ZPS_LOG=%s is not a level (trace|debug|info|warn|error|off)",
                env);
}

int zps_log_errors(void) { return s_errors; }

void zps_log_failure(const char *prog, zps_status st, const char *fmt, ...)
{
    if (s_errors)
        return;
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s%s%s\n", prog, what, what[0] ? ": " : "", zps_strerror(st));
}

void zps_log_write(zps_log_level level, const char *module, const char *file, int line,
                   const char *fmt, ...)
{
    char buf[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    int lv = (int)level;
    if (lv < 0 || lv >= ZPS_LOG_OFF)
        lv = ZPS_LOG_ERROR;
    char who[48];
    if (s_index >= 0)
        snprintf(who, sizeof who, "%s[%d]", s_role, s_index);
    else
        snprintf(who, sizeof who, "%s", s_role);
    int n = snprintf(buf, sizeof buf, "%04d-%02d-%02d %02d:%02d:%02d.%03ld %c %s %s: ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, s_letters[lv], who,
                     module ? module : "-");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    if (lv >= ZPS_LOG_WARN && file) {
        const char *base = strrchr(file, '/');
        int k = snprintf(buf + len, sizeof buf - len, " (%s:%d)", base ? base + 1 : file, line);
        if (k > 0)
            len += (size_t)k;
        if (len > sizeof buf - 2)
            len = sizeof buf - 2;
    }
    buf[len++] = '\n';
    if (lv == ZPS_LOG_ERROR)
        s_errors++;
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}
