/* json.h — writing JSON text into a caller's buffer: the metrics files' records.
 *
 * A zps_json is a bounded writer in the manner of snprintf: every call appends as much as
 * fits, keeps the buffer NUL-terminated, and counts in len the bytes the whole text needs,
 * so a caller can measure first (buf NULL, cap 0), size its buffer once and write again.
 * Nothing here allocates, which is what lets the metrics writers promise no allocation per
 * record. Strings are escaped (quote, backslash, control characters); numbers that are not
 * finite are written as null, since JSON has no NaN.
 */
#ifndef ZPS_COMMON_JSON_H
#define ZPS_COMMON_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef struct zps_json {
    char *buf;  // output; NULL with cap 0 only measures
    size_t cap; // bytes of buf
    size_t len; // bytes the text written so far needs (without the NUL); > cap - 1: cut
} zps_json;

/* A writer over buf (cap bytes; buf may be NULL when cap is 0), empty. */
zps_json zps_json_over(char *buf, size_t cap);
/* True when everything written so far fitted. */
int zps_json_fits(const zps_json *j);
/* Appends formatted text as it is (the caller's JSON syntax). */
void zps_json_raw(zps_json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s as a JSON string, quotes included; NULL is written as null. */
void zps_json_str(zps_json *j, const char *s);
/* Appends v with %.*g, or null when it is not finite. */
void zps_json_num(zps_json *j, double v, int prec);
/* Appends what says which process and build wrote a metrics file, each field with a
 * leading comma:
 *   ,"host":"n1","pid":4242,"wall_ms":1795297821956,"start_time":"2026-11-25T00:21:15Z",
 *    "version":"0.3.0","git_hash":"0123456789ab"
 * wall_ms is the Unix time in ms when called (the start), start_time the same in UTC. */
void zps_json_run_info(zps_json *j);

#endif
