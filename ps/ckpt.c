/* ckpt.c — see ckpt.h. Writes with a small buffered writer over write(2) so a failure at
 * any point is reported with the file name; reads the whole file, then parses. */
#include "ps/ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "common/check.h"
#include "common/fileio.h"
#include "common/mem.h"

#define S_MAGIC "ZPSCKPT1"
#define S_FORMAT 1u

void ps_ckpt_path(const char *dir, int index, char *buf, size_t len)
{
    snprintf(buf, len, "%s/server-%d.ckpt", dir, index);
}

/* A rename or link in dir is durable once the directory is fsync'ed. */
static zps_status s_fsync_dir(const char *dir)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ZPS_CHECK_FILE(dfd, dir);
    if (fsync(dfd) == -1)
        zps_log(ZPS_WARN, "ckpt", "%s: fsync of the directory: %s", dir, strerror(errno));
    close(dfd);
    return ZPS_OK;
}

void ps_ckpt_version_path(const char *dir, int index, uint64_t version, char *buf, size_t len)
{
    snprintf(buf, len, "%s/server-%d.v%" PRIu64 ".ckpt", dir, index, version);
}

/* The version a directory entry names when it is a versioned checkpoint of server index. */
static int s_versioned(const char *name, int index, uint64_t *v)
{
    char pre[32];
    int pl = snprintf(pre, sizeof pre, "server-%d.v", index);
    if (strncmp(name, pre, (size_t)pl))
        return 0;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(name + pl, &end, 10);
    if (end == name + pl || errno || strcmp(end, ".ckpt"))
        return 0;
    *v = x;
    return 1;
}

static int s_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The versions of server index's versioned files in dir, newest first, in *out (the
 * caller's, free); their count, or -1 when dir cannot be read. */
static int s_list_versions(const char *dir, int index, uint64_t **out)
{
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    size_t n = 0, cap = 0;
    uint64_t *vs = NULL;
    for (struct dirent *e; (e = readdir(d));) {
        uint64_t v;
        if (!s_versioned(e->d_name, index, &v))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            vs = zps_xrealloc(vs, cap * sizeof *vs);
        }
        vs[n++] = v;
    }
    closedir(d);
    if (n)
        qsort(vs, n, sizeof *vs, s_desc);
    *out = vs;
    return (int)n;
}

zps_status ps_ckpt_newest_version(const char *dir, int index, uint64_t *version)
{
    uint64_t *vs;
    int n = s_list_versions(dir, index, &vs);
    if (n > 0)
        *version = vs[0];
    free(vs);
    return n > 0 ? ZPS_OK : ZPS_ERR_NOT_FOUND;
}

/* Removes the versioned files of vs[from..n). */
static void s_unlink_versions(const char *dir, int index, const uint64_t *vs, int n, int from)
{
    char vpath[1100];
    for (int i = from; i < n; i++) {
        ps_ckpt_version_path(dir, index, vs[i], vpath, sizeof vpath);
        if (unlink(vpath) == -1)
            zps_log(ZPS_WARN, "ckpt", "cannot remove %s: %s", vpath, strerror(errno));
    }
}

void ps_ckpt_drop_after(const char *dir, int index, uint64_t version)
{
    uint64_t *vs;
    int n = s_list_versions(dir, index, &vs), k = 0;
    while (k < n && vs[k] > version)
        k++;
    s_unlink_versions(dir, index, vs, k, 0);
    free(vs);
}

zps_status ps_ckpt_keep_version(const char *dir, int index, uint64_t version, int keep)
{
    char path[1100], vpath[1100];
    ps_ckpt_path(dir, index, path, sizeof path);
    ps_ckpt_version_path(dir, index, version, vpath, sizeof vpath);
    if (unlink(vpath) == -1 && errno != ENOENT)
        ZPS_CHECK_FILE(-1, vpath);
    ZPS_CHECK_FILE(link(path, vpath), vpath);
    /* everything older than the keep newest goes; the listing is sorted newest first */
    uint64_t *vs;
    int n = s_list_versions(dir, index, &vs);
    s_unlink_versions(dir, index, vs, n, keep);
    free(vs);
    return s_fsync_dir(dir);
}

/* crc32 over n bytes; its length argument is uInt, so it is fed in pieces. */
static uLong s_crc(uLong crc, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t off = 0; off < n;) {
        size_t part = n - off > (1u << 30) ? (1u << 30) : n - off;
        crc = crc32(crc, b + off, (uInt)part);
        off += part;
    }
    return crc;
}

typedef struct s_writer {
    int fd;
    const char *path;
    uLong crc;
    uint64_t len;
} s_writer;

static zps_status s_put(s_writer *w, const void *p, size_t n)
{
    ZPS_CHECK_FILE(zps_write_full(w->fd, p, n), w->path);
    w->crc = s_crc(w->crc, p, n);
    w->len += n;
    return ZPS_OK;
}

#define S_PUT(w, v) ZPS_TRY(s_put((w), &(v), sizeof(v)))

