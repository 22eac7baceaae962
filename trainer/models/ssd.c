/* ssd.c — the ssd detector (see ssd.h): a small Inception stack, extra feature layers and
 * per-map 3x3 heads, plus the host glue between the heads' NCHW maps and the prior-major
 * (n, P, D) tensors the detection loss takes.
 *
 * Layers are added in the order a torchvision module would declare them (backbone, extras,
 * every classification head, every regression head), so the variable table is in
 * state_dict order and the PS servers shard it like any other model's.
 *
 * The permutation into prior order runs on the host, not as an nn layer: the loss runs on the
 * host anyway (its matching and hard-negative mining are sequential), the heads' outputs have
 * to come out of the back-end for it in any case, and reading them through
 * nn_model_output_read already yields NCHW whatever layout the plan chose, so one index
 * shuffle during that copy costs nothing extra and needs no new kernel on any back-end.
 */
#include "trainer/models/ssd.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"

enum { S_MAPS = 5, NN_SSD_MAX_OUTS = 2 * S_MAPS };

/* Priors per cell of each map (trainer/detect's: ratios {1, 1', 2, 1/2} or with 3, 1/3). */
static const int s_anchors[S_MAPS] = {4, 6, 6, 4, 4};

typedef struct s_net {
    nn_model *m;
    float width;
    char block[48]; // current block name ("Mixed_5b"); "" outside blocks
} s_net;

static int s_ch(const s_net *b, int c)
{
    int v = (int)lroundf((float)c * b->width);
    return v < 1 ? 1 : v;
}

/* BasicConv2d (r x r kernel) named block.branch, or branch outside a block. */
static int s_bc(s_net *b, const char *branch, int in, int k, int r, int stride, int pad)
{
    char name[96];
    snprintf(name, sizeof name, "%s%s%s", b->block, b->block[0] ? "." : "", branch);
    return nn_conv_bn_relu(b->m, name, in, s_ch(b, k), r, r, stride, stride, pad, pad, 0.1f);
}

static int s_pool_named(s_net *b, int max, int in, int r, int stride, int pad)
{
    char name[96];
    snprintf(name, sizeof name, "%s.pool", b->block);
    return max ? nn_maxpool(b->m, name, in, r, stride, pad) : nn_avgpool(b->m, name, in, r, stride, pad);
}

/* InceptionA: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | 3x3 avgpool-1x1; c = the six widths. */
static int s_block_a(s_net *b, const char *name, int x, const int c[6])
{
    snprintf(b->block, sizeof b->block, "%s", name);
    int b1 = s_bc(b, "branch1x1", x, c[0], 1, 1, 0);
    int b5 = s_bc(b, "branch5x5_1", x, c[1], 1, 1, 0);
    b5 = s_bc(b, "branch5x5_2", b5, c[2], 5, 1, 2);
    int b3 = s_bc(b, "branch3x3dbl_1", x, c[3], 1, 1, 0);
    b3 = s_bc(b, "branch3x3dbl_2", b3, c[4], 3, 1, 1);
    b3 = s_bc(b, "branch3x3dbl_3", b3, c[4], 3, 1, 1);
    int bp = s_bc(b, "branch_pool", s_pool_named(b, 0, x, 3, 1, 1), c[5], 1, 1, 0);
    return nn_concat(b->m, name, 4, (int[]){b1, b5, b3, bp});
}

/* InceptionB, padded so the map halves exactly: 3x3 s2 | 1x1-3x3-3x3 s2 | 3x3 maxpool s2. */
static int s_block_b(s_net *b, const char *name, int x, int c3, int d1, int d2)
{
    snprintf(b->block, sizeof b->block, "%s", name);
    int b3 = s_bc(b, "branch3x3", x, c3, 3, 2, 1);
    int bd = s_bc(b, "branch3x3dbl_1", x, d1, 1, 1, 0);
    bd = s_bc(b, "branch3x3dbl_2", bd, d2, 3, 1, 1);
    bd = s_bc(b, "branch3x3dbl_3", bd, d2, 3, 2, 1);
    int bp = s_pool_named(b, 1, x, 3, 2, 1);
    return nn_concat(b->m, name, 3, (int[]){b3, bd, bp});
}

/* The backbone and extras; maps[] receives the five feature maps' tensors. */
static void s_features(s_net *b, int maps[S_MAPS])
{
    nn_model *m = b->m;
    int x = s_bc(b, "Conv2d_1a_3x3", 0, 16, 3, 2, 1);
    x = s_bc(b, "Conv2d_2a_3x3", x, 24, 3, 1, 1);
    x = nn_maxpool(m, "maxpool1", x, 3, 2, 1);
    x = s_bc(b, "Conv2d_3b_1x1", x, 32, 1, 1, 0);
    x = s_bc(b, "Conv2d_4a_3x3", x, 64, 3, 1, 1);
    x = nn_maxpool(m, "maxpool2", x, 3, 2, 1);
    x = s_block_a(b, "Mixed_5b", x, (const int[]){32, 24, 32, 32, 48, 16});
    maps[0] = x = s_block_a(b, "Mixed_5c", x, (const int[]){32, 24, 32, 32, 48, 32});
    x = s_block_b(b, "Mixed_6a", x, 96, 32, 48);
    maps[1] = x = s_block_a(b, "Mixed_6b", x, (const int[]){64, 48, 64, 64, 96, 32});
    static const int mid[3] = {64, 32, 32}, out[3] = {128, 64, 64};
    for (int k = 0; k < 3; k++) {
        snprintf(b->block, sizeof b->block, "extra.%d", k);
        x = s_bc(b, "0", x, mid[k], 1, 1, 0);
        maps[k + 2] = x = s_bc(b, "1", x, out[k], 3, 2, 1);
    }
}

