/* models.c — mlp, convnet and inception_v3 (see models.h). The Inception blocks follow
 * torchvision's InceptionA..E and InceptionAux layer by layer, adding layers in the order
 * torchvision declares them, so the variable table comes out in state_dict order. */
#include "trainer/models/models.h"
#include "trainer/models/ssd.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"

void nn_model_opts_default(nn_model_opts *o, const char *name)
{
    memset(o, 0, sizeof *o);
    o->name = name ? name : "convnet";
    o->classes = 10;
    o->in_channels = 1;
    o->in_size = 28;
    o->width = 1.0f;
    o->aux = -1;
    o->aux_weight = 0.4f;
    o->dropout = 0.25f;
    o->hidden = 256;
    o->seed = 1;
    if (strcmp(o->name, "inception_v3") == 0) {
        o->classes = 1000;
        o->in_channels = 3;
        o->in_size = 299;
        o->dropout = 0.5f;
    }
    if (strcmp(o->name, "ssd") == 0)
        o->in_size = 128;
}

/* ---- Inception-v3 ---- */

typedef struct s_inc {
    nn_model *m;
    float width;
    char block[48]; // current block name ("Mixed_5b")
} s_inc;

static int s_ch(const s_inc *b, int c)
{
    int v = (int)lroundf((float)c * b->width);
    return v < 1 ? 1 : v;
}

/* BasicConv2d named block.branch. */
static int s_bc(s_inc *b, const char *branch, int in, int k, int r, int s, int stride, int ph,
                int pw, float std)
{
    char name[96];
    if (b->block[0])
        snprintf(name, sizeof name, "%s.%s", b->block, branch);
    else
        snprintf(name, sizeof name, "%s", branch);
    return nn_conv_bn_relu(b->m, name, in, s_ch(b, k), r, s, stride, stride, ph, pw, std);
}

static int s_bc1(s_inc *b, const char *br, int in, int k, int r, int stride, int pad)
{
    return s_bc(b, br, in, k, r, r, stride, pad, pad, 0.1f);
}

/* Starts block name: the layers added next are named name.branch, the concat name. */
static void s_block(s_inc *b, const char *name)
{
    snprintf(b->block, sizeof b->block, "%s", name);
}

/* The pool branch of InceptionA, C and E: 3x3 average pool (stride 1), 1x1 BasicConv2d. */
static int s_avg_branch(s_inc *b, int x, int features)
{
    char pn[96];
    snprintf(pn, sizeof pn, "%s.pool", b->block);
    int bp = nn_avgpool(b->m, pn, x, 3, 1, 1);
    return s_bc1(b, "branch_pool", bp, features, 1, 1, 0);
}

/* The pool branch of InceptionB and D: 3x3 max pool, stride 2. */
static int s_max_branch(s_inc *b, int x)
{
    char pn[96];
    snprintf(pn, sizeof pn, "%s.pool", b->block);
    return nn_maxpool(b->m, pn, x, 3, 2, 0);
}

static int s_inception_a(s_inc *b, const char *name, int x, int pool_features)
{
    s_block(b, name);
    int b1 = s_bc1(b, "branch1x1", x, 64, 1, 1, 0);
    int b5 = s_bc1(b, "branch5x5_1", x, 48, 1, 1, 0);
    b5 = s_bc1(b, "branch5x5_2", b5, 64, 5, 1, 2);
    int b3 = s_bc1(b, "branch3x3dbl_1", x, 64, 1, 1, 0);
    b3 = s_bc1(b, "branch3x3dbl_2", b3, 96, 3, 1, 1);
    b3 = s_bc1(b, "branch3x3dbl_3", b3, 96, 3, 1, 1);
    int bp = s_avg_branch(b, x, pool_features);
    return nn_concat(b->m, name, 4, (int[]){b1, b5, b3, bp});
}

static int s_inception_b(s_inc *b, const char *name, int x)
{
    s_block(b, name);
    int b3 = s_bc1(b, "branch3x3", x, 384, 3, 2, 0);
    int bd = s_bc1(b, "branch3x3dbl_1", x, 64, 1, 1, 0);
    bd = s_bc1(b, "branch3x3dbl_2", bd, 96, 3, 1, 1);
    bd = s_bc1(b, "branch3x3dbl_3", bd, 96, 3, 2, 0);
    int bp = s_max_branch(b, x);
    return nn_concat(b->m, name, 3, (int[]){b3, bd, bp});
}

