/* weights.c — the weights file format (nn.h, docs/kernels.md "Weights file format"):
 * nn_weights_write/read for host tables and data, nn_model_save/load for a model.
 *
 * Invariants:
 *   - a file is written to path.tmp and renamed, so a reader never sees half a file;
 *   - a reader accepts a file only when magic and version match, every shape multiplies to
 *     its count, and the data are exactly what the tables promise (ZPS_ERR_CORRUPT
 *     otherwise); nothing read is trusted before those checks (no allocation from an
 *     unchecked size);
 *   - loading into a model changes nothing unless names, shapes and order all match.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/nn/nn_int.h"

static const char s_magic[8] = {'Z', 'P', 'S', 'W', 'G', 'T', '0', '1'};
enum { S_WEIGHTS_VERSION = 1, S_MAX_NAME = 95 };

static int s_wr(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }
static int s_rd(FILE *f, void *p, size_t n) { return fread(p, 1, n, f) == n ? 0 : -1; }

static int s_write_table(FILE *f, const nn_var *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t len = (uint16_t)strlen(v[i].name);
        uint32_t nd = (uint32_t)v[i].ndim;
        uint64_t cnt = v[i].count;
        if (s_wr(f, &len, 2) || s_wr(f, v[i].name, len) || s_wr(f, &nd, 4))
            return -1;
        for (int d = 0; d < v[i].ndim; d++) {
            uint32_t s = (uint32_t)v[i].shape[d];
            if (s_wr(f, &s, 4))
                return -1;
        }
        if (s_wr(f, &cnt, 8))
            return -1;
    }
    return 0;
}

FILE *nn_file_begin(const char *path, char *tmp)
{
    snprintf(tmp, 4096, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        zps_log(ZPS_ERROR, "nn", "%s: cannot create: %s", tmp, strerror(errno));
    return f;
}

zps_status nn_file_end(FILE *f, const char *tmp, const char *path, int bad)
{
    if (fclose(f) != 0)
        bad = 1;
    if (bad || rename(tmp, path) != 0) {
        zps_log(ZPS_ERROR, "nn", "%s: write failed: %s", path, strerror(errno));
        unlink(tmp);
        return ZPS_ERR_IO;
    }
    return ZPS_OK;
}

zps_status nn_weights_write(const char *path, const nn_var *vars, size_t nvars,
                            const float *params, const nn_var *stats, size_t nstats,
                            const float *statdata)
{
    char tmp[4096];
    FILE *f = nn_file_begin(path, tmp);
    if (!f)
        return ZPS_ERR_IO;
    uint32_t hdr[3] = {S_WEIGHTS_VERSION, (uint32_t)nvars, (uint32_t)nstats};
    size_t np = 0, ns = 0;
    for (size_t i = 0; i < nvars; i++)
        np += vars[i].count;
    for (size_t i = 0; i < nstats; i++)
        ns += stats[i].count;
    int bad = s_wr(f, s_magic, 8) || s_wr(f, hdr, sizeof hdr) || s_write_table(f, vars, nvars) ||
              s_write_table(f, stats, nstats) || s_wr(f, params, np * sizeof(float)) ||
              (ns && s_wr(f, statdata, ns * sizeof(float)));
    return nn_file_end(f, tmp, path, bad);
}

static int s_read_table(FILE *f, nn_var *v, size_t n, size_t *total)
{
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t len;
        uint32_t nd;
        uint64_t cnt;
        memset(&v[i], 0, sizeof v[i]);
        if (s_rd(f, &len, 2) || len > S_MAX_NAME || s_rd(f, v[i].name, len) || s_rd(f, &nd, 4) ||
            nd < 1 || nd > 4)
            return -1;
        v[i].ndim = (int)nd;
        uint64_t prod = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint32_t s;
            if (s_rd(f, &s, 4) || s == 0 || s > (1u << 30))
                return -1;
            v[i].shape[d] = (int)s;
            prod *= s;
        }
        if (s_rd(f, &cnt, 8) || cnt != prod || prod > ((uint64_t)1 << 34))
            return -1;
        v[i].count = cnt;
        v[i].offset = *total;
        *total += cnt;
    }
    return 0;
}

void nn_weights_destroy(nn_weights **pw)
{
    if (!pw || !*pw)
        return;
    free((*pw)->vars);
    free((*pw)->stats);
    free((*pw)->params);
    free((*pw)->statdata);
    free(*pw);
    *pw = NULL;
}

zps_status nn_weights_read(const char *path, nn_weights **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        zps_log(ZPS_ERROR, "nn", "%s: cannot open: %s", path, strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    char magic[8];
    uint32_t hdr[3];
    nn_weights *w = zps_xcalloc(1, sizeof *w);
    zps_status st = ZPS_ERR_CORRUPT;
    if (s_rd(f, magic, 8) || memcmp(magic, s_magic, 8) != 0 || s_rd(f, hdr, sizeof hdr))
        goto done;
    if (hdr[0] != S_WEIGHTS_VERSION) {
        st = ZPS_ERR_VERSION;
        goto done;
    }
    if (hdr[1] > 100000 || hdr[2] > 100000)
        goto done;
    w->nvars = hdr[1], w->nstats = hdr[2];
    w->vars = zps_xcalloc(w->nvars + 1, sizeof *w->vars);
    w->stats = zps_xcalloc(w->nstats + 1, sizeof *w->stats);
    if (s_read_table(f, w->vars, w->nvars, &w->param_count) ||
        s_read_table(f, w->stats, w->nstats, &w->stat_count))
        goto done;
    /* the data must be exactly what the tables promise */
    long here = ftell(f);
    if (here < 0 || fseek(f, 0, SEEK_END) != 0)
        goto done;
    long end = ftell(f);
    if (end < 0 || (uint64_t)(end - here) != (w->param_count + w->stat_count) * sizeof(float) ||
        fseek(f, here, SEEK_SET) != 0)
        goto done;
    w->params = zps_xmalloc(w->param_count * sizeof(float) + 4);
    w->statdata = zps_xmalloc(w->stat_count * sizeof(float) + 4);
    if (s_rd(f, w->params, w->param_count * sizeof(float)) ||
        s_rd(f, w->statdata, w->stat_count * sizeof(float)))
        goto done;
    st = ZPS_OK;
