#!/usr/bin/python3
"""detect_ref.py — the oracle of tests/test_detect.c: SSD priors, IoU, encoding, matching, the
MultiBox loss and its gradient, NMS, per-image detection and VOC mAP@0.5, written from the
papers and torchvision.ops, independently of trainer/detect (detection takes zps's decoded
boxes, checked on their own by the encode command).

    detect_ref.py CMD DIR [ARGS...]

Inputs are raw little-endian float32 / int32 files in DIR written by the C test; outputs are
float64 files in DIR. IoU comes from torchvision.ops.box_iou (NaN of 0/0 -> 0) except in
matching, which recomputes it in float32 with the same formula so argmax ties and the 0.5
threshold compare bit for bit; everything else is float64 (the loss's gradient by autograd).
NMS is torchvision.ops.nms / batched_nms; mAP follows the VOC devkit (global sort of each
class's detections, greedy claim of the best-overlap gt, all-point interpolation).
"""
import math
import os
import sys

import numpy as np
import torch
import torchvision

torch.set_default_dtype(torch.float64)


def rd(d, name, dtype, shape):
    a = np.fromfile(os.path.join(d, name), dtype=dtype)
    return a.reshape(shape)


def wr(d, name, arr):
    np.asarray(arr, dtype=np.float64).ravel().tofile(os.path.join(d, name))


# ---- priors: the SSD paper's rule, zps's default set --------------------------------------
def priors_default():
    maps = [16, 8, 4, 2, 1]
    ratios = {16: [2, 0.5], 8: [2, 3, 0.5, 1 / 3], 4: [2, 3, 0.5, 1 / 3], 2: [2, 0.5], 1: [2, 0.5]}
    m = len(maps)
    s = [0.2 + (0.9 - 0.2) * k / (m - 1) for k in range(m)] + [1.0]
    out = []
    for k, f in enumerate(maps):
        for y in range(f):
            for x in range(f):
                cx, cy = (x + 0.5) / f, (y + 0.5) / f
                sizes = [(s[k], s[k]), (math.sqrt(s[k] * s[k + 1]),) * 2]
                sizes += [(s[k] * math.sqrt(a), s[k] / math.sqrt(a)) for a in ratios[f]]
                for w, h in sizes:
                    out.append([cx, cy, w, h])
    return np.clip(np.array(out), 0, 1)


def cmd_priors(d):
    wr(d, "priors.f64", priors_default())


# ---- boxes ---------------------------------------------------------------------------------
def iou_tv(a, b):
    r = torchvision.ops.box_iou(torch.from_numpy(a).double(), torch.from_numpy(b).double())
    return torch.nan_to_num(r, nan=0.0).numpy()


def cmd_iou(d, na, nb):
    a = rd(d, "a.f32", np.float32, (int(na), 4))
    b = rd(d, "b.f32", np.float32, (int(nb), 4))
    wr(d, "iou.f64", iou_tv(a, b))


def encode(g, p):
    """g: corner boxes, p: centre priors (float64)."""
    gw = np.maximum(g[:, 2] - g[:, 0], 1e-6)
    gh = np.maximum(g[:, 3] - g[:, 1], 1e-6)
    gcx, gcy = (g[:, 0] + g[:, 2]) / 2, (g[:, 1] + g[:, 3]) / 2
    return np.stack([(gcx - p[:, 0]) / (0.1 * p[:, 2]), (gcy - p[:, 1]) / (0.1 * p[:, 3]),
                     np.log(gw / p[:, 2]) / 0.2, np.log(gh / p[:, 3]) / 0.2], 1)


def decode(loc, p):
    cx = p[:, 0] + loc[:, 0] * 0.1 * p[:, 2]
    cy = p[:, 1] + loc[:, 1] * 0.1 * p[:, 3]
    w = p[:, 2] * np.exp(loc[:, 2] * 0.2)
    h = p[:, 3] * np.exp(loc[:, 3] * 0.2)
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def cmd_encode(d, n):
    n = int(n)
    g = rd(d, "gt.f32", np.float32, (n, 4)).astype(np.float64)
    p = rd(d, "priors.f32", np.float32, (n, 4)).astype(np.float64)
    loc = rd(d, "loc.f32", np.float32, (n, 4)).astype(np.float64)
    wr(d, "enc.f64", encode(g, p))
    wr(d, "dec.f64", decode(loc, p))


