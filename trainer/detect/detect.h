/* detect.h — the detection math of the SSD on the host: priors (anchors), box IoU and
 * encoding, matching, the MultiBox loss with hard-negative mining, NMS and VOC mAP@0.5.
 *
 * Plain C on float data, no nn dependency: the ssd model (trainer/models) feeds its head
 * outputs in and injects the gradients det_loss returns. docs/kernels.md ("Detection") says
 * where each rule comes from; tests/test_detect.c checks every piece against torchvision.ops
 * and a float64 reference (tests/ref/detect_ref.py).
 *
 * Conventions:
 *  - Boxes are in corner form (x1, y1, x2, y2), normalised to the canvas ([0, 1]); priors are
 *    in centre form (cx, cy, w, h), normalised. A box with x2 <= x1 or y2 <= y1 is degenerate:
 *    its area is 0 and its IoU with anything is 0 (never NaN).
 *  - Classes: the dataset's labels are 0..C-1; the classifier head has C+1 outputs per prior,
 *    output 0 being the background, output k + 1 the dataset's class k. Detections report the
 *    dataset's class (0..C-1).
 *  - Every tie is broken by the lower index (prior, ground truth, box), so results do not
 *    depend on the sort implementation.
 *  - Nothing here allocates per call on the training path once a det_ws has grown to the
 *    largest call (the first call); det_ws is not thread-safe: one per thread.
 */
#ifndef ZPS_TRAINER_DETECT_DETECT_H
#define ZPS_TRAINER_DETECT_DETECT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* ---- priors -------------------------------------------------------------------------- */

#define DET_MAX_MAPS 8
#define DET_MAX_RATIOS 8

/* The prior set. Map k (0..n_maps-1) has scale s_k = s_min + (s_max - s_min) k / (n_maps - 1)
 * (the SSD paper's linear rule; s_min when n_maps == 1) and, for the last map's extra prior,
 * s_{n_maps} = min(1, s_max + (s_max - s_min) / (n_maps - 1)). Default: 0.2, 0.375, 0.55,
 * 0.725, 0.9, then 1.
 *
 * ORDER of the priors (the model's heads emit in this order; keep it):
 *   maps in cfg order; within a map, cells row-major (y, then x); within a cell:
 *     1. ratio 1 at scale s_k                      (w = h = s_k)
 *     2. ratio 1 at scale sqrt(s_k * s_{k+1})      (the SSD paper's extra square prior)
 *     3. the other ratios a in cfg order           (w = s_k sqrt(a), h = s_k / sqrt(a))
 * so a cell holds n_ratios[k] + 2 priors (ratios[k][] lists every ratio but 1). The centre of
 * cell (x, y) is ((x + 0.5) / size, (y + 0.5) / size); cx, cy, w and h are each clipped to
 * [0, 1] (as ssd.pytorch's PriorBox). */
typedef struct det_prior_cfg {
    int canvas;                                 // input side in pixels (128); for reports
    int n_maps;                                 // feature maps (1..DET_MAX_MAPS)
    int map_size[DET_MAX_MAPS];                 // side of map k in cells (16, 8, 4, 2, 1)
    int n_ratios[DET_MAX_MAPS];                 // ratios of map k other than 1
    float ratios[DET_MAX_MAPS][DET_MAX_RATIOS]; // those ratios (w / h), e.g. 2, 1/2
    float s_min, s_max;                         // scales of the first and last map (0.2, 0.9)
} det_prior_cfg;

/* The default for 128x128 canvases: maps 16, 8, 4, 2, 1; ratios {1, 2, 1/2} on 16, 2 and 1,
 * {1, 2, 3, 1/2, 1/3} on 8 and 4 (4 or 6 priors per cell: 1,524 priors); scales 0.2..0.9
 * (the SSD paper's s_min and s_max). On zps-data's canvases (boxes 0.1-0.5 of the side) they
 * give 97% of the boxes a prior of IoU >= 0.5, against 88% for scales 0.1..0.9, whose 0.1
 * priors on the 16x16 map are smaller than almost every box (docs/kernels.md, Detection). */
void det_prior_cfg_default(det_prior_cfg *c);
/* Priors of the whole set, and per cell of map `map`. */
size_t det_prior_count(const det_prior_cfg *c);
int det_prior_per_cell(const det_prior_cfg *c, int map);
/* out: det_prior_count(c) x 4 (cx, cy, w, h) in the ORDER above. ZPS_ERR_INVALID (logged) for
 * a configuration out of range (maps, sizes, ratios <= 0, scales outside (0, 1]). */