static int s_inception_c(s_inc *b, const char *name, int x, int c7)
{
    s_block(b, name);
    int b1 = s_bc1(b, "branch1x1", x, 192, 1, 1, 0);
    int b7 = s_bc1(b, "branch7x7_1", x, c7, 1, 1, 0);
    b7 = s_bc(b, "branch7x7_2", b7, c7, 1, 7, 1, 0, 3, 0.1f);
    b7 = s_bc(b, "branch7x7_3", b7, 192, 7, 1, 1, 3, 0, 0.1f);
    int bd = s_bc1(b, "branch7x7dbl_1", x, c7, 1, 1, 0);
    bd = s_bc(b, "branch7x7dbl_2", bd, c7, 7, 1, 1, 3, 0, 0.1f);
    bd = s_bc(b, "branch7x7dbl_3", bd, c7, 1, 7, 1, 0, 3, 0.1f);
    bd = s_bc(b, "branch7x7dbl_4", bd, c7, 7, 1, 1, 3, 0, 0.1f);
    bd = s_bc(b, "branch7x7dbl_5", bd, 192, 1, 7, 1, 0, 3, 0.1f);
    int bp = s_avg_branch(b, x, 192);
    return nn_concat(b->m, name, 4, (int[]){b1, b7, bd, bp});
}

static int s_inception_d(s_inc *b, const char *name, int x)
{
    s_block(b, name);
    int b3 = s_bc1(b, "branch3x3_1", x, 192, 1, 1, 0);
    b3 = s_bc1(b, "branch3x3_2", b3, 320, 3, 2, 0);
    int b7 = s_bc1(b, "branch7x7x3_1", x, 192, 1, 1, 0);
    b7 = s_bc(b, "branch7x7x3_2", b7, 192, 1, 7, 1, 0, 3, 0.1f);
    b7 = s_bc(b, "branch7x7x3_3", b7, 192, 7, 1, 1, 3, 0, 0.1f);
    b7 = s_bc1(b, "branch7x7x3_4", b7, 192, 3, 2, 0);
    int bp = s_max_branch(b, x);
    return nn_concat(b->m, name, 3, (int[]){b3, b7, bp});
}

/* InceptionE: the two inner concats are flattened into one (same channel order). */
static int s_inception_e(s_inc *b, const char *name, int x)
{
    s_block(b, name);
    int b1 = s_bc1(b, "branch1x1", x, 320, 1, 1, 0);
    int b3 = s_bc1(b, "branch3x3_1", x, 384, 1, 1, 0);
    int b3a = s_bc(b, "branch3x3_2a", b3, 384, 1, 3, 1, 0, 1, 0.1f);
    int b3b = s_bc(b, "branch3x3_2b", b3, 384, 3, 1, 1, 1, 0, 0.1f);
    int bd = s_bc1(b, "branch3x3dbl_1", x, 448, 1, 1, 0);
    bd = s_bc1(b, "branch3x3dbl_2", bd, 384, 3, 1, 1);
    int bda = s_bc(b, "branch3x3dbl_3a", bd, 384, 1, 3, 1, 0, 1, 0.1f);
    int bdb = s_bc(b, "branch3x3dbl_3b", bd, 384, 3, 1, 1, 1, 0, 0.1f);
    int bp = s_avg_branch(b, x, 192);
    return nn_concat(b->m, name, 6, (int[]){b1, b3a, b3b, bda, bdb, bp});
}

/* torchvision's InceptionAux on x = Mixed_6e, training only; *logits is -1 when it is off.
 * ZPS_ERR_INVALID when asked for where Mixed_6e is too small for its 5x5/3 pool and 5x5
 * conv. */
static zps_status s_aux_head(s_inc *b, const nn_model_opts *o, int x, int *logits)
{
    *logits = -1;
    if (x < 0)
        return ZPS_OK; // a layer call failed; nn_model_finish reports it
    float *d;
    int n, c, h, w;
    nn_model_tensor(b->m, "Mixed_6e", &d, &n, &c, &h, &w);
    int fits = h >= 17 && w >= 17;
    int aux = o->aux < 0 ? fits : o->aux;
    if (aux && !fits) {
        zps_log(ZPS_ERROR, "models", "inception_v3 aux head needs Mixed_6e at least 17x17 "
                "(input 299); it is %dx%d at input %d", h, w, o->in_size);
        return ZPS_ERR_INVALID;
    }
    if (!aux)
        return ZPS_OK;
    nn_model_train_only(b->m, 1);
    s_block(b, "AuxLogits");
    int a = nn_avgpool(b->m, "AuxLogits.pool", x, 5, 3, 0);
    a = s_bc(b, "conv0", a, 128, 1, 1, 1, 0, 0, 0.1f);
    a = s_bc(b, "conv1", a, 768, 5, 5, 1, 0, 0, 0.01f);
    a = nn_gap(b->m, "AuxLogits.gap", a);
    *logits = nn_dense(b->m, "AuxLogits.fc", a, o->classes, 0, 0.001f);
    nn_model_train_only(b->m, 0);
    return ZPS_OK;
}

static zps_status s_finish(nn_model *m, const nn_model_opts *o, nn_model **out)
{
    zps_status st = nn_model_finish(m, o->seed);
    if (st != ZPS_OK) {
        nn_model_destroy(&m);
        return st;
    }
    *out = m;
    return ZPS_OK;
}