# ---- NMS -----------------------------------------------------------------------------------
def cmd_nms(d, n, thr):
    n, thr = int(n), float(thr)
    b = torch.from_numpy(rd(d, "boxes.f32", np.float32, (n, 4)).copy())
    s = torch.from_numpy(rd(d, "scores.f32", np.float32, (n,)).copy())
    i = torch.from_numpy(rd(d, "idxs.i32", np.int32, (n,)).astype(np.int64))
    # per class on the boxes as they are, merged by score: batched_nms's coordinate-offset
    # trick (under 4000 numbers) rounds the shifted boxes, moving IoUs by ~1e-6, which flipped
    # pairs at the threshold against zps (about 1 draw in 2000)
    kept = [torch.nonzero(i == c).flatten()[torchvision.ops.nms(b[i == c], s[i == c], thr)]
            for c in torch.unique(i)]
    kept = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)
    bkeep = torch.tensor(sorted(kept.tolist(), key=lambda k: (-float(s[k]), k)),
                         dtype=torch.int64)
    for name, keep in (("keep.f64", torchvision.ops.nms(b, s, thr)), ("bkeep.f64", bkeep)):
        out = np.full(n + 1, -1.0)
        out[0] = len(keep)
        out[1:1 + len(keep)] = keep.numpy()
        wr(d, name, out)


# ---- matching ------------------------------------------------------------------------------
def iou32(g, pc):
    """IoU of corner gts g (G, 4) with centre priors pc (P, 4), float32, degenerate -> 0."""
    g = g.astype(np.float32)
    hw, hh = pc[:, 2] / np.float32(2), pc[:, 3] / np.float32(2)
    p = np.stack([pc[:, 0] - hw, pc[:, 1] - hh, pc[:, 0] + hw, pc[:, 1] + hh], 1)
    out = np.zeros((len(g), len(p)), np.float32)
    pw, ph = p[:, 2] - p[:, 0], p[:, 3] - p[:, 1]
    pa = np.where((pw > 0) & (ph > 0), pw * ph, np.float32(0))
    for j, b in enumerate(g):
        bw, bh = b[2] - b[0], b[3] - b[1]
        if not (bw > 0 and bh > 0):
            continue
        ba = bw * bh
        iw = np.minimum(b[2], p[:, 2]) - np.maximum(b[0], p[:, 0])
        ih = np.minimum(b[3], p[:, 3]) - np.maximum(b[1], p[:, 1])
        inter = iw * ih
        ok = (iw > 0) & (ih > 0) & (pa > 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            v = inter / (ba + pa - inter)
        out[j] = np.where(ok, v, np.float32(0))
    return out


def match(pc, g, thr):
    P = len(pc)
    m = np.full(P, -1, np.int64)
    if len(g) == 0:
        return m
    ov = iou32(g, pc)
    for j in range(len(g)):  # forced, in gt order, among priors not yet forced
        row = np.where(m < 0, ov[j], np.float32(-1))
        best = int(np.argmax(row))  # first maximum
        if row[best] > 0:
            m[best] = j
    free = m < 0
    bj = np.argmax(ov, 0)
    bv = ov[bj, np.arange(P)]
    take = free & (bv > np.float32(thr))
    m[take] = bj[take]
    return m


def cmd_match(d, P, ngt, thr):
    P, ngt = int(P), int(ngt)
    pc = rd(d, "priors.f32", np.float32, (P, 4))
    g = rd(d, "gt.f32", np.float32, (ngt, 4))
    wr(d, "match.f64", match(pc, g, float(thr)))


# ---- loss ----------------------------------------------------------------------------------
def image_loss(pc, cls, loc, g, lab, thr, negpos):
    """Sums (conf, loc) and the positive count of one image (torch tensors with grad)."""
    m = match(pc, g, thr)
    pos = torch.from_numpy(m >= 0)
    npos = int(pos.sum())
    P = len(pc)
    tgt = torch.zeros(P, dtype=torch.long)
    tgt[pos] = torch.from_numpy(lab[m[m >= 0]].astype(np.int64) + 1)
    ce = torch.nn.functional.cross_entropy(cls, tgt, reduction="none")
    bg = (torch.logsumexp(cls, 1) - cls[:, 0]).detach().numpy()
    neg_idx = np.nonzero(m < 0)[0]
    nneg = min(int(math.floor(negpos * npos)), P - npos)
    order = neg_idx[np.argsort(-bg[neg_idx], kind="stable")][:nneg]
    conf = ce[pos].sum() + ce[torch.from_numpy(order)].sum()
    if npos == 0:
        return conf * 0, loc.sum() * 0, 0
    t = torch.from_numpy(encode(g[m[m >= 0]].astype(np.float64), pc[m >= 0].astype(np.float64)))
    lsum = torch.nn.functional.smooth_l1_loss(loc[pos], t, reduction="sum", beta=1.0)
    return conf, lsum, npos


def cmd_loss(d, P, classes, n, ngt, thr, negpos, w):
    P, classes, n, ngt = int(P), int(classes), int(n), int(ngt)
    pc = rd(d, "priors.f32", np.float32, (P, 4))
    cls = torch.from_numpy(rd(d, "cls.f32", np.float32, (n, P, classes)).astype(np.float64))
    loc = torch.from_numpy(rd(d, "loc.f32", np.float32, (n, P, 4)).astype(np.float64))
    cls.requires_grad_(True)
    loc.requires_grad_(True)
    gb = rd(d, "gtb.f32", np.float32, (ngt, 4))
    gl = rd(d, "gtl.i32", np.int32, (ngt,))
    gs = rd(d, "gts.i32", np.int32, (n + 1,))
    conf, lsum, N = 0, 0, 0
    for i in range(n):
        c, l, k = image_loss(pc, cls[i], loc[i], gb[gs[i]:gs[i + 1]], gl[gs[i]:gs[i + 1]],
                             float(thr), float(negpos))
        conf, lsum, N = conf + c, lsum + l, N + k
    if N == 0:
        out = np.zeros(4 + cls.numel() + loc.numel())
    else:
        loss = (conf + float(w) * lsum) / N
        loss.backward()
        out = np.concatenate([[loss.item(), conf.item() / N, lsum.item() / N, N],
                              cls.grad.numpy().ravel(), loc.grad.numpy().ravel()])
    wr(d, "loss.f64", out)


# ---- detection -----------------------------------------------------------------------------
def cmd_detect(d, P, classes, thr, nms_iou, topkc, topk):
    P, classes, topkc, topk = int(P), int(classes), int(topkc), int(topk)
    cls = torch.from_numpy(rd(d, "cls.f32", np.float32, (P, classes)).astype(np.float64))
    # zps's float32 decoded boxes (the encode test checks them against decode() to 1e-6), so
    # an IoU at the NMS threshold compares the same on both sides
    boxes = torch.from_numpy(rd(d, "boxes.f32", np.float32, (P, 4)).copy())
    prob = torch.softmax(cls, 1)
    found = []  # (score, class, prior, box)
    for c in range(1, classes):
        sc = prob[:, c]
        cand = torch.nonzero(sc > float(thr)).flatten()
        order = cand[torch.sort(-sc[cand], stable=True)[1]][:topkc]
        keep = torchvision.ops.nms(boxes[order], sc[order].float(), float(nms_iou))
        for k in order[keep].tolist():
            found.append((-sc[k].item(), c, k, boxes[k].tolist()))
    found.sort(key=lambda t: (t[0], t[1], t[2]))
    out = np.full(1 + 6 * topk, -1.0)
    found = found[:topk]
    out[0] = len(found)
    for r, (s, c, k, b) in enumerate(found):
        out[1 + 6 * r:7 + 6 * r] = b + [c - 1, -s]
    wr(d, "det.f64", out)


# ---- VOC mAP -------------------------------------------------------------------------------
def voc_ap(rec, prec):
    mrec = np.concatenate(([0.0], rec, [1.0]))
    mpre = np.concatenate(([0.0], prec, [0.0]))
    for i in range(mpre.size - 1, 0, -1):
        mpre[i - 1] = max(mpre[i - 1], mpre[i])
    i = np.where(mrec[1:] != mrec[:-1])[0]
    return np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1])


