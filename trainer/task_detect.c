/* task_detect.c — the detector's task (task.h) for the ssd model: the heads' outputs come
 * out of nn in trainer/detect's prior order (nn_ssd_forward), the MultiBox loss and its
 * gradient are det_loss's, and the gradient goes back in through nn_ssd_backward, whose hook
 * is nn's, so the PS back-ends push each layer's gradients as backward produces them.
 *
 * The step record carries the loss's parts (conf, loc: each the mean over the step's
 * micro-batches of the batch's sum divided by its matched count; matched: the step's total).
 * The score is VOC mAP@0.5 over the evaluation set: det_detect per image (softmax, decode,
 * per-class NMS at 0.45), det_map over the set (docs/kernels.md, "Detection").
 *
 * Invariants: the priors are those of det_prior_cfg_default with the map sizes the model's
 * heads have (their count checked against the model's at creation); every buffer (heads'
 * outputs, their gradients, ground truth, detections, det_ws) is sized at creation for the
 * training batch or grows to its high-water mark, so steps and evaluations allocate nothing
 * once the first has run.
 */
#include "trainer/task.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/draw.h"
#include "trainer/detect/detect.h"
#include "trainer/models/ssd.h"

typedef struct s_det {
    tr_task base;
    nn_model *m;         // borrowed
    int classes;         // the dataset's, C (the head has C + 1)
    size_t P;            // priors
    float *priors;       // (P, 4) centre form, the heads' order
    int cap;             // images the buffers below hold (the training batch)
    float *cls, *loc;    // (cap, P, C + 1), (cap, P, 4) the last forward's outputs
    float *dcls, *dloc;  // the same shapes: the loss's gradient
    float *gt;           // (gt_cap, 4) corner boxes of a batch
    int32_t *gt_label;   // (gt_cap)
    int *gt_start;       // (cap + 1) image k's boxes in gt, from 0
    int gt_cap;
    det_det *dets;       // (top_k) one image's detections
    det_ws *ws;          // det_loss and det_detect scratch
    det_loss_cfg lc;
    det_nms_cfg nc;
    /* the step so far */
    double conf, locl;   // sums of the micro-batches' parts
    int64_t matched;
} s_det;

/* The batch's ground truth into the task's arrays (image-relative starts from 0). */
static void s_gt(s_det *d, const tr_task_batch *b)
{
    int base = b->box_start[0], total = b->box_start[b->n] - base;
    if (total > d->gt_cap) { /* grows to the largest batch's box count, then never again */
        d->gt_cap = total + total / 2 + 8;
        d->gt = zps_xrealloc(d->gt, (size_t)d->gt_cap * 4 * sizeof *d->gt);
        d->gt_label = zps_xrealloc(d->gt_label, (size_t)d->gt_cap * sizeof *d->gt_label);
    }
    for (int k = 0; k <= b->n; k++)
        d->gt_start[k] = b->box_start[k] - base;
    for (int i = 0; i < total; i++) {
        const ds_box *x = &b->boxes[base + i];
        float *g = d->gt + (size_t)i * 4;
        g[0] = x->xmin, g[1] = x->ymin, g[2] = x->xmax, g[3] = x->ymax;
        d->gt_label[i] = x->label;
    }
}

/* The loss of the last forward's n images against b's boxes; gradients when train. */
static zps_status s_loss(s_det *d, const tr_task_batch *b, int train, float *loss,
                         det_loss_parts *parts)
{
    s_gt(d, b);
    return det_loss(&d->lc, d->priors, d->P, d->classes + 1, d->cls, d->loc, b->n, d->gt,
                    d->gt_label, d->gt_start, loss, train ? d->dcls : NULL,
                    train ? d->dloc : NULL, parts);
}

