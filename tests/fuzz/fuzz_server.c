/* fuzz_server.c — libFuzzer target for the server's request handling (`make fuzz`).
 *
 * Setup (once): an in-process zps-server engine on an ephemeral loopback port, registered
 * and initialised by a real client (trainer 0, async mode, 3 variables). Each input is cut
 * into 1..16 frames (format below) and sent as one multipart message from a DEALER; the
 * server handles it with ps_server_run_once. Invariants checked on every input (abort =
 * finding): the server answers with a well-formed reply header carrying a known status,
 * and a rejected request leaves the values unchanged.
 *
 * Byte 0 bit 5 set: the frames go straight into the validation layer instead
 * (ps/server_validate.c, the checks every handler runs first), with no socket in between:
 * the same checks, many more inputs a second. Invariants there: a check never changes the
 * values, and ranges it accepts lie inside their chunk with frames of their size.
 *
 * Input format: byte 0 low 4 bits + 1 = number of frames; then per frame a 2-byte
 * little-endian length and that many bytes (cut short at the end of the input). Byte 0 bit
 * 4 set: frame 0 is replaced by a valid PUSH, PULL or PUSHPULL header whose ranges come
 * from the next bytes, so the fuzzer reaches range and payload validation quickly. Such a
 * header mostly carries trainer 0's registered incarnation nonce, else none, a foreign one,
 * or it becomes a REGISTER with an incarnation made from the input (docs/ps.md "Trainer
 * identity").
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/proto.h"
#include "ps/client.h"
#include "ps/plan.h"
#include "ps/server.h"
#include "ps/server_int.h"

static ps_server *s_srv;
static void *s_ctx, *s_dealer;
static ps_plan *s_plan;
static float *s_values, *s_check;

/* The nonce trainer 0's requests must carry: its registered incarnation's. */
static uint64_t s_nonce(void) { return s_srv->trainers ? s_srv->trainers[0].inc.nonce : 0; }

static void *s_serve(void *arg)
{
    (void)arg;
    ps_server_run(s_srv);
    return NULL;
}