static zps_status s_inception_v3(const k_backend *be, const nn_model_opts *o, nn_model **out)
{
    if (o->in_size < 75) {
        zps_log(ZPS_ERROR, "models", "inception_v3 needs inputs of at least 75x75 (got %d)",
                o->in_size);
        return ZPS_ERR_INVALID;
    }
    nn_model *m = nn_model_new(be, o->in_channels, o->in_size, o->in_size);
    s_inc b = {.m = m, .width = o->width > 0 ? o->width : 1.0f};
    int x = 0;
    x = s_bc(&b, "Conv2d_1a_3x3", x, 32, 3, 3, 2, 0, 0, 0.1f);
    x = s_bc(&b, "Conv2d_2a_3x3", x, 32, 3, 3, 1, 0, 0, 0.1f);
    x = s_bc(&b, "Conv2d_2b_3x3", x, 64, 3, 3, 1, 1, 1, 0.1f);
    x = nn_maxpool(m, "maxpool1", x, 3, 2, 0);
    x = s_bc(&b, "Conv2d_3b_1x1", x, 80, 1, 1, 1, 0, 0, 0.1f);
    x = s_bc(&b, "Conv2d_4a_3x3", x, 192, 3, 3, 1, 0, 0, 0.1f);
    x = nn_maxpool(m, "maxpool2", x, 3, 2, 0);
    x = s_inception_a(&b, "Mixed_5b", x, 32);
    x = s_inception_a(&b, "Mixed_5c", x, 64);
    x = s_inception_a(&b, "Mixed_5d", x, 64);
    x = s_inception_b(&b, "Mixed_6a", x);
    x = s_inception_c(&b, "Mixed_6b", x, 128);
    x = s_inception_c(&b, "Mixed_6c", x, 160);
    x = s_inception_c(&b, "Mixed_6d", x, 160);
    x = s_inception_c(&b, "Mixed_6e", x, 192);
    int aux_logits;
    zps_status st = s_aux_head(&b, o, x, &aux_logits);
    if (st != ZPS_OK) {
        nn_model_destroy(&m);
        return st;
    }
    x = s_inception_d(&b, "Mixed_7a", x);
    x = s_inception_e(&b, "Mixed_7b", x);
    x = s_inception_e(&b, "Mixed_7c", x);
    x = nn_gap(m, "avgpool", x);
    x = nn_dropout(m, "dropout", x, o->dropout);
    x = nn_dense(m, "fc", x, o->classes, 0, 0.1f);
    nn_model_head(m, x, 1.0f);
    if (aux_logits >= 0)
        nn_model_head(m, aux_logits, o->aux_weight);
    return s_finish(m, o, out);
}

zps_status nn_model_create(const k_backend *be, const nn_model_opts *o, nn_model **out)
{
    *out = NULL;
    if (o->classes < 1 || o->in_channels < 1 || o->in_size < 1) {
        zps_log(ZPS_ERROR, "models", "%s: classes, channels and size must be positive", o->name);
        return ZPS_ERR_INVALID;
    }
    if (strcmp(o->name, "inception_v3") == 0)
        return s_inception_v3(be, o, out);
    if (strcmp(o->name, "ssd") == 0)
        return nn_ssd_create(be, o, out);
    nn_model *m = nn_model_new(be, o->in_channels, o->in_size, o->in_size);
    if (strcmp(o->name, "mlp") == 0) {
        int in = o->in_channels * o->in_size * o->in_size;
        int x = nn_dense(m, "fc1", 0, o->hidden, 1, (float)sqrt(2.0 / in));
        x = nn_dense(m, "fc2", x, o->hidden, 1, (float)sqrt(2.0 / o->hidden));
        x = nn_dense(m, "fc3", x, o->classes, 0, (float)sqrt(1.0 / o->hidden));
        nn_model_head(m, x, 1.0f);
        return s_finish(m, o, out);
    }
    if (strcmp(o->name, "convnet") == 0) {
        int x = nn_conv_bn_relu(m, "conv1", 0, 32, 3, 3, 1, 1, 1, 1,
                                (float)sqrt(2.0 / (9.0 * o->in_channels)));
        x = nn_maxpool(m, "pool1", x, 2, 2, 0);
        x = nn_conv_bn_relu(m, "conv2", x, 64, 3, 3, 1, 1, 1, 1, (float)sqrt(2.0 / (9.0 * 32)));
        x = nn_maxpool(m, "pool2", x, 2, 2, 0);
        int q = o->in_size / 4;
        x = nn_dense(m, "fc1", x, 128, 1, (float)sqrt(2.0 / (64.0 * q * q)));
        x = nn_dropout(m, "dropout", x, o->dropout);
        x = nn_dense(m, "fc2", x, o->classes, 0, (float)sqrt(1.0 / 128));
        nn_model_head(m, x, 1.0f);
        return s_finish(m, o, out);
    }
    zps_log(ZPS_ERROR, "models", "unknown model '%s' (mlp, convnet, inception_v3, ssd)", o->name);
    nn_model_destroy(&m);
    return ZPS_ERR_INVALID;
}