static zps_status s_forward(tr_task *t, const tr_task_batch *b, float *loss)
{
    s_det *d = (s_det *)t;
    assert(b->n <= d->cap);
    ZPS_TRY(nn_ssd_forward(d->m, b->x, b->n, 1, d->cls, d->loc));
    det_loss_parts parts;
    ZPS_TRY(s_loss(d, b, 1, loss, &parts));
    d->conf += parts.conf;
    d->locl += parts.loc;
    d->matched += parts.matched;
    return ZPS_OK;
}

static zps_status s_backward(tr_task *t, nn_grad_hook hook, void *ctx)
{
    s_det *d = (s_det *)t;
    return nn_ssd_backward(d->m, d->dcls, d->dloc, hook, ctx);
}

static void s_record(tr_task *t, tr_step_record *rec, int k)
{
    s_det *d = (s_det *)t;
    rec->loss_conf = d->conf / k;
    rec->loss_loc = d->locl / k;
    rec->matched = d->matched;
    d->conf = d->locl = 0;
    d->matched = 0;
}

/* Image i of the last forward's detections into d->dets; returns how many. */
static size_t s_detect(s_det *d, int i)
{
    size_t C1 = (size_t)d->classes + 1;
    return det_detect(&d->nc, d->ws, d->priors, d->P, (int)C1, d->cls + (size_t)i * d->P * C1,
                      d->loc + (size_t)i * d->P * 4, d->dets);
}

/* The evaluation set's images [off, off + n) as a batch. */
static tr_task_batch s_slice(const s_det *d, const tr_task_batch *set, int off, int n)
{
    int c, h, w;
    nn_model_input_shape(d->m, &c, &h, &w);
    return (tr_task_batch){.x = set->x + (size_t)off * c * h * w, .labels = set->labels + off,
                           .boxes = set->boxes, .box_start = set->box_start + off, .n = n};
}

static zps_status s_evaluate(tr_task *t, const tr_task_batch *set, double *score, double *loss)
{
    s_det *d = (s_det *)t;
    det_map *map = det_map_new(d->classes);
    double lsum = 0;
    zps_status st = ZPS_OK;
    for (int off = 0; off < set->n && st == ZPS_OK; off += d->cap) {
        int n = set->n - off < d->cap ? set->n - off : d->cap;
        tr_task_batch b = s_slice(d, set, off, n);
        st = nn_ssd_forward(d->m, b.x, n, 0, d->cls, d->loc);
        float l = 0;
        if (st == ZPS_OK)
            st = s_loss(d, &b, 0, &l, NULL);
        lsum += (double)l * n;
        for (int i = 0; i < n && st == ZPS_OK; i++) {
            size_t nd = s_detect(d, i);
            st = det_map_add(map, d->dets, nd, d->gt + (size_t)d->gt_start[i] * 4,
                             d->gt_label + d->gt_start[i],
                             (size_t)(d->gt_start[i + 1] - d->gt_start[i]));
        }
    }
    *score = st == ZPS_OK ? det_map_compute(map, NULL, NULL) : 0;
    *loss = set->n ? lsum / set->n : 0;
    det_map_destroy(&map);
    return st;
}

static zps_status s_dump(tr_task *t, const tr_task_batch *set, int k, const char *data,
                         uint64_t record, const char *path)
{
    s_det *d = (s_det *)t;
    tr_task_batch b = s_slice(d, set, k, 1);
    ZPS_TRY(nn_ssd_forward(d->m, b.x, 1, 0, d->cls, d->loc));
    size_t nd = s_detect(d, 0);
    ds_canvas c;
    ZPS_TRY(ds_canvas_read(data, "test", record, &c));
    for (int i = 0; i < c.n_boxes; i++)
        ds_canvas_box(&c, c.boxes[i].xmin, c.boxes[i].ymin, c.boxes[i].xmax, c.boxes[i].ymax,
                      ds_draw_red);
    /* what a person would call a detection: the confident ones */
    size_t shown = 0;
    for (size_t i = 0; i < nd; i++)
        if (d->dets[i].score >= 0.5f) {
            const float *x = d->dets[i].box;
            ds_canvas_box(&c, x[0], x[1], x[2], x[3], ds_draw_green);
            shown++;
        }
    zps_status st = ds_canvas_write_png(&c, path);
    if (st == ZPS_OK)
        zps_log(ZPS_INFO, "trainer", "wrote %s: test record %llu, %d true boxes (red), %zu "
                "detections of score >= 0.5 (green)", path, (unsigned long long)record,
                c.n_boxes, shown);
    ds_canvas_free(&c);
    return st;
}