zps_status det_priors(const det_prior_cfg *c, float *out);

/* ---- boxes --------------------------------------------------------------------------- */

/* SSD's encoding variances: centre offsets are divided by 0.1, log size ratios by 0.2. */
#define DET_VAR0 0.1f
#define DET_VAR1 0.2f
/* Box sides below this are raised to it before a log (degenerate boxes stay finite). */
#define DET_MIN_SIDE 1e-6f

/* IoU of two corner-form boxes; 0 when either is degenerate or they do not overlap. */
float det_iou(const float *a, const float *b);
/* out[i * nb + j] = IoU(a[i], b[j]); a: na x 4, b: nb x 4, corner form. */
void det_iou_matrix(const float *a, size_t na, const float *b, size_t nb, float *out);
/* Centre form (cx, cy, w, h) <-> corner form, n boxes; in place allowed (in == out). */
void det_center_to_corner(const float *in, size_t n, float *out);
void det_corner_to_center(const float *in, size_t n, float *out);
/* Offsets of corner-form boxes gt against centre-form priors, n pairs:
 *   ((g_cx - p_cx) / (DET_VAR0 p_w), (g_cy - p_cy) / (DET_VAR0 p_h),
 *    log(g_w / p_w) / DET_VAR1, log(g_h / p_h) / DET_VAR1)
 * (g_w, g_h raised to DET_MIN_SIDE). */
void det_encode(const float *gt, const float *priors, size_t n, float *out);
/* The inverse: offsets loc (n x 4) against priors -> corner-form boxes (not clipped). */
void det_decode(const float *loc, const float *priors, size_t n, float *out);

/* ---- matching and loss --------------------------------------------------------------- */

/* Scratch for det_loss and det_detect: grows to the largest call, then never again. */
typedef struct det_ws det_ws;
det_ws *det_ws_new(void);
void det_ws_destroy(det_ws **pw); // *pw = NULL; safe on NULL
/* Times det_ws asked the system for memory (tests check it stops growing). */
size_t det_ws_grow_count(const det_ws *w);

/* Matches the ngt corner-form boxes gt to the P centre-form priors: match[p] is the index of
 * the gt prior p regresses to, or -1 (background).
 *  1. Forced: gts in index order each take their best prior (highest IoU, lowest prior
 *     index on ties) among the priors no earlier gt has forced (ssd.pytorch lets a later gt
 *     steal an earlier one's; here neither is lost); a gt overlapping no free prior
 *     (degenerate ones included) forces nothing.
 *  2. Every prior not forced whose best IoU (over gts, lowest gt index on ties) is > thresh
 *     takes that gt.
 * iou: scratch of ngt x P floats (left holding the IoU matrix). */
void det_match(const float *priors, size_t P, const float *gt, int ngt, float thresh, float *iou,
               int32_t *match);

typedef struct det_loss_cfg {
    float match_iou;  // a prior matches a gt above this IoU (0.5)
    float neg_pos;    // hard negatives per positive, per image (3)
    float loc_weight; // weight of the smooth-L1 term (1)
    det_ws *ws;       // scratch reused across calls (caller's); NULL: allocated per call
} det_loss_cfg;

/* The loss's two terms, each divided by the matched count: loss = conf + loc_weight * loc. */
typedef struct det_loss_parts {
    float conf;      // cross-entropy over the positives and the mined negatives
    float loc;       // smooth-L1 (beta 1) over the positives' four offsets
    int64_t matched; // positives in the batch (the normaliser)
} det_loss_parts;

void det_loss_cfg_default(det_loss_cfg *c); // 0.5, 3, 1, ws NULL

