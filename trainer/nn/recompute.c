/* recompute.c — gradient checkpointing (nn_model_set_recompute): which activations a training
 * forward keeps, and the backward that recomputes the rest one segment at a time.
 *
 * The nodes are cut into consecutive segments, at points where exactly one tensor is live
 * (read later than it was made): after a concat in Inception-v3, after any layer of a chain,
 * but never between a conv+bn node and the max pool it runs fused (memplan.c's s_fuse).
 * Cuts are chosen greedily for about sqrt(nodes) segments of equal activation size (Chen et
 * al., "Training deep nets with sublinear memory cost", 2016). A tensor read outside the
 * segment that made it, the input, the loss heads' logits and the marked outputs are kept
 * ("persistent"); every other activation and every conv+bn node's pre-batchnorm map is local
 * to its segment and lives in one region that all segments share (memplan.c places it).
 *
 * Backward (nn.c) walks the segments last first: a segment's forward runs again (in training
 * mode, from its persistent inputs, with the same dropout seeds), then its nodes' backward.
 * The last segment is not run again: its region still holds the forward's values.
 *
 * Invariants:
 *   - the rerun computes exactly what the forward did: the same ops on the same inputs and
 *     values. Nothing has changed the values by then, because a node's variables are reported
 *     to the gradient hooks only after its own backward, and the segment rerun holds no node
 *     that was reported. So on a deterministic back-end the gradients are bit-identical to a
 *     run without recompute (tests/test_nn_recompute.c);
 *   - the rerun updates no running statistic: batchnorm writes its running mean and variance
 *     into the scratch tmp_stats instead (the forward already updated them once), and no
 *     forward hook is called (the values are in place);
 *   - after a training forward with recompute, only persistent tensors hold their values
 *     (nn_model_tensor says so for the others).
 */
#include <math.h>
#include <stdlib.h>

#include "common/check.h"
#include "common/log.h"
#include "trainer/nn/nn_int.h"

/* Floats a node's forward leaves behind: its output, and a conv+bn node's pre-batchnorm map. */
static size_t s_node_floats(const nn_model *m, const nn_node *nd, int n)
{
    size_t f = nn_tensor_floats(m, nd->out, n);
    return nd->kind == NN_CONV_BN ? 2 * f : f;
}

void nn_segments(nn_model *m, int n)
{
    int *last = zps_xcalloc((size_t)m->nt, sizeof *last); // last reader (nn: kept to the end)
    int *made = zps_xcalloc((size_t)m->nt, sizeof *made); // producer + 1 (0: the input)
    for (int i = 0; i < m->nn; i++) {
        made[m->nodes[i].out] = i + 1;
        for (int j = 0; j < m->nodes[i].nin; j++)
            last[m->nodes[i].in[j]] = i;
    }
    for (int h = 0; h < m->nheads; h++)
        last[m->heads[h].t] = m->nn;
    for (int h = 0; h < m->nouts; h++)
        last[m->outs[h]] = m->nn;
    size_t total = 0;
    for (int i = 0; i < m->nn; i++)
        total += s_node_floats(m, &m->nodes[i], n);
    double budget = (double)total / ceil(sqrt((double)m->nn));
    /* walk the nodes: cut after node i where one tensor is live and the segment is full */
    m->nseg = 1;
    size_t acc = 0;
    for (int i = 0; i < m->nn; i++) {
        m->nodes[i].seg = m->nseg - 1;
        acc += s_node_floats(m, &m->nodes[i], n);
        int live = 0;
        for (int t = 0; t < m->nt && live < 2; t++)
            live += made[t] <= i + 1 && last[t] > i;
        /* a fused conv+bn node writes its pool's output: the two stay together */
        if (live == 1 && i + 1 < m->nn && (double)acc >= budget && m->nodes[i].fuse <= 0) {
            m->nseg++;
            acc = 0;
        }
    }
    /* local: made by a node and read (if at all) only inside that node's segment; segments
     * follow node order, so its last reader decides */
    for (int t = 0; t < m->nt; t++) {
        int p = made[t] - 1;
        m->t[t].local = p >= 0 && last[t] < m->nn &&
                        (last[t] <= p || m->nodes[last[t]].seg == m->nodes[p].seg);
    }
    free(last);
    free(made);
}

void nn_segments_clear(nn_model *m)
{
    m->nseg = 1;
    for (int i = 0; i < m->nn; i++)
        m->nodes[i].seg = 0;
    for (int t = 0; t < m->nt; t++)
        m->t[t].local = 0;
}

void nn_model_set_recompute(nn_model *m, int on)
{
    if (m->recompute != !!on)
        m->plan_n = 0; /* the next forward re-plans */
    m->recompute = !!on;
}

int nn_model_segments(const nn_model *m) { return m->plan_n ? m->nseg : 0; }

/* Segment s's forward again, in training mode, without hooks or running statistics. A node
 * whose output is kept (the segment's boundary, a concat for Inception's blocks) has it
 * still, and runs again only for what it holds besides (conv+bn's local pre-batchnorm map). */
static zps_status s_rerun(nn_model *m, int s)
{
    m->recomputing = 1;
    zps_status st = ZPS_OK;
    for (int i = 0; i < m->nn && st == ZPS_OK; i++) {
        nn_node *nd = &m->nodes[i];
        if (nd->seg == s && (m->t[nd->out].local || nd->kind == NN_CONV_BN))
            st = nn_node_fwd(m, nd, 1);
    }
    m->recomputing = 0;
    if (st != ZPS_OK)
        zps_log(ZPS_ERROR, "nn", "recomputing segment %d of %d failed: %s", s + 1, m->nseg,
                zps_strerror(st));
    return st;
}

zps_status nn_backward_segments(nn_model *m, nn_grad_hook hook, void *ctx)
{
    int i = m->nn - 1;
    for (int s = m->nseg - 1; s >= 0; s--) {
        if (s < m->nseg - 1)
            ZPS_TRY(s_rerun(m, s));
        for (; i >= 0 && m->nodes[i].seg == s; i--)
            ZPS_TRY(nn_node_backward(m, &m->nodes[i], hook, ctx));
    }
    return ZPS_OK;
}