zps_status nn_ssd_create(const k_backend *be, const nn_model_opts *o, nn_model **out)
{
    *out = NULL;
    nn_model *m = nn_model_new(be, o->in_channels, o->in_size, o->in_size);
    s_net b = {.m = m, .width = o->width > 0 ? o->width : 1.0f};
    int maps[S_MAPS];
    s_features(&b, maps);
    for (int kind = 0; kind < 2; kind++)
        for (int k = 0; k < S_MAPS; k++) {
            char name[96];
            snprintf(name, sizeof name, "head.%s_head.module_list.%d",
                     kind ? "regression" : "classification", k);
            int d = kind ? 4 : o->classes + 1;
            nn_model_output(m, nn_conv(m, name, maps[k], s_anchors[k] * d, 3, 3, 1, 1, 0.03f));
        }
    zps_status st = nn_model_finish(m, o->seed);
    if (st != ZPS_OK) {
        nn_model_destroy(&m);
        return st;
    }
    *out = m;
    return ZPS_OK;
}

/* ---- the prior order ---- */

/* Output i's geometry: priors per cell a, values per prior d, map h x w. */
static void s_geom(const nn_model *m, int i, int *a, int *d, int *h, int *w)
{
    int maps = nn_model_outputs(m) / 2, c, lc;
    nn_model_output_shape(m, maps + i % maps, &lc, h, w);
    *a = lc / 4;
    nn_model_output_shape(m, i, &c, h, w);
    *d = c / *a;
}

int nn_ssd_priors(const nn_model *m, int *classes_bg)
{
    int maps = nn_model_outputs(m) / 2, p = 0, a, d, h, w;
    assert(maps > 0);
    for (int k = 0; k < maps; k++) {
        s_geom(m, k, &a, &d, &h, &w);
        p += h * w * a;
    }
    if (classes_bg)
        *classes_bg = d;
    return p;
}

/* Between output i's head map (n, a * d, h, w) and its rows [off, off + h * w * a) of the
 * prior-major (n, P, d) tensor: gather (src the head, dst the rows) or scatter (src the rows,
 * dst the head). */
static void s_permute(const nn_model *m, int i, int n, int np, int off, const float *src,
                      float *dst, int gather)
{
    int a, d, h, w;
    s_geom(m, i, &a, &d, &h, &w);
    size_t hw = (size_t)h * w;
    for (int s = 0; s < n; s++)
        for (size_t cell = 0; cell < hw; cell++)
            for (int j = 0; j < a * d; j++) {
                size_t hi = ((size_t)s * a * d + j) * hw + cell;
                size_t ri = ((size_t)s * np + off + cell * a) * d + j;
                if (gather)
                    dst[ri] = src[hi];
                else
                    dst[hi] = src[ri];
            }
}

/* Floats of every output for n samples, and output i's offset among them. */
static size_t s_out_offset(const nn_model *m, int i, int n)
{
    size_t off = 0;
    for (int j = 0; j < i; j++) {
        int c, h, w;
        nn_model_output_shape(m, j, &c, &h, &w);
        off += (size_t)n * c * h * w;
    }
    return off;
}

/* Walks the outputs in order: output i's first prior within its map kind. */
static int s_prior_off(const nn_model *m, int i)
{
    int maps = nn_model_outputs(m) / 2, off = 0, a, d, h, w;
    for (int j = i < maps ? 0 : maps; j < i; j++) {
        s_geom(m, j, &a, &d, &h, &w);
        off += h * w * a;
    }
    return off;
}

zps_status nn_ssd_forward(nn_model *m, const float *x, int n, int train, float *cls, float *loc)
{
    ZPS_TRY(nn_model_forward_outputs(m, x, n, train));
    int outs = nn_model_outputs(m), np = nn_ssd_priors(m, NULL);
    float *buf = nn_model_scratch(m, s_out_offset(m, outs, n) * sizeof(float) + 64);
    zps_status st = ZPS_OK;
    for (int i = 0; i < outs && st == ZPS_OK; i++) {
        float *head = buf + s_out_offset(m, i, n);
        st = nn_model_output_read(m, i, head);
        s_permute(m, i, n, np, s_prior_off(m, i), head, i < outs / 2 ? cls : loc, 1);
    }
    return st;
}

zps_status nn_ssd_backward(nn_model *m, const float *dcls, const float *dloc, nn_grad_hook hook,
                           void *ctx)
{
    int outs = nn_model_outputs(m), np = nn_ssd_priors(m, NULL), n, c, h, w;
    float *in;
    if (nn_model_tensor(m, "input", &in, &n, &c, &h, &w) != ZPS_OK || n == 0)
        return ZPS_ERR_INVALID; /* no forward yet */
    float *buf = nn_model_scratch(m, s_out_offset(m, outs, n) * sizeof(float) + 64);
    const float *dys[NN_SSD_MAX_OUTS];
    assert(outs <= NN_SSD_MAX_OUTS);
    for (int i = 0; i < outs; i++) {
        float *head = buf + s_out_offset(m, i, n);
        s_permute(m, i, n, np, s_prior_off(m, i), i < outs / 2 ? dcls : dloc, head, 0);
        dys[i] = head;
    }
    return nn_model_backward_outputs(m, dys, hook, ctx);
}