def cmd_map(d, nd, ngt, classes):
    nd, ngt, classes = int(nd), int(ngt), int(classes)
    dets = rd(d, "dets.f32", np.float32, (nd, 7)).astype(np.float64)  # img cls score x1 y1 x2 y2
    gts = rd(d, "gts.f32", np.float32, (ngt, 6)).astype(np.float64)  # img cls x1 y1 x2 y2
    aps = []
    for c in range(classes):
        g = gts[gts[:, 1] == c]
        if len(g) == 0:
            aps.append(-1.0)
            continue
        dc = dets[dets[:, 1] == c]
        order = np.argsort(-dc[:, 2].astype(np.float32), kind="stable")
        used = np.zeros(len(g), bool)
        tp = np.zeros(len(dc))
        for r, k in enumerate(order):
            same = np.nonzero(g[:, 0] == dc[k, 0])[0]
            if len(same) == 0:
                continue
            ov = iou_tv(dc[k:k + 1, 3:7], g[same, 2:6])[0]
            j = int(np.argmax(ov))
            if ov[j] > 0.5 and not used[same[j]]:
                tp[r] = 1
                used[same[j]] = True
        ctp = np.cumsum(tp)
        rec = ctp / len(g)
        prec = ctp / np.maximum(np.arange(1, len(dc) + 1), np.finfo(np.float64).eps)
        aps.append(voc_ap(rec, prec) if len(dc) else 0.0)
    counted = [a for a in aps if a >= 0]
    wr(d, "map.f64", [np.mean(counted) if counted else 0.0, len(counted)] + aps)


CMDS = {"priors": cmd_priors, "iou": cmd_iou, "encode": cmd_encode, "nms": cmd_nms,
        "match": cmd_match, "loss": cmd_loss, "detect": cmd_detect, "map": cmd_map}

if __name__ == "__main__":
    CMDS[sys.argv[1]](*sys.argv[2:])
