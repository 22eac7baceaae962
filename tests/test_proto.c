/* test_proto.c — wire header and dataset record survive encode/decode; truncated and
 * garbage bytes are rejected (NULL), never a crash. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/proto.h"

static const Zps__Op s_ops[] = {ZPS__OP__OP_REGISTER, ZPS__OP__OP_INIT,     ZPS__OP__OP_PUSH,
                                ZPS__OP__OP_PULL,     ZPS__OP__OP_PUSHPULL, ZPS__OP__OP_BARRIER,
                                ZPS__OP__OP_HEARTBEAT, ZPS__OP__OP_CHECKPOINT,
                                ZPS__OP__OP_STATS,    ZPS__OP__OP_SHUTDOWN, ZPS__OP__OP_LEAVE};

/* Packs a header with every field set for op; caller frees the bytes. */
static uint8_t *s_pack_header(Zps__Op op, size_t *len)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__KeyRange r[3], *rp[3];
    for (int i = 0; i < 3; i++) {
        zps__key_range__init(&r[i]);
        r[i].key = 7u * (unsigned)i + 1;
        r[i].offset = 1000u * (unsigned)i;
        r[i].length = 4096u << i;
        r[i].dtype = ZPS__DTYPE__DTYPE_F32;
        rp[i] = &r[i];
    }
    Zps__OptimizerConfig opt = ZPS__OPTIMIZER_CONFIG__INIT;
    Zps__Schedule sch = ZPS__SCHEDULE__INIT;
    Zps__JobConfig job = ZPS__JOB_CONFIG__INIT;
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = op;
    h.request_id = 0x123456789abcull + (uint64_t)op;
    h.trainer_id = 5;
    h.step = -1 + (int64_t)op * 1000000007ll;
    h.n_ranges = 3;
    h.ranges = rp;
    h.plan_hash = 0xfeedfacecafebeefull;
    h.is_reply = op % 2;
    h.status = -(int)op;
    h.message = "a readable reason";
    h.model_version = 99;
    if (op == ZPS__OP__OP_INIT) {
        opt.name = "rmsprop";
        opt.lr = 0.045;
        opt.decay = 0.9;
        opt.epsilon = 1.0;
        opt.momentum = 0.9;
        sch.kind = "exponential";
        sch.decay_rate = 0.94;
        sch.decay_steps = 2;
        sch.staircase = 1;
        opt.schedule = &sch;
        h.optimizer = &opt;
    }
    if (op == ZPS__OP__OP_REGISTER || op == ZPS__OP__OP_INIT) {
        job.mode = ZPS__MODE__MODE_SSP;
        job.num_trainers = 3;
        job.staleness = 2;
        job.chunk_bytes = 4u << 20;
        h.job = &job;
    }
    *len = zps__header__get_packed_size(&h);
    uint8_t *buf = malloc(*len);
    cr_assert_eq(zps__header__pack(&h, buf), *len);
    return buf;
}

Test(proto, header_round_trip_for_every_op)
{
    for (size_t k = 0; k < sizeof s_ops / sizeof s_ops[0]; k++) {
        size_t len;
        uint8_t *buf = s_pack_header(s_ops[k], &len);
        Zps__Header *h = zps__header__unpack(NULL, len, buf);
        cr_assert_not_null(h, "op %d does not unpack", s_ops[k]);
        cr_assert_eq(h->op, s_ops[k]);
        cr_assert_eq(h->version, ZPS_PROTOCOL_VERSION);
        cr_assert_eq(h->request_id, 0x123456789abcull + (uint64_t)s_ops[k]);
        cr_assert_eq(h->trainer_id, 5);
        cr_assert_eq(h->step, -1 + (int64_t)s_ops[k] * 1000000007ll);
        cr_assert_eq(h->n_ranges, 3);
        for (int i = 0; i < 3; i++) {
            cr_assert_eq(h->ranges[i]->key, 7u * (unsigned)i + 1);
            cr_assert_eq(h->ranges[i]->offset, 1000u * (unsigned)i);
            cr_assert_eq(h->ranges[i]->length, 4096u << i);
            cr_assert_eq(h->ranges[i]->dtype, ZPS__DTYPE__DTYPE_F32);
        }
        cr_assert_eq(h->plan_hash, 0xfeedfacecafebeefull);
        cr_assert_eq(h->status, -(int)s_ops[k]);
        cr_assert_str_eq(h->message, "a readable reason");
        cr_assert_eq(h->model_version, 99);
        if (s_ops[k] == ZPS__OP__OP_INIT) {
            cr_assert_not_null(h->optimizer);
            cr_assert_str_eq(h->optimizer->name, "rmsprop");
            cr_assert_float_eq(h->optimizer->lr, 0.045, 0);
            cr_assert_not_null(h->optimizer->schedule);
            cr_assert_eq(h->optimizer->schedule->decay_steps, 2);
            cr_assert(h->optimizer->schedule->staircase);
        } else {
            cr_assert_null(h->optimizer);
        }
        if (h->job) {
            cr_assert_eq(h->job->mode, ZPS__MODE__MODE_SSP);
            cr_assert_eq(h->job->staleness, 2);
        }
        zps__header__free_unpacked(h, NULL);
        free(buf);
    }
}

