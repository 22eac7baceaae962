/* task_classify.c — the classifier's task (task.h): nn's softmax head computes the loss, the
 * step record carries the training batches' accuracy, the score is test accuracy. A thin
 * layer over nn_model_forward / nn_model_backward / nn_model_eval: the classifier's step is
 * what it was before tasks existed, one indirect call more. */
#include "trainer/task.h"

#include <stdlib.h>

#include "common/check.h"
#include "common/mem.h"

typedef struct s_cls {
    tr_task base;
    nn_model *m;     // borrowed
    int64_t correct; // right answers of the step's micro-batches so far
    int64_t images;  // their images
} s_cls;

static zps_status s_forward(tr_task *t, const tr_task_batch *b, float *loss)
{
    s_cls *c = (s_cls *)t;
    int cor;
    ZPS_TRY(nn_model_forward(c->m, b->x, b->labels, b->n, 1, loss, &cor));
    c->correct += cor;
    c->images += b->n;
    return ZPS_OK;
}

static zps_status s_backward(tr_task *t, nn_grad_hook hook, void *ctx)
{
    return nn_model_backward(((s_cls *)t)->m, hook, ctx);
}

static void s_record(tr_task *t, tr_step_record *rec, int k)
{
    (void)k;
    s_cls *c = (s_cls *)t;
    rec->train_accuracy = c->images ? (double)c->correct / (double)c->images : -1;
    c->correct = c->images = 0;
}

static zps_status s_evaluate(tr_task *t, const tr_task_batch *set, double *score, double *loss)
{
    s_cls *c = (s_cls *)t;
    int ch, h, w;
    nn_model_input_shape(c->m, &ch, &h, &w);
    size_t sample = (size_t)ch * h * w;
    int64_t correct = 0;
    double lsum = 0;
    for (int off = 0; off < set->n; off += t->eval_batch) {
        int n = set->n - off < t->eval_batch ? set->n - off : t->eval_batch;
        float l;
        int cor;
        ZPS_TRY(nn_model_eval(c->m, set->x + (size_t)off * sample, set->labels + off, n, &l,
                              &cor));
        correct += cor;
        lsum += (double)l * n;
    }
    *score = set->n ? (double)correct / set->n : 0;
    *loss = set->n ? lsum / set->n : 0;
    return ZPS_OK;
}

static void s_destroy(tr_task *t) { free(t); }

zps_status tr_task_classify_new(nn_model *m, int batch, tr_task **out)
{
    s_cls *c = zps_xcalloc(1, sizeof *c);
    c->m = m;
    /* On a host back-end 256 rows per forward (on the 2-core machine, 2048 test images of
     * the demo's Inception took 0.5 s in forwards of 256 and 1.35 s in forwards of 32, more
     * than the two re-plans of an evaluation cost); on a device the training batch, whose
     * plan the evaluation then runs on (no memory freed and taken again, no plan of 256
     * rows at 299x299 beside the model). Never fewer than the training batch. */
    int host = nn_model_backend(m)->host_memory;
    c->base = (tr_task){.score_name = "accuracy", .eval_batch = host && batch < 256 ? 256 : batch,
                        .forward = s_forward, .backward = s_backward, .record = s_record,
                        .evaluate = s_evaluate, .destroy = s_destroy};
    *out = &c->base;
    return ZPS_OK;
}
