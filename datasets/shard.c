/* shard.c — see shard.h. Keys are appended in ascending order (MDB_APPEND), which keeps
 * pages full and makes a 60,000-record conversion a few large sequential transactions. */
#include "datasets/shard.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"

/* A shard's buffer is committed when it holds this many bytes or records. */
#define S_FLUSH_BYTES (32u << 20)
#define S_FLUSH_RECORDS 16384u
#define S_INITIAL_MAP (1ull << 20) // grows by doubling; small so growth is exercised

typedef struct s_wshard {
    char path[4096];   // where it is written: DIR/.NAME-SSSSS-of-NNNNN.tmp
    char final[4096];  // where close renames it: DIR/NAME-SSSSS-of-NNNNN
    MDB_env *env;
    MDB_dbi dbi;
    size_t mapsize;  // current map size
    uint8_t *buf;    // packed records back to back
    size_t len, cap; // bytes used / allocated in buf
    size_t *ends;    // (n) end offset of each buffered record in buf
    size_t n, n_cap;
    uint64_t next_key; // local index of the first buffered record
} s_wshard;

struct ds_writer {
    int n_shards;
    s_wshard *shards; // (n_shards)
    uint64_t count;   // records put
    uint8_t *pack;    // packing scratch
    size_t pack_cap;
};

void ds_key_format(uint64_t idx, char *key) { snprintf(key, DS_KEY_LEN + 1, "%010" PRIu64, idx); }

static zps_status s_mkdirs(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", dir);
    for (char *c = p + 1; *c; c++) {
        if (*c != '/')
            continue;
        *c = 0;
        if (mkdir(p, 0755) == -1 && errno != EEXIST)
            ZPS_CHECK_FILE(-1, p);
        *c = '/';
    }
    if (mkdir(p, 0755) == -1 && errno != EEXIST)
        ZPS_CHECK_FILE(-1, p);
    return ZPS_OK;
}

/* Parses "NAME-SSSSS-of-NNNNN"; name receives NAME. */
static bool s_parse_shard_name(const char *s, char *name, size_t name_len, int *idx, int *n)
{
    size_t L = strlen(s);
    /* -SSSSS-of-NNNNN is 15 characters */
    if (L < 16)
        return false;
    const char *t = s + L - 15;
    if (t[0] != '-' || strncmp(t + 6, "-of-", 4) != 0)
        return false;
    int a = 0, b = 0;
    for (int i = 1; i <= 5; i++) {
        if (t[i] < '0' || t[i] > '9' || t[i + 9] < '0' || t[i + 9] > '9')
            return false;
        a = a * 10 + (t[i] - '0');
        b = b * 10 + (t[i + 9] - '0');
    }
    if (b < 1 || a >= b || (size_t)(t - s) >= name_len)
        return false;
    memcpy(name, s, (size_t)(t - s));
    name[t - s] = 0;
    *idx = a;
    *n = b;
    return true;
}

static void s_remove_shard_dir(const char *path)
{
    char f[4200];
    snprintf(f, sizeof f, "%s/data.mdb", path);
    unlink(f);
    snprintf(f, sizeof f, "%s/lock.mdb", path);
    unlink(f);
    rmdir(path);
}

/* Deletes every NAME-*-of-* shard in dir (for overwrite). */
static void s_remove_old_shards(const char *dir, const char *name)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char nm[256], path[4096 + 300];
        int i, n;
        if (s_parse_shard_name(e->d_name, nm, sizeof nm, &i, &n) && strcmp(nm, name) == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            s_remove_shard_dir(path);
        }
    }
    closedir(d);
}

static zps_status s_wshard_open(s_wshard *ws)
{
    ZPS_CHECK_LMDB(mdb_env_create(&ws->env));
    ws->mapsize = S_INITIAL_MAP;
    ZPS_CHECK_LMDB(mdb_env_set_mapsize(ws->env, ws->mapsize));
    int rc = mdb_env_open(ws->env, ws->path, MDB_NOSYNC, 0644);
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "%s: cannot create shard: %s", ws->path, mdb_strerror(rc));
        return ZPS_ERR_LMDB;
    }
    MDB_txn *txn;
    ZPS_CHECK_LMDB(mdb_txn_begin(ws->env, NULL, 0, &txn));
    rc = mdb_dbi_open(txn, NULL, 0, &ws->dbi);
    if (rc != MDB_SUCCESS) {
        mdb_txn_abort(txn);
        ZPS_CHECK_LMDB(rc);
    }
    ZPS_CHECK_LMDB(mdb_txn_commit(txn));
    return ZPS_OK;
}

