/* safetensors.c — weights in the safetensors format (nn.h "weights files"), the one PyTorch,
 * TensorFlow and most model hubs read: torchvision's state_dict loads it as it is.
 *
 * Layout: u64 little-endian N, then N bytes of JSON (padded with spaces to a multiple of
 * 8, so the data starts aligned), then the tensors' bytes back to back:
 *   {"__metadata__": {"format": "pt", "producer": "zps VERSION"},
 *    "NAME": {"dtype": "F32", "shape": [..], "data_offsets": [BEGIN, END]}, ...}
 * Offsets count from the start of the data and tile it without holes, in this order: first
 * one I64 scalar NAME.num_batches_tracked per batchnorm (the key PyTorch's BatchNorm keeps
 * beside running_mean and running_var, so a strict load finds every key it expects; zps
 * does not count batches and writes 0, which PyTorch reads only with momentum=None), then
 * the variables in table order, then the running statistics. Every F32 tensor is 4-byte
 * aligned and every I64 8-byte aligned.
 * Written to PATH.tmp and renamed, so a failed write leaves no half file under PATH.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/opts.h"
#include "common/version.h"
#include "trainer/nn/nn_int.h"

/* The header size and the data are written as the host holds them. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors is little-endian");

#define S_BN_STAT ".running_var" /* one per batchnorm: where num_batches_tracked goes */

/* The batchnorm whose running_var stats[i] is: the length of its prefix, else 0. */
static size_t s_bn_prefix(const nn_var *stat)
{
    size_t n = strlen(stat->name), k = strlen(S_BN_STAT);
    return n > k && !strcmp(stat->name + n - k, S_BN_STAT) ? n - k : 0;
}

static void s_entry(zps_json *j, const char *name, size_t name_len, const char *suffix,
                    const char *dtype, const nn_var *shape_of, uint64_t *off, uint64_t bytes)
{
    char key[160];
    snprintf(key, sizeof key, "%.*s%s", (int)name_len, name, suffix);
    zps_json_raw(j, ",");
    zps_json_str(j, key);
    zps_json_raw(j, ":{\"dtype\":\"%s\",\"shape\":[", dtype);
    for (int d = 0; shape_of && d < shape_of->ndim; d++)
        zps_json_raw(j, "%s%d", d ? "," : "", shape_of->shape[d]);
    zps_json_raw(j, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)*off,
                 (unsigned long long)(*off + bytes));
    *off += bytes;
}

/* The JSON header into j (measure with an empty writer first). */
static void s_header(zps_json *j, const nn_var *vars, size_t nvars, const nn_var *stats,
                     size_t nstats)
{
    uint64_t off = 0;
    zps_json_raw(j, "{\"__metadata__\":{\"format\":\"pt\",\"producer\":\"zps %s\"}",
                 ZPS_VERSION);
    for (size_t i = 0; i < nstats; i++) {
        size_t p = s_bn_prefix(&stats[i]);
        if (p)
            s_entry(j, stats[i].name, p, ".num_batches_tracked", "I64", NULL, &off, 8);
    }
    for (size_t i = 0; i < nvars; i++)
        s_entry(j, vars[i].name, strlen(vars[i].name), "", "F32", &vars[i], &off,
                vars[i].count * 4);
    for (size_t i = 0; i < nstats; i++)
        s_entry(j, stats[i].name, strlen(stats[i].name), "", "F32", &stats[i], &off,
                stats[i].count * 4);
    zps_json_raw(j, "}");
}

static int s_write_all(FILE *f, const void *p, size_t n) { return n && fwrite(p, 1, n, f) != n; }

/* The data section: the zero counters, the variables, the statistics. */
static int s_write_data(FILE *f, const nn_var *vars, size_t nvars, const float *params,
                        const nn_var *stats, size_t nstats, const float *statdata)
{
    int64_t zero = 0;
    size_t np = 0, ns = 0;
    for (size_t i = 0; i < nstats; i++) {
        ns += stats[i].count;
        if (s_bn_prefix(&stats[i]) && s_write_all(f, &zero, 8))
            return -1;
    }
    for (size_t i = 0; i < nvars; i++)
        np += vars[i].count;
    return s_write_all(f, params, np * 4) || s_write_all(f, statdata, ns * 4);
}

zps_status nn_safetensors_write(const char *path, const nn_var *vars, size_t nvars,
                                const float *params, const nn_var *stats, size_t nstats,
                                const float *statdata)
{
    zps_json m = zps_json_over(NULL, 0);
    s_header(&m, vars, nvars, stats, nstats);
    size_t hlen = (m.len + 7) / 8 * 8;
    char *hdr = zps_xmalloc(hlen + 1);
    zps_json j = zps_json_over(hdr, hlen + 1);
    s_header(&j, vars, nvars, stats, nstats);
    memset(hdr + j.len, ' ', hlen - j.len);
    char tmp[4096];
    FILE *f = nn_file_begin(path, tmp);
    if (!f) {
        free(hdr);
        return ZPS_ERR_IO;
    }
    uint64_t n = hlen;
    int bad = s_write_all(f, &n, 8) || s_write_all(f, hdr, hlen) ||
              s_write_data(f, vars, nvars, params, stats, nstats, statdata);
    free(hdr);
    return nn_file_end(f, tmp, path, bad);
}

const zps_opt_name nn_weights_format_names[] = {
    {"zps", NN_WEIGHTS_ZPS}, {"safetensors", NN_WEIGHTS_SAFETENSORS}, {NULL, 0}};

zps_status nn_weights_write_as(nn_weights_format fmt, const char *path, const nn_var *vars,
                               size_t nvars, const float *params, const nn_var *stats,
                               size_t nstats, const float *statdata)
{
    if (fmt == NN_WEIGHTS_SAFETENSORS)
        return nn_safetensors_write(path, vars, nvars, params, stats, nstats, statdata);
    return nn_weights_write(path, vars, nvars, params, stats, nstats, statdata);
}