static void s_setup(void)
{
    zps_log_set_level(ZPS_LOG_OFF);
    ps_server_config cfg;
    ps_server_config_default(&cfg);
    cfg.mode = PS_MODE_ASYNC;
    cfg.num_trainers = 2;
    cfg.max_message_bytes = 1u << 20;
    cfg.stats_every_s = 0;
    if (ps_server_new(&cfg, &s_srv) != ZPS_OK)
        abort();
    static const ps_var vars[] = {{"w", 3000}, {"b", 5}, {"v", 1200}};
    ps_plan_new(vars, 3, 1, 4096, &s_plan);
    s_values = malloc(s_plan->total * 4);
    s_check = malloc(s_plan->total * 4);
    for (uint64_t i = 0; i < s_plan->total; i++)
        s_values[i] = (float)i * 0.001f;
    pthread_t th;
    pthread_create(&th, NULL, s_serve, NULL);
    const char *uris[1] = {ps_server_endpoint(s_srv)};
    ps_client *c;
    ps_optim_config o;
    ps_optim_default(&o);
    if (ps_client_new(uris, 1, 0, NULL, &c) != ZPS_OK || ps_client_register(c, s_plan, NULL, NULL) ||
        ps_client_init(c, s_values, &o, NULL))
        abort();
    ps_client_destroy(&c);
    ps_server_stop(s_srv);
    pthread_join(th, NULL);
    if (s_srv->local_total != s_plan->total) // one server: its flat buffer is the plan's
        abort();
    s_ctx = zmq_ctx_new();
    s_dealer = zmq_socket(s_ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(s_dealer, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(s_dealer, uris[0]) == -1)
        abort();
}

/* libFuzzer checks its -timeout with SIGALRM: a wait it interrupts (EINTR) is resumed, or
 * a reply that was on its way read as missing (a false finding, seen about once a minute
 * with -timeout=10). */
static void s_send(const void *p, size_t n, int flags)
{
    while (zmq_send(s_dealer, p, n, flags) == -1 && zmq_errno() == EINTR)
        ;
}

static int s_recv_frame(zmq_msg_t *m)
{
    int rc;
    while ((rc = zmq_msg_recv(m, s_dealer, 0)) == -1 && zmq_errno() == EINTR)
        ;
    return rc;
}

/* 1 when a reply is there within ms milliseconds, waiting through interruptions. */
static int s_reply_within(int ms)
{
    zmq_pollitem_t it = {s_dealer, 0, ZMQ_POLLIN, 0};
    uint64_t end = zps_now_ns() + (uint64_t)ms * 1000000u;
    for (;;) {
        uint64_t now = zps_now_ns();
        int left = now < end ? (int)((end - now) / 1000000u) : 0;
        int rc = zmq_poll(&it, 1, left);
        if (rc == 1)
            return 1;
        if (rc == 0 || zmq_errno() != EINTR || now >= end)
            return 0;
    }
}

/* Pulls the values through the handler into s_check (a PULL of every chunk). */
static void s_pull_all(void)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__Incarnation in = ZPS__INCARNATION__INIT;
    Zps__KeyRange r[64], *rp[64];
    size_t n = s_plan->n_chunks < 64 ? s_plan->n_chunks : 64;
    in.nonce = s_nonce();
    h.incarnation = &in;
    for (size_t i = 0; i < n; i++) {
        zps__key_range__init(&r[i]);
        r[i].key = s_plan->chunks[i].key;
        r[i].length = s_plan->chunks[i].count * 4;
        r[i].dtype = ZPS__DTYPE__DTYPE_F32;
        rp[i] = &r[i];
    }
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = ZPS__OP__OP_PULL;
    h.request_id = 1;
    h.step = -1;
    h.n_ranges = n;
    h.ranges = rp;
    uint8_t buf[4096];
    size_t hl = zps__header__pack(&h, buf);
    s_send(buf, hl, 0);
    int handled = 0;
    while (!handled)
        ps_server_run_once(s_srv, 1000, &handled);
    zmq_msg_t m;
    zmq_msg_init(&m);
    s_recv_frame(&m);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    for (size_t i = 0; more; i++) {
        zmq_msg_init(&m);
        s_recv_frame(&m);
        more = zmq_msg_more(&m);
        if (i < n && zmq_msg_size(&m) == s_plan->chunks[i].count * 4)
            memcpy(s_check + s_plan->chunks[i].offset, zmq_msg_data(&m), zmq_msg_size(&m));
        zmq_msg_close(&m);
    }
}

/* The header frame of the request under test, for s_die. */
static uint8_t s_last[8192];
static size_t s_last_len;
static int s_last_frames;

/* Aborts (a finding) after saying why and what the request was. */
static void s_die(const char *why)
{
    fprintf(stderr, "fuzz_server: %s; request of %d frames", why, s_last_frames);
    Zps__Header *h = zps__header__unpack(NULL, s_last_len, s_last);
    if (h) {
        fprintf(stderr, ": op %d trainer %u step %lld rid %llu, %zu ranges:", (int)h->op,
                h->trainer_id, (long long)h->step, (unsigned long long)h->request_id, h->n_ranges);
        for (size_t i = 0; i < h->n_ranges; i++)
            fprintf(stderr, " [key %u off %llu len %llu dtype %d]", h->ranges[i]->key,
                    (unsigned long long)h->ranges[i]->offset,
                    (unsigned long long)h->ranges[i]->length, (int)h->ranges[i]->dtype);
        zps__header__free_unpacked(h, NULL);
    } else {
        fprintf(stderr, ", a header frame of %zu bytes that is no Header:", s_last_len);
        for (size_t i = 0; i < s_last_len && i < 64; i++)
            fprintf(stderr, " %02x", s_last[i]);
    }
    fprintf(stderr, "\n");
    abort();
}

/* The input cut into frames (format at the top); frame 0 may point into hbuf. */
typedef struct s_input {
    int n;
    const void *p[16];
    size_t len[16];
    uint8_t hbuf[8192];
} s_input;

/* The incarnation of a structured header of len bytes at q (into in, host: 16 bytes):
 * trainer 0's (4 in 7), none, a foreign nonce, or a REGISTER's whole one from the input. */