zps_status ds_writer_new(const char *dir, const char *name, int n_shards, bool overwrite,
                         ds_writer **out)
{
    *out = NULL;
    if (n_shards < 1 || n_shards > DS_MAX_SHARDS || !name || !*name || strchr(name, '/') ||
        strlen(name) > 200) {
        zps_log(ZPS_ERROR, "ds", "bad writer arguments: name '%s', %d shards (1..%d)",
                name ? name : "(null)", n_shards, DS_MAX_SHARDS);
        return ZPS_ERR_INVALID;
    }
    ZPS_TRY(s_mkdirs(dir));
    if (overwrite)
        s_remove_old_shards(dir, name);
    ds_writer *w = zps_xcalloc(1, sizeof *w);
    w->n_shards = n_shards;
    w->shards = zps_xcalloc((size_t)n_shards, sizeof *w->shards);
    zps_status st = ZPS_OK;
    for (int s = 0; s < n_shards && st == ZPS_OK; s++) {
        s_wshard *ws = &w->shards[s];
        snprintf(ws->final, sizeof ws->final, "%s/%s-%05d-of-%05d", dir, name, s, n_shards);
        snprintf(ws->path, sizeof ws->path, "%s/.%s-%05d-of-%05d.tmp", dir, name, s, n_shards);
        struct stat sb;
        if (stat(ws->final, &sb) == 0) {
            zps_log(ZPS_ERROR, "ds", "%s already exists (use --force to overwrite)", ws->final);
            st = ZPS_ERR_EXISTS;
            break;
        }
        s_remove_shard_dir(ws->path); /* left over from an interrupted writer */
        st = s_mkdirs(ws->path);
        if (st == ZPS_OK)
            st = s_wshard_open(ws);
    }
    if (st != ZPS_OK) {
        ds_writer_destroy(&w);
        return st;
    }
    *out = w;
    return ZPS_OK;
}

/* Writes the shard's buffered records in one transaction, growing the map on MDB_MAP_FULL. */
static zps_status s_flush(s_wshard *ws)
{
    if (ws->n == 0)
        return ZPS_OK;
    for (;;) {
        MDB_txn *txn;
        ZPS_CHECK_LMDB(mdb_txn_begin(ws->env, NULL, 0, &txn));
        int rc = MDB_SUCCESS;
        size_t start = 0;
        for (size_t i = 0; i < ws->n && rc == MDB_SUCCESS; i++) {
            char key[DS_KEY_LEN + 1];
            ds_key_format(ws->next_key + i, key);
            MDB_val k = {.mv_size = DS_KEY_LEN, .mv_data = key};
            MDB_val v = {.mv_size = ws->ends[i] - start, .mv_data = ws->buf + start};
            rc = mdb_put(txn, ws->dbi, &k, &v, MDB_APPEND);
            start = ws->ends[i];
        }
        if (rc == MDB_SUCCESS)
            rc = mdb_txn_commit(txn);
        else
            mdb_txn_abort(txn);
        if (rc == MDB_MAP_FULL) {
            /* Grow: at least double, and leave room for twice this batch. */
            size_t want = ws->mapsize * 2;
            if (want < ws->mapsize + 2 * ws->len + (1u << 20))
                want = ws->mapsize + 2 * ws->len + (1u << 20);
            zps_log(ZPS_DEBUG, "ds", "%s: map full, growing %zu -> %zu bytes", ws->path,
                    ws->mapsize, want);
            ZPS_CHECK_LMDB(mdb_env_set_mapsize(ws->env, want));
            ws->mapsize = want;
            continue;
        }
        if (rc != MDB_SUCCESS) {
            zps_log(ZPS_ERROR, "ds", "%s: writing %zu records failed: %s", ws->path, ws->n,
                    mdb_strerror(rc));
            return ZPS_ERR_LMDB;
        }
        break;
    }
    ws->next_key += ws->n;
    ws->n = 0;
    ws->len = 0;
    return ZPS_OK;
}