/* The SSD MultiBox loss of a batch of n images over P priors (centre form), and its gradient.
 *  cls: n x P x classes logits (classes = C + 1, background = 0); loc: n x P x 4 offsets.
 *  Image i's ground truth: gt_boxes[gt_start[i] .. gt_start[i + 1]) (x 4, corner form) with
 *  gt_labels 0..C-1 (mapped to 1..C here); gt_start has n + 1 entries.
 *  Per image: det_match at c->match_iou; positives get cross-entropy against their class and
 *  smooth-L1 on the offsets of their gt (det_encode); the negatives with the highest
 *  background loss (logsumexp - logit_0), at most neg_pos x positives of the image and lowest
 *  prior index on ties, get cross-entropy against the background; other priors contribute
 *  nothing. Both sums are divided by the batch's matched count N. N == 0: *loss = 0 and zero
 *  gradients. d_cls (n x P x classes) and d_loc (n x P x 4) are overwritten with d loss;
 *  either may be NULL (no gradient). parts may be NULL. ZPS_ERR_INVALID (logged) for a gt
 *  label outside 0..classes-2. */
zps_status det_loss(const det_loss_cfg *c, const float *priors, size_t P, int classes,
                    const float *cls, const float *loc, int n, const float *gt_boxes,
                    const int32_t *gt_labels, const int *gt_start, float *loss, float *d_cls,
                    float *d_loc, det_loss_parts *parts);

/* ---- inference ----------------------------------------------------------------------- */

/* Decodes all P priors' offsets (loc: P x 4) into corner-form boxes clipped to [0, 1]. */
void det_decode_all(const float *priors, size_t P, const float *loc, float *out);

/* torchvision.ops.nms: boxes (n x 4, corner form) by score, descending (lower index first on
 * equal scores); a box is dropped when its IoU with a kept box is > iou. keep (n entries,
 * also the scratch) receives the kept indices in that order; returns how many. */
size_t det_nms(const float *boxes, const float *scores, size_t n, float iou, int32_t *keep);
/* torchvision.ops.batched_nms: det_nms within each value of idxs (a box suppresses only
 * boxes of its own idxs); keep in score order over all, as det_nms. */
size_t det_nms_batched(const float *boxes, const float *scores, const int32_t *idxs, size_t n,
                       float iou, int32_t *keep);

typedef struct det_nms_cfg {
    float score_thresh; // class probability a detection must exceed (0.01)
    float nms_iou;      // per-class NMS threshold (0.45)
    int top_k_class;    // candidates per class before NMS (200)
    int top_k;          // detections per image after NMS (100)
} det_nms_cfg;

void det_nms_cfg_default(det_nms_cfg *c);

typedef struct det_det {
    float box[4]; // corner form, clipped to [0, 1]
    int32_t cls;  // the dataset's class, 0..C-1
    float score;  // softmax probability of that class
} det_det;

/* One image's detections: softmax over the classes logits of each prior (cls: P x classes),
 * det_decode_all, then per class c >= 1: the priors with probability > score_thresh, the
 * top_k_class of them by probability (lower prior index on ties), det_nms at nms_iou; then all
 * classes' survivors by score (lower class, then lower prior on ties), at most top_k. out has
 * room for top_k; returns how many it holds. */
size_t det_detect(const det_nms_cfg *c, det_ws *ws, const float *priors, size_t P, int classes,
                  const float *cls, const float *loc, det_det *out);

/* ---- VOC mAP@0.5 --------------------------------------------------------------------- */

/* Accumulates detections and ground truth over a test set, then computes PASCAL VOC's
 * average precision per class (all-point interpolation, VOC2010+) and their mean.
 * A detection is a true positive when its IoU with an unclaimed gt of its class in its
 * image is the highest of that class's gts there and > 0.5 (VOC's rule: strictly above);
 * within an image detections claim gts in score order (lower index on ties). Classes with no
 * gt in the set are left out of the mean (their detections are ignored); a class with gts
 * but no detection has AP 0. This dataset has no "difficult" boxes, so none are ignored.
 * Coordinates are continuous (no VOC "+1" pixel). */
typedef struct det_map det_map;

det_map *det_map_new(int n_classes);
void det_map_destroy(det_map **pm); // *pm = NULL; safe on NULL
/* One image: its detections (classes 0..n_classes-1) and its gts (corner form, labels
 * 0..n_classes-1). ZPS_ERR_INVALID (logged) for a class outside that range. */
zps_status det_map_add(det_map *m, const det_det *dets, size_t nd, const float *gt_boxes,
                       const int32_t *gt_labels, size_t ngt);
/* The mean AP over the classes with gts (0 when none has); ap (n_classes, may be NULL)
 * receives each class's AP, -1 for a class without gts; *counted (may be NULL) the classes
 * in the mean. */
double det_map_compute(const det_map *m, double *ap, int *counted);

#endif