Test(proto, truncated_headers_are_rejected)
{
    size_t len;
    uint8_t *buf = s_pack_header(ZPS__OP__OP_INIT, &len);
    int rejected = 0;
    /* Every strict prefix that cuts a field in the middle must fail to unpack; prefixes that
     * end on a field boundary are valid (shorter) messages, which is why the server checks
     * frame counts and lengths against the header rather than trusting it. */
    for (size_t n = 0; n < len; n++) {
        Zps__Header *h = zps__header__unpack(NULL, n, buf);
        if (!h)
            rejected++;
        else
            zps__header__free_unpacked(h, NULL);
    }
    cr_assert(rejected > (int)len / 2, "only %d of %zu prefixes rejected", rejected, len);
    free(buf);
}

Test(proto, garbage_is_rejected_not_crashed)
{
    srand(42);
    int rejected = 0;
    for (int t = 0; t < 2000; t++) {
        uint8_t g[256];
        size_t n = (size_t)(rand() % (int)sizeof g);
        for (size_t i = 0; i < n; i++)
            g[i] = (uint8_t)rand();
        Zps__Header *h = zps__header__unpack(NULL, n, g);
        if (h)
            zps__header__free_unpacked(h, NULL);
        else
            rejected++;
        Zps__Example *e = zps__example__unpack(NULL, n, g);
        if (e)
            zps__example__free_unpacked(e, NULL);
    }
    cr_assert(rejected > 1000, "random bytes rarely form a header; %d rejected", rejected);
    /* A field with a length far past the end of the buffer. */
    const uint8_t lie[] = {0x52, 0xff, 0xff, 0xff, 0x0f, 1, 2, 3};
    cr_assert_null(zps__header__unpack(NULL, sizeof lie, lie));
}

Test(proto, example_with_boxes_round_trip)
{
    uint8_t pixels[4 * 3 * 3];
    for (size_t i = 0; i < sizeof pixels; i++)
        pixels[i] = (uint8_t)(i * 37 + 11);
    Zps__Example ex = ZPS__EXAMPLE__INIT;
    ex.image.data = pixels;
    ex.image.len = sizeof pixels;
    ex.encoding = ZPS__ENCODING__ENCODING_RAW;
    ex.height = 4;
    ex.width = 3;
    ex.channels = 3;
    ex.label = 7;
    Zps__Box b[2], *bp[2];
    for (int i = 0; i < 2; i++) {
        zps__box__init(&b[i]);
        b[i].xmin = 0.125f + 0.25f * (float)i;
        b[i].ymin = 0.1f;
        b[i].xmax = 0.375f + 0.25f * (float)i;
        b[i].ymax = 0.9f;
        b[i].label = 3 + i;
        b[i].difficult = i;
        bp[i] = &b[i];
    }
    ex.n_boxes = 2;
    ex.boxes = bp;
    size_t len = zps__example__get_packed_size(&ex);
    uint8_t *buf = malloc(len);
    cr_assert_eq(zps__example__pack(&ex, buf), len);
    Zps__Example *d = zps__example__unpack(NULL, len, buf);
    cr_assert_not_null(d);
    cr_assert_eq(d->image.len, sizeof pixels);
    cr_assert_eq(memcmp(d->image.data, pixels, sizeof pixels), 0);
    cr_assert_eq(d->height, 4);
    cr_assert_eq(d->width, 3);
    cr_assert_eq(d->channels, 3);
    cr_assert_eq(d->label, 7);
    cr_assert_eq(d->n_boxes, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(d->boxes[i]->xmin, b[i].xmin);
        cr_assert_eq(d->boxes[i]->ymin, b[i].ymin);
        cr_assert_eq(d->boxes[i]->xmax, b[i].xmax);
        cr_assert_eq(d->boxes[i]->ymax, b[i].ymax);
        cr_assert_eq(d->boxes[i]->label, 3 + i);
        cr_assert_eq(d->boxes[i]->difficult, (protobuf_c_boolean)i);
    }
    zps__example__free_unpacked(d, NULL);
    /* A truncated record fails. */
    cr_assert_null(zps__example__unpack(NULL, len - 3, buf));
    free(buf);
}