zps_status ds_writer_put(ds_writer *w, const ds_record *r)
{
    size_t len;
    ZPS_TRY(ds_record_pack(r, &w->pack, &w->pack_cap, &len));
    s_wshard *ws = &w->shards[w->count % (uint64_t)w->n_shards];
    if (ws->len + len > ws->cap) {
        ws->cap = (ws->len + len) * 2;
        ws->buf = zps_xrealloc(ws->buf, ws->cap);
    }
    if (ws->n == ws->n_cap) {
        ws->n_cap = ws->n_cap ? ws->n_cap * 2 : 1024;
        ws->ends = zps_xrealloc(ws->ends, ws->n_cap * sizeof *ws->ends);
    }
    memcpy(ws->buf + ws->len, w->pack, len);
    ws->len += len;
    ws->ends[ws->n++] = ws->len;
    w->count++;
    if (ws->len >= S_FLUSH_BYTES || ws->n >= S_FLUSH_RECORDS)
        ZPS_TRY(s_flush(ws));
    return ZPS_OK;
}

uint64_t ds_writer_count(const ds_writer *w) { return w->count; }

zps_status ds_writer_close(ds_writer **pw)
{
    ds_writer *w = *pw;
    zps_status st = ZPS_OK;
    for (int s = 0; s < w->n_shards && st == ZPS_OK; s++) {
        s_wshard *ws = &w->shards[s];
        st = s_flush(ws);
        if (st == ZPS_OK) {
            int rc = mdb_env_sync(ws->env, 1);
            if (rc != MDB_SUCCESS) {
                zps_log(ZPS_ERROR, "ds", "%s: sync failed: %s", ws->path, mdb_strerror(rc));
                st = ZPS_ERR_LMDB;
            }
        }
    }
    /* Only complete shards get their real names: an interrupted conversion leaves hidden
     * .tmp directories that no reader picks up. */
    for (int s = 0; s < w->n_shards && st == ZPS_OK; s++) {
        s_wshard *ws = &w->shards[s];
        mdb_env_close(ws->env);
        ws->env = NULL;
        if (rename(ws->path, ws->final) == -1) {
            zps_log(ZPS_ERROR, "ds", "rename %s -> %s failed: %s", ws->path, ws->final,
                    strerror(errno));
            st = ZPS_ERR_IO;
        }
    }
    ds_writer_destroy(pw);
    return st;
}

void ds_writer_destroy(ds_writer **pw)
{
    if (!pw || !*pw)
        return;
    ds_writer *w = *pw;
    for (int s = 0; s < w->n_shards; s++) {
        s_wshard *ws = &w->shards[s];
        if (ws->env)
            mdb_env_close(ws->env);
        if (ws->path[0])
            s_remove_shard_dir(ws->path); /* unfinished (a renamed shard is gone from here) */
        free(ws->buf);
        free(ws->ends);
    }
    free(w->shards);
    free(w->pack);
    free(w);
    *pw = NULL;
}

/* ---- reading ---- */

struct ds_shard {
    char path[4096];
    const char *name; // points into path
    MDB_env *env;
    MDB_dbi dbi;
    uint64_t count;
    char damage[256]; // "" when healthy; else why no record can be read
};

struct ds_reader {
    ds_shard *s;
    MDB_txn *txn;
    MDB_cursor *cur;
    bool started; // cursor positioned (next uses MDB_NEXT)
};