static zps_status s_write_body(s_writer *w, const ps_ckpt *c)
{
    ZPS_TRY(s_put(w, S_MAGIC, 8));
    uint32_t fmt = S_FORMAT, pad = 0;
    S_PUT(w, fmt);
    S_PUT(w, c->server_index);
    S_PUT(w, c->plan_hash);
    S_PUT(w, c->n_vars);
    S_PUT(w, c->total);
    S_PUT(w, c->n_servers);
    S_PUT(w, c->chunk_bytes);
    S_PUT(w, c->num_chunks);
    S_PUT(w, c->mode);
    S_PUT(w, c->n_local);
    S_PUT(w, c->n_slots);
    S_PUT(w, c->opt_len);
    if (c->opt_len)
        ZPS_TRY(s_put(w, c->opt, c->opt_len));
    for (uint32_t i = 0; i < c->n_local; i++) {
        S_PUT(w, c->chunks[i].key);
        S_PUT(w, pad);
        S_PUT(w, c->chunks[i].count);
        S_PUT(w, c->chunks[i].version);
    }
    ZPS_TRY(s_put(w, c->values, c->local_total * sizeof(float)));
    if (c->n_slots)
        ZPS_TRY(s_put(w, c->slots, (size_t)c->n_slots * c->local_total * sizeof(float)));
    uint64_t total_len = w->len + 8 + 4;
    S_PUT(w, total_len);
    uint32_t crc = (uint32_t)w->crc;
    ZPS_TRY(s_put(w, &crc, 4));
    return ZPS_OK;
}

