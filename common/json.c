/* json.c — the bounded JSON writer (see json.h). */
#include "common/json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/version.h"

zps_json zps_json_over(char *buf, size_t cap)
{
    zps_json j = {buf, buf ? cap : 0, 0};
    if (j.cap)
        j.buf[0] = 0;
    return j;
}

int zps_json_fits(const zps_json *j) { return j->len < j->cap; }

/* Room left at the end of what is written (0 once the text was cut). */
static char *s_end(zps_json *j, size_t *room)
{
    if (j->len >= j->cap) {
        *room = 0;
        return NULL;
    }
    *room = j->cap - j->len;
    return j->buf + j->len;
}

static void s_vraw(zps_json *j, const char *fmt, va_list ap)
{
    size_t room;
    char *at = s_end(j, &room);
    int n = vsnprintf(at, room, fmt, ap);
    if (n > 0)
        j->len += (size_t)n;
}

void zps_json_raw(zps_json *j, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    s_vraw(j, fmt, ap);
    va_end(ap);
}

static void s_char(zps_json *j, char c)
{
    size_t room;
    char *at = s_end(j, &room);
    if (room > 1) {
        at[0] = c;
        at[1] = 0;
    }
    j->len++;
}

void zps_json_str(zps_json *j, const char *s)
{
    if (!s) {
        zps_json_raw(j, "null");
        return;
    }
    s_char(j, '"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            s_char(j, '\\');
            s_char(j, (char)*p);
        } else if (*p < 0x20 || *p == 0x7f) {
            zps_json_raw(j, "\\u%04x", *p);
        } else {
            s_char(j, (char)*p);
        }
    }
    s_char(j, '"');
}

void zps_json_num(zps_json *j, double v, int prec)
{
    if (isfinite(v))
        zps_json_raw(j, "%.*g", prec, v);
    else
        zps_json_raw(j, "null");
}

void zps_json_run_info(zps_json *j)
{
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0)
        host[0] = 0; /* no name is no reason to lose the record: "" says it */
    uint64_t ms = zps_wall_ms();
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    char when[32] = "";
    if (gmtime_r(&t, &tm))
        strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    zps_json_raw(j, ",\"host\":");
    zps_json_str(j, host);
    zps_json_raw(j, ",\"pid\":%ld,\"wall_ms\":%llu,\"start_time\":\"%s\",\"version\":",
                 (long)getpid(), (unsigned long long)ms, when);
    zps_json_str(j, zps_version());
    zps_json_raw(j, ",\"git_hash\":");
    zps_json_str(j, zps_git_hash());
}