zps_status ds_shard_open(const char *path, unsigned flags, ds_shard **out)
{
    *out = NULL;
    char data[4200];
    snprintf(data, sizeof data, "%s/data.mdb", path);
    struct stat sb;
    if (stat(data, &sb) == -1) {
        zps_log(ZPS_ERROR, "ds", "shard %s: no data.mdb (%s)", path, strerror(errno));
        return ZPS_ERR_NOT_FOUND;
    }
    ds_shard *s = zps_xcalloc(1, sizeof *s);
    snprintf(s->path, sizeof s->path, "%s", path);
    size_t L = strlen(s->path);
    while (L > 1 && s->path[L - 1] == '/')
        s->path[--L] = 0;
    const char *slash = strrchr(s->path, '/');
    s->name = slash ? slash + 1 : s->path;
    zps_status st = ZPS_ERR_CORRUPT;
    int rc = mdb_env_create(&s->env);
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s: mdb_env_create: %s", s->name, mdb_strerror(rc));
        st = ZPS_ERR_LMDB;
        goto fail;
    }
    rc = mdb_env_open(s->env, s->path, MDB_RDONLY | MDB_NOLOCK | MDB_NOTLS, 0644);
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s: not a readable LMDB shard: %s", s->path,
                mdb_strerror(rc));
        goto fail;
    }
    MDB_envinfo info;
    MDB_stat est;
    if (mdb_env_info(s->env, &info) != MDB_SUCCESS || mdb_env_stat(s->env, &est) != MDB_SUCCESS)
        goto fail;
    uint64_t need = ((uint64_t)info.me_last_pgno + 1) * est.ms_psize;
    if ((uint64_t)sb.st_size < need) {
        snprintf(s->damage, sizeof s->damage, "truncated: data.mdb has %lld bytes, its last "
                 "page ends at %" PRIu64, (long long)sb.st_size, need);
        if (!(flags & DS_OPEN_ALLOW_DAMAGED)) {
            zps_log(ZPS_ERROR, "ds", "shard %s is %s", s->path, s->damage);
            goto fail;
        }
        /* The meta pages (at the start) still say how many records there were; the B-tree
         * is never touched. */
        s->count = est.ms_entries;
        zps_log(ZPS_WARN, "ds", "shard %s is %s: its %" PRIu64 " records will fail to read",
                s->path, s->damage, s->count);
        *out = s;
        return ZPS_OK;
    }
    MDB_txn *txn;
    rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (rc == MDB_SUCCESS) {
        rc = mdb_dbi_open(txn, NULL, 0, &s->dbi);
        MDB_stat ds;
        if (rc == MDB_SUCCESS)
            rc = mdb_stat(txn, s->dbi, &ds);
        if (rc == MDB_SUCCESS)
            s->count = ds.ms_entries;
        mdb_txn_abort(txn);
    }
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s: cannot read its database: %s", s->path,
                mdb_strerror(rc));
        goto fail;
    }
    *out = s;
    return ZPS_OK;
fail:
    ds_shard_close(&s);
    return st;
}

void ds_shard_close(ds_shard **ps)
{
    if (!ps || !*ps)
        return;
    if ((*ps)->env)
        mdb_env_close((*ps)->env);
    free(*ps);
    *ps = NULL;
}

uint64_t ds_shard_count(const ds_shard *s) { return s->count; }
const char *ds_shard_damage(const ds_shard *s) { return s->damage[0] ? s->damage : NULL; }
const char *ds_shard_name(const ds_shard *s) { return s->name; }
const char *ds_shard_path(const ds_shard *s) { return s->path; }

zps_status ds_reader_new(ds_shard *s, ds_reader **out)
{
    *out = NULL;
    ds_reader *r = zps_xcalloc(1, sizeof *r);
    r->s = s;
    if (s->damage[0]) { /* reads fail one by one (ds_reader_get / ds_reader_next) */
        *out = r;
        return ZPS_OK;
    }
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &r->txn);
    if (rc == MDB_SUCCESS)
        rc = mdb_cursor_open(r->txn, s->dbi, &r->cur);
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s: cannot start reading: %s", s->name, mdb_strerror(rc));
        ds_reader_destroy(&r);
        return ZPS_ERR_LMDB;
    }
    *out = r;
    return ZPS_OK;
}

void ds_reader_destroy(ds_reader **pr)
{
    if (!pr || !*pr)
        return;
    ds_reader *r = *pr;
    if (r->cur)
        mdb_cursor_close(r->cur);
    if (r->txn)
        mdb_txn_abort(r->txn);
    free(r);
    *pr = NULL;
}

zps_status ds_reader_get(ds_reader *r, uint64_t idx, const uint8_t **val, size_t *len)
{
    char key[DS_KEY_LEN + 1];
    ds_key_format(idx, key);
    if (r->s->damage[0]) {
        zps_log(ZPS_ERROR, "ds", "shard %s key %s: shard is %s", r->s->name, key, r->s->damage);
        return ZPS_ERR_CORRUPT;
    }
    MDB_val k = {.mv_size = DS_KEY_LEN, .mv_data = key}, v;
    int rc = mdb_get(r->txn, r->s->dbi, &k, &v);
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s key %s: %s", r->s->name, key,
                rc == MDB_NOTFOUND ? "missing" : mdb_strerror(rc));
        return ZPS_ERR_CORRUPT;
    }
    *val = v.mv_data;
    *len = v.mv_size;
    return ZPS_OK;
}