done:
    fclose(f);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "nn", "%s: not a valid zps weights file (%s)", path, zps_strerror(st));
        nn_weights_destroy(&w);
    }
    *out = w;
    return st;
}

zps_status nn_model_save(nn_model *m, const char *path)
{
    return nn_model_save_as(m, NN_WEIGHTS_ZPS, path);
}

zps_status nn_model_save_as(nn_model *m, nn_weights_format fmt, const char *path)
{
    float *hp = m->params, *hs = m->statbuf;
    if (!m->be->host_memory) {
        hp = zps_xmalloc(m->nparams * sizeof(float) + 4);
        hs = zps_xmalloc(m->nstatf * sizeof(float) + 4);
        zps_status st = m->be->copy_out(hp, m->params, m->nparams * sizeof(float));
        if (st == ZPS_OK)
            st = m->be->copy_out(hs, m->statbuf, m->nstatf * sizeof(float));
        if (st != ZPS_OK) {
            free(hp), free(hs);
            return st;
        }
    }
    zps_status st = nn_weights_write_as(fmt, path, m->vars, m->nvars, hp, m->stats, m->nstats, hs);
    if (!m->be->host_memory)
        free(hp), free(hs);
    return st;
}

static int s_same_table(const nn_var *a, size_t na, const nn_var *b, size_t nb, const char **bad)
{
    if (na != nb) {
        *bad = "number of variables";
        return 0;
    }
    for (size_t i = 0; i < na; i++)
        if (strcmp(a[i].name, b[i].name) != 0 || a[i].count != b[i].count ||
            a[i].ndim != b[i].ndim ||
            memcmp(a[i].shape, b[i].shape, sizeof(int) * (size_t)a[i].ndim)) {
            *bad = a[i].name;
            return 0;
        }
    return 1;
}

zps_status nn_model_load(nn_model *m, const char *path)
{
    nn_weights *w;
    ZPS_TRY(nn_weights_read(path, &w));
    const char *bad = NULL;
    zps_status st = ZPS_OK;
    if (!s_same_table(w->vars, w->nvars, m->vars, m->nvars, &bad) ||
        !s_same_table(w->stats, w->nstats, m->stats, m->nstats, &bad)) {
        zps_log(ZPS_ERROR, "nn", "%s does not fit this model (first difference: %s)", path, bad);
        st = ZPS_ERR_CONFIG;
    }
    if (st == ZPS_OK)
        st = m->be->copy_in(m->params, w->params, m->nparams * sizeof(float));
    if (st == ZPS_OK && m->nstatf)
        st = m->be->copy_in(m->statbuf, w->statdata, m->nstatf * sizeof(float));
    nn_weights_destroy(&w);
    return st;
}