static void s_destroy(tr_task *t)
{
    s_det *d = (s_det *)t;
    free(d->priors);
    zps_aligned_free(d->cls);
    zps_aligned_free(d->loc);
    zps_aligned_free(d->dcls);
    zps_aligned_free(d->dloc);
    free(d->gt);
    free(d->gt_label);
    free(d->gt_start);
    free(d->dets);
    det_ws_destroy(&d->ws);
    free(d);
}

/* The default priors on the model's map sizes; ZPS_ERR_INVALID when their count is not the
 * model's (a model whose heads do not follow trainer/detect's default). */
static zps_status s_priors(s_det *d)
{
    det_prior_cfg pc;
    det_prior_cfg_default(&pc);
    int c, h, w, classes_bg;
    nn_model_input_shape(d->m, &c, &h, &w);
    pc.canvas = h;
    int outs = nn_model_outputs(d->m);
    if (outs / 2 != pc.n_maps) {
        zps_log(ZPS_ERROR, "trainer", "the detector has %d maps, the priors %d", outs / 2,
                pc.n_maps);
        return ZPS_ERR_INVALID;
    }
    for (int k = 0; k < pc.n_maps; k++) {
        nn_model_output_shape(d->m, k, &c, &h, &w);
        pc.map_size[k] = h;
    }
    d->P = det_prior_count(&pc);
    int np = nn_ssd_priors(d->m, &classes_bg);
    if ((size_t)np != d->P || classes_bg != d->classes + 1) {
        zps_log(ZPS_ERROR, "trainer", "the detector's heads give %d priors of %d classes; "
                "the default priors are %zu, the dataset has %d classes (+ background)",
                np, classes_bg, d->P, d->classes);
        return ZPS_ERR_INVALID;
    }
    d->priors = zps_xmalloc(d->P * 4 * sizeof *d->priors);
    return det_priors(&pc, d->priors);
}

zps_status tr_task_detect_new(nn_model *m, int batch, int classes, tr_task **out)
{
    *out = NULL;
    s_det *d = zps_xcalloc(1, sizeof *d);
    d->m = m;
    d->classes = classes;
    d->base = (tr_task){.score_name = "map", .eval_batch = batch, .forward = s_forward,
                        .backward = s_backward, .record = s_record, .evaluate = s_evaluate,
                        .dump = s_dump, .destroy = s_destroy};
    zps_status st = s_priors(d);
    if (st != ZPS_OK) {
        s_destroy(&d->base);
        return st;
    }
    d->cap = batch;
    size_t np = (size_t)batch * d->P;
    d->cls = zps_xaligned(64, np * (size_t)(classes + 1) * sizeof(float));
    d->dcls = zps_xaligned(64, np * (size_t)(classes + 1) * sizeof(float));
    d->loc = zps_xaligned(64, np * 4 * sizeof(float));
    d->dloc = zps_xaligned(64, np * 4 * sizeof(float));
    d->gt_start = zps_xcalloc((size_t)batch + 1, sizeof *d->gt_start);
    d->ws = det_ws_new();
    det_loss_cfg_default(&d->lc);
    d->lc.ws = d->ws;
    det_nms_cfg_default(&d->nc);
    d->dets = zps_xcalloc((size_t)d->nc.top_k, sizeof *d->dets);
    *out = &d->base;
    return ZPS_OK;
}