zps_status ds_reader_next(ds_reader *r, char *key, const uint8_t **val, size_t *len)
{
    MDB_val k, v;
    if (r->s->damage[0]) {
        zps_log(ZPS_ERROR, "ds", "shard %s: shard is %s", r->s->name, r->s->damage);
        return ZPS_ERR_CORRUPT;
    }
    int rc = mdb_cursor_get(r->cur, &k, &v, r->started ? MDB_NEXT : MDB_FIRST);
    r->started = true;
    if (rc == MDB_NOTFOUND)
        return ZPS_ERR_EOF;
    if (rc != MDB_SUCCESS) {
        zps_log(ZPS_ERROR, "ds", "shard %s: cursor failed: %s", r->s->name, mdb_strerror(rc));
        return ZPS_ERR_CORRUPT;
    }
    size_t kl = k.mv_size < DS_KEY_LEN ? k.mv_size : DS_KEY_LEN;
    memcpy(key, k.mv_data, kl);
    key[kl] = 0;
    for (size_t i = 0; i < kl; i++) /* a damaged key is still printable in messages */
        if (key[i] < 0x20 || key[i] > 0x7e)
            key[i] = '?';
    *val = v.mv_data;
    *len = v.mv_size;
    return ZPS_OK;
}

void ds_reader_rewind(ds_reader *r) { r->started = false; }

/* ---- dataset ---- */

static bool s_is_dir(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static zps_status s_read_classes(ds_dataset *d)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/classes.txt", d->dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return ZPS_OK;
    char line[1024];
    int cap = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (!*line)
            continue;
        if (d->num_classes == DS_MAX_CLASSES)
            break;
        if (d->num_classes == cap) {
            cap = cap ? cap * 2 : 16;
            d->classes = zps_xrealloc(d->classes, (size_t)cap * sizeof *d->classes);
        }
        d->classes[d->num_classes++] = zps_xstrdup(line);
    }
    fclose(f);
    return ZPS_OK;
}

zps_status ds_dataset_open(const char *path, const char *split, ds_dataset **out)
{
    return ds_dataset_open_flags(path, split, 0, out);
}

/* The directory holding the shards into d->dir and the NAME they must carry into prefix
 * ("" = any): PATH/SPLIT, PATH, or PATH read as DIR/NAME. */
static void s_resolve_dir(const char *path, const char *split, ds_dataset *d, char *prefix,
                          size_t prefix_len)
{
    char joined[4096];
    snprintf(joined, sizeof joined, "%s/%s", path, split ? split : "");
    if (split && s_is_dir(joined)) {
        snprintf(d->dir, sizeof d->dir, "%s", joined);
    } else if (s_is_dir(path)) {
        snprintf(d->dir, sizeof d->dir, "%s", path);
    } else {
        const char *slash = strrchr(path, '/');
        if (slash) {
            snprintf(d->dir, sizeof d->dir, "%.*s", (int)(slash - path), path);
            if (!d->dir[0])
                snprintf(d->dir, sizeof d->dir, "/");
            snprintf(prefix, prefix_len, "%s", slash + 1);
        } else {
            snprintf(d->dir, sizeof d->dir, ".");
            snprintf(prefix, prefix_len, "%s", path);
        }
    }
}

/* Marks each shard name of d->dir (matching prefix when given) in *seen, sets d->name and
 * *n from the first; every shard must name the same dataset and shard count. */
static zps_status s_scan_names(DIR *dir, ds_dataset *d, const char *prefix, bool **seen, int *n)
{
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        char nm[256];
        int si, sn;
        if (!s_parse_shard_name(e->d_name, nm, sizeof nm, &si, &sn))
            continue;
        if (prefix[0] && strcmp(nm, prefix) != 0)
            continue;
        if (*n == 0) {
            snprintf(d->name, sizeof d->name, "%s", nm);
            *n = sn;
            *seen = zps_xcalloc((size_t)sn, sizeof **seen);
        } else if (strcmp(nm, d->name) != 0) {
            zps_log(ZPS_ERROR, "ds", "%s holds shards of several datasets (%s, %s): give a "
                    "prefix DIR/NAME", d->dir, d->name, nm);
            return ZPS_ERR_INVALID;
        } else if (sn != *n) {
            zps_log(ZPS_ERROR, "ds", "%s: shard %s says %d shards, others say %d", d->dir,
                    e->d_name, sn, *n);
            return ZPS_ERR_CORRUPT;
        }
        (*seen)[si] = true;
    }
    return ZPS_OK;
}