zps_status ps_ckpt_write(const char *dir, int index, const ps_ckpt *c)
{
    char path[1100], tmp[1100];
    ps_ckpt_path(dir, index, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s/.server-%d.ckpt.tmp", dir, index);
    if (mkdir(dir, 0755) == -1 && errno != EEXIST)
        ZPS_CHECK_FILE(-1, dir);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ZPS_CHECK_FILE(fd, tmp);
    s_writer w = {fd, tmp, crc32(0, Z_NULL, 0), 0};
    zps_status st = s_write_body(&w, c);
    if (st == ZPS_OK && fsync(fd) == -1) {
        zps_log(ZPS_ERROR, "ckpt", "%s: fsync: %s", tmp, strerror(errno));
        st = ZPS_ERR_IO;
    }
    if (close(fd) == -1 && st == ZPS_OK) {
        zps_log(ZPS_ERROR, "ckpt", "%s: close: %s", tmp, strerror(errno));
        st = ZPS_ERR_IO;
    }
    if (st != ZPS_OK) {
        unlink(tmp);
        return st;
    }
    if (rename(tmp, path) == -1) {
        zps_log(ZPS_ERROR, "ckpt", "rename %s -> %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return ZPS_ERR_IO;
    }
    return s_fsync_dir(dir);
}

void ps_ckpt_free(ps_ckpt *c)
{
    free(c->chunks);
    zps_aligned_free(c->values);
    zps_aligned_free(c->slots);
    free(c->opt);
    memset(c, 0, sizeof *c);
}

typedef struct s_reader {
    const unsigned char *p;
    size_t left;
} s_reader;

static int s_get(s_reader *r, void *dst, size_t n)
{
    if (r->left < n)
        return 0;
    memcpy(dst, r->p, n);
    r->p += n;
    r->left -= n;
    return 1;
}

/* Sets why, logs the checkpoint as corrupt and returns ZPS_ERR_CORRUPT. */
__attribute__((format(printf, 4, 5))) static zps_status
s_corrupt(const char *path, char *why, size_t why_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, why_len, fmt, ap);
    va_end(ap);
    zps_log(ZPS_ERROR, "ckpt", "%s: corrupt checkpoint: %s", path, why);
    return ZPS_ERR_CORRUPT;
}

/* The whole file into *buf (the caller's, freed here on failure), *size bytes. */
static zps_status s_load(const char *path, unsigned char **buf, size_t *size, char *why,
                         size_t why_len)
{
    *buf = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd == -1) {
        snprintf(why, why_len, "%s", strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    struct stat stt;
    if (fstat(fd, &stt) == -1) {
        close(fd);
        ZPS_CHECK_FILE(-1, path);
    }
    *size = (size_t)stt.st_size;
    unsigned char *b = zps_xmalloc(*size ? *size : 1);
    ssize_t got = zps_read_full(fd, b, *size);
    int read_errno = errno;
    close(fd);
    zps_status st = ZPS_OK;
    if (got < 0) { // the file may be fine: an I/O error, not corruption
        snprintf(why, why_len, "cannot read it: %s", strerror(read_errno));
        zps_log(ZPS_ERROR, "ckpt", "%s: %s", path, why);
        st = ZPS_ERR_IO;
    } else if ((size_t)got != *size) {
        st = s_corrupt(path, why, why_len, "short read (%zd of %zu bytes)", got, *size);
    }
    if (st != ZPS_OK) {
        free(b);
        return st;
    }
    *buf = b;
    return ZPS_OK;
}

/* Magic, length field and CRC of a loaded file: what frames the body. */
static zps_status s_check_frame(const char *path, const unsigned char *buf, size_t size,
                                char *why, size_t why_len)
{
    if (size < 8 + 12 + 8)
        return s_corrupt(path, why, why_len, "file of %zu bytes is too short to be a checkpoint",
                         size);
    if (memcmp(buf, S_MAGIC, 8))
        return s_corrupt(path, why, why_len, "bad magic (not a zps checkpoint)");
    uint64_t flen;
    uint32_t fcrc;
    memcpy(&flen, buf + size - 12, 8);
    memcpy(&fcrc, buf + size - 4, 4);
    if (flen != size)
        return s_corrupt(path, why, why_len,
                         "length field says %llu bytes but the file has %zu (truncated?)",
                         (unsigned long long)flen, size);
    uLong crc = s_crc(crc32(0, Z_NULL, 0), buf, size - 4);
    if ((uint32_t)crc != fcrc)
        return s_corrupt(path, why, why_len, "CRC mismatch (stored %08x, computed %08x)", fcrc,
                         (uint32_t)crc);
    return ZPS_OK;
}

/* The body between magic and trailer into *c (whatever it allocated stays in *c, for
 * ps_ckpt_free, also on failure). */
static zps_status s_parse_body(const char *path, s_reader *r, ps_ckpt *c, char *why,
                               size_t why_len)
{
    uint32_t fmt = 0;
    if (!s_get(r, &fmt, 4) || fmt != S_FORMAT)
        return s_corrupt(path, why, why_len, "unknown format %u", fmt);
    if (!s_get(r, &c->server_index, 4) || !s_get(r, &c->plan_hash, 8) ||
        !s_get(r, &c->n_vars, 4) || !s_get(r, &c->total, 8) || !s_get(r, &c->n_servers, 4) ||
        !s_get(r, &c->chunk_bytes, 8) || !s_get(r, &c->num_chunks, 4) ||
        !s_get(r, &c->mode, 4) || !s_get(r, &c->n_local, 4) || !s_get(r, &c->n_slots, 4) ||
        !s_get(r, &c->opt_len, 4))
        return s_corrupt(path, why, why_len, "header truncated");
    if (c->n_slots > 2 || c->n_local > c->num_chunks || c->opt_len > r->left)
        return s_corrupt(path, why, why_len, "implausible header (%u slots, %u of %u chunks)",
                         c->n_slots, c->n_local, c->num_chunks);
    c->opt = zps_xmalloc(c->opt_len ? c->opt_len : 1);
    s_get(r, c->opt, c->opt_len);
    if ((uint64_t)c->n_local * 24 > r->left)
        return s_corrupt(path, why, why_len, "chunk table truncated");
    c->chunks = zps_xcalloc(c->n_local ? c->n_local : 1, sizeof *c->chunks);
    for (uint32_t i = 0; i < c->n_local; i++) {
        uint32_t pad;
        s_get(r, &c->chunks[i].key, 4);
        s_get(r, &pad, 4);
        s_get(r, &c->chunks[i].count, 8);
        s_get(r, &c->chunks[i].version, 8);
        if (c->chunks[i].key >= c->num_chunks || c->chunks[i].count == 0 ||
            c->chunks[i].count > c->total)
            return s_corrupt(path, why, why_len, "bad chunk %u (key %u, count %llu)", i,
                             c->chunks[i].key, (unsigned long long)c->chunks[i].count);
        c->local_total += c->chunks[i].count;
    }
    uint64_t need = c->local_total * 4ull * (1ull + c->n_slots);
    if (need != r->left)
        return s_corrupt(path, why, why_len, "payload is %zu bytes, the chunk table needs %llu",
                         r->left, (unsigned long long)need);
    c->values = zps_xaligned(64, c->local_total * 4 + 64);
    s_get(r, c->values, c->local_total * 4);
    c->slots = NULL;
    if (c->n_slots) {
        c->slots = zps_xaligned(64, c->local_total * 4 * c->n_slots + 64);
        s_get(r, c->slots, c->local_total * 4 * c->n_slots);
    }
    return ZPS_OK;
}

zps_status ps_ckpt_read(const char *path, ps_ckpt *out, char *why, size_t why_len)
{
    char dummy[8];
    if (!why) {
        why = dummy;
        why_len = sizeof dummy;
    }
    memset(out, 0, sizeof *out);
    why[0] = 0;
    unsigned char *buf;
    size_t size;
    ZPS_TRY(s_load(path, &buf, &size, why, why_len));
    ps_ckpt c = {0};
    zps_status st = s_check_frame(path, buf, size, why, why_len);
    if (st == ZPS_OK) {
        s_reader r = {buf + 8, size - 8 - 12};
        st = s_parse_body(path, &r, &c, why, why_len);
    }
    free(buf);
    if (st != ZPS_OK) {
        ps_ckpt_free(&c);
        return st;
    }
    *out = c;
    return ZPS_OK;
}