static void s_structured_inc(Zps__Header *h, const uint8_t *q, size_t len, Zps__Incarnation *in,
                             char *host, Zps__JobConfig *j)
{
    int kind = (int)(len % 7);
    zps__incarnation__init(in);
    in->nonce = kind == 4 ? s_nonce() ^ 0x100 : s_nonce();
    h->incarnation = kind == 5 ? NULL : in;
    if (kind != 6)
        return;
    size_t hl = len < 15 ? len : 15; // any bytes: the server must refuse what is not printable
    memcpy(host, q, hl);
    host[hl] = 0;
    in->nonce = len % 2 ? 0 : 0x9e3779b97f4a7c15ull * (len + 1);
    in->pid = (uint32_t)len;
    in->host = host;
    zps__job_config__init(j);
    j->num_chunks = s_plan->n_chunks;
    j->num_servers = 1;
    j->num_variables = (uint32_t)s_plan->n_vars;
    j->total_count = s_plan->total;
    j->chunk_bytes = s_plan->chunk_bytes;
    h->op = ZPS__OP__OP_REGISTER;
    h->plan_hash = s_plan->hash;
    h->job = j;
}

/* A valid PUSH / PULL / PUSHPULL header whose ranges come from the len bytes at q. */
static size_t s_structured(const uint8_t *q, size_t len, uint8_t *out)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__Incarnation in;
    Zps__JobConfig j;
    char host[16];
    Zps__KeyRange r[8], *rp[8];
    const uint8_t *q0 = q;
    size_t nr = len / 10 > 8 ? 8 : len / 10;
    for (size_t i = 0; i < nr; i++, q += 10) {
        zps__key_range__init(&r[i]);
        r[i].key = q[0] % 16;
        r[i].offset = (uint64_t)q[1] | ((uint64_t)q[2] << 8);
        r[i].length = (uint64_t)q[3] | ((uint64_t)q[4] << 8) | ((uint64_t)q[5] << 16);
        r[i].dtype = (Zps__DType)(q[6] % 4); // unknown, f32, f16, bf16
        rp[i] = &r[i];
    }
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = (Zps__Op)(3 + (len % 3)); // push, pull, pushpull
    h.request_id = 7;
    h.trainer_id = len % 3 == 0 ? 0 : (uint32_t)(len % 4);
    h.step = (int64_t)(len % 5) - 1;
    h.n_ranges = nr;
    h.ranges = rp;
    s_structured_inc(&h, q0, len, &in, host, &j);
    if (h.op == ZPS__OP__OP_REGISTER)
        h.n_ranges = 0;
    return zps__header__pack(&h, out);
}

static void s_parse(const uint8_t *data, size_t size, s_input *in)
{
    in->n = (data[0] & 15) + 1;
    int structured = data[0] & 16;
    size_t at = 1;
    for (int f = 0; f < in->n; f++) {
        size_t len = 0;
        if (at + 2 <= size) {
            len = (size_t)data[at] | ((size_t)data[at + 1] << 8);
            at += 2;
        }
        if (len > size - at)
            len = size - at;
        in->p[f] = data + at;
        in->len[f] = len;
        if (f == 0 && structured) {
            in->len[0] = s_structured(data + at, len, in->hbuf);
            in->p[0] = in->hbuf;
        } else {
            at += len;
        }
    }
    s_last_len = in->len[0] < sizeof s_last ? in->len[0] : sizeof s_last;
    memcpy(s_last, in->p[0], s_last_len); // kept to say what went wrong (s_die)
    s_last_frames = in->n;
}

/* What ps_srv_check_ranges accepted: each range inside its chunk, with its frame. */
static void s_check_accepted(const Zps__Header *h, int has_data)
{
    for (size_t i = 0; i < h->n_ranges; i++) {
        const ps_srv_range *g = &s_srv->ranges[i];
        if (g->lc >= s_srv->n_local || g->n == 0 || g->off > s_srv->chunks[g->lc].count ||
            g->n > s_srv->chunks[g->lc].count - g->off)
            s_die("validation accepted a range outside its chunk");
        if (has_data && (zmq_msg_size(&s_srv->frames[2 + i]) != g->n * (g->bf16 ? 2 : 4) ||
                         g->data != zmq_msg_data(&s_srv->frames[2 + i])))
            s_die("validation accepted a range whose frame does not match it");
    }
}