/* The shard count of d->dir's dataset into *n, once every shard 0..n-1 is there. */
static zps_status s_find_shards(const char *path, ds_dataset *d, const char *prefix, int *n)
{
    DIR *dir = opendir(d->dir);
    if (!dir) {
        zps_log(ZPS_ERROR, "ds", "dataset %s: cannot open directory %s: %s", path, d->dir,
                strerror(errno));
        return ZPS_ERR_NOT_FOUND;
    }
    *n = 0;
    bool *seen = NULL;
    zps_status st = s_scan_names(dir, d, prefix, &seen, n);
    closedir(dir);
    if (st == ZPS_OK && *n == 0) {
        zps_log(ZPS_ERROR, "ds", "no shards NAME-SSSSS-of-NNNNN%s%s in %s", prefix[0] ? " named " : "",
                prefix, d->dir);
        st = ZPS_ERR_NOT_FOUND;
    }
    for (int s = 0; st == ZPS_OK && s < *n; s++) {
        if (!seen[s]) {
            zps_log(ZPS_ERROR, "ds", "missing shard %s-%05d-of-%05d in %s", d->name, s, *n, d->dir);
            st = ZPS_ERR_NOT_FOUND;
        }
    }
    free(seen);
    return st;
}

zps_status ds_dataset_open_flags(const char *path, const char *split, unsigned flags,
                                 ds_dataset **out)
{
    *out = NULL;
    ds_dataset *d = zps_xcalloc(1, sizeof *d);
    char prefix[256] = "";
    s_resolve_dir(path, split, d, prefix, sizeof prefix);
    int n;
    zps_status st = s_find_shards(path, d, prefix, &n);
    if (st != ZPS_OK) {
        free(d);
        return st;
    }
    d->n_shards = n;
    d->shards = zps_xcalloc((size_t)n, sizeof *d->shards);
    d->offsets = zps_xcalloc((size_t)n + 1, sizeof *d->offsets);
    for (int s = 0; s < n; s++) {
        char sp[4096 + 300];
        snprintf(sp, sizeof sp, "%s/%s-%05d-of-%05d", d->dir, d->name, s, n);
        st = ds_shard_open(sp, flags, &d->shards[s]);
        if (st != ZPS_OK) {
            ds_dataset_close(&d);
            return st;
        }
        d->offsets[s + 1] = d->offsets[s] + ds_shard_count(d->shards[s]);
    }
    d->total = d->offsets[n];
    s_read_classes(d);
    *out = d;
    return ZPS_OK;
}

void ds_dataset_close(ds_dataset **pd)
{
    if (!pd || !*pd)
        return;
    ds_dataset *d = *pd;
    for (int s = 0; s < d->n_shards; s++)
        ds_shard_close(&d->shards[s]);
    for (int c = 0; c < d->num_classes; c++)
        free(d->classes[c]);
    free(d->classes);
    free(d->shards);
    free(d->offsets);
    free(d);
    *pd = NULL;
}

void ds_dataset_locate(const ds_dataset *d, uint64_t g, int *shard, uint64_t *local)
{
    /* binary search for the last shard whose first record is <= g */
    int lo = 0, hi = d->n_shards - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (d->offsets[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    /* skip empty shards that share the same offset */
    while (lo < d->n_shards - 1 && d->offsets[lo + 1] <= g)
        lo++;
    *shard = lo;
    *local = g - d->offsets[lo];
}

void ds_assign(uint64_t total, int i, int n, uint64_t *begin, uint64_t *end)
{
    *begin = (uint64_t)((unsigned __int128)total * (unsigned)i / (unsigned)n);
    *end = (uint64_t)((unsigned __int128)total * (unsigned)(i + 1) / (unsigned)n);
}

zps_status ds_classes_write(const char *dir, char *const *names, int n)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/classes.txt", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        ZPS_CHECK_FILE(-1, path);
    for (int i = 0; i < n; i++)
        fprintf(f, "%s\n", names[i]);
    if (fclose(f) != 0)
        ZPS_CHECK_FILE(-1, path);
    return ZPS_OK;
}