/* The checks its handler runs first, for the op of h (they stop at the first refusal). */
static void s_check_op(const Zps__Header *h, int nframes)
{
    char why[512];
    uint32_t nt;
    ps_srv_init_table t;
    int op = h->op, has_data = op == ZPS__OP__OP_PUSH || op == ZPS__OP__OP_PUSHPULL;
    if (op == ZPS__OP__OP_REGISTER) {
        if (ps_srv_check_register(s_srv, h, &nt, why, sizeof why) == ZPS_OK &&
            (!nt || nt > PS_MAX_TRAINERS || h->trainer_id >= nt))
            s_die("validation accepted a REGISTER outside the job");
        return;
    }
    if (ps_srv_check_trainer(s_srv, h, why, sizeof why) != ZPS_OK)
        return;
    if (op == ZPS__OP__OP_INIT && ps_srv_check_init(s_srv, h, nframes, &t, why, sizeof why) == ZPS_OK) {
        ps_srv_init_table_free(&t); // possible only with --allow-reinit: not this server
        s_die("validation accepted a second INIT");
    }
    if ((has_data || op == ZPS__OP__OP_PULL) &&
        ps_srv_check_ranges(s_srv, h, nframes, has_data, why, sizeof why) == ZPS_OK)
        s_check_accepted(h, has_data);
}

/* The frames straight into the validation layer, as the server would have received them. */
static void s_direct(const s_input *in)
{
    int nframes = in->n + 1;
    uint64_t bytes = 5;
    zmq_msg_init_size(&s_srv->frames[0], 5);
    memcpy(zmq_msg_data(&s_srv->frames[0]), "peer0", 5);
    for (int f = 0; f < in->n; f++) {
        zmq_msg_init_size(&s_srv->frames[1 + f], in->len[f]);
        memcpy(zmq_msg_data(&s_srv->frames[1 + f]), in->p[f], in->len[f]);
        bytes += in->len[f];
    }
    Zps__Header *h;
    int op;
    char why[256];
    if (ps_srv_check_message(s_srv, nframes, 0, bytes, &h, &op, why, sizeof why) == ZPS_OK) {
        if (op <= 0 || op >= PS_SRV_N_OPS)
            s_die("validation accepted an unknown op");
        s_check_op(h, nframes);
    }
    if (h)
        zps__header__free_unpacked(h, NULL);
    for (int f = 0; f < nframes; f++)
        zmq_msg_close(&s_srv->frames[f]);
    if (memcmp(s_srv->values, s_values, s_plan->total * 4))
        s_die("validation changed the values");
}

/* The frames through the socket; the reply must be well formed. Returns 1 when the
 * request was rejected. */
static int s_through_socket(const s_input *in)
{
    for (int f = 0; f < in->n; f++)
        s_send(in->p[f], in->len[f], f + 1 < in->n ? ZMQ_SNDMORE : 0);
    int handled = 0;
    for (int tries = 0; !handled && tries < 50; tries++)
        ps_server_run_once(s_srv, 100, &handled);
    if (!handled)
        s_die("the message never arrived as a whole");
    /* Every request gets a reply (pulls may wait in ssp/sync; this server is async). */
    /* 10 s: a missing reply is a finding, a VM that stalls for a second or two (seen with
     * ASan and other work on the 2 cores) is not */
    if (!s_reply_within(10000))
        s_die("no reply within 10 s");
    zmq_msg_t m;
    zmq_msg_init(&m);
    s_recv_frame(&m);
    Zps__Header *rh = zps__header__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    if (!rh || !rh->is_reply || rh->status > 0 || rh->status <= -ZPS_STATUS_COUNT)
        s_die("not a well-formed reply");
    int rejected = rh->status != 0 && rh->status != ZPS_ERR_STALE;
    zps__header__free_unpacked(rh, NULL);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) {
        zmq_msg_init(&m);
        s_recv_frame(&m);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    return rejected;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!s_srv)
        s_setup();
    if (size < 1)
        return 0;
    static s_input in;
    s_parse(data, size, &in);
    if (data[0] & 32) {
        s_direct(&in);
        return 0;
    }
    int rejected = s_through_socket(&in);
    s_pull_all();
    if (rejected) {
        /* A rejected request changes nothing. */
        if (memcmp(s_check, s_values, s_plan->total * 4))
            s_die("a rejected request changed the values");
    } else {
        memcpy(s_values, s_check, s_plan->total * 4);
    }
    return 0;
}
