/* fuzz_server.c — libFuzzer target for the server's request handling (`make fuzz`).
 *
 * Setup (once): an in-process zps-server engine on an ephemeral loopback port, registered
 * and initialised by a real client (trainer 0, async mode, 3 variables). Each input is cut
 * into 1..16 frames (format below) and sent as one multipart message from a DEALER; the
 * server handles it with ps_server_run_once. Invariants checked on every input (abort =
 * finding): the server answers with a well-formed reply header carrying a known status,
 * and a rejected request leaves the values unchanged.
 *
 * Input format: byte 0 low 4 bits + 1 = number of frames; then per frame a 2-byte
 * little-endian length and that many bytes (cut short at the end of the input). Byte 0 bit
 * 4 set: frame 0 is replaced by a valid PUSH header for trainer 0 whose ranges come from
 * the next bytes, so the fuzzer reaches range and payload validation quickly.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"
#include "common/proto.h"
#include "ps/client.h"
#include "ps/plan.h"
#include "ps/server.h"

static ps_server *s_srv;
static void *s_ctx, *s_dealer;
static ps_plan *s_plan;
static float *s_values, *s_check;

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
    s_ctx = zmq_ctx_new();
    s_dealer = zmq_socket(s_ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(s_dealer, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(s_dealer, uris[0]) == -1)
        abort();
}

/* Pulls the values through the handler into s_check (a PULL of every chunk). */
static void s_pull_all(void)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__KeyRange r[64], *rp[64];
    size_t n = s_plan->n_chunks < 64 ? s_plan->n_chunks : 64;
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
    zmq_send(s_dealer, buf, hl, 0);
    int handled = 0;
    while (!handled)
        ps_server_run_once(s_srv, 1000, &handled);
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, s_dealer, 0);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    for (size_t i = 0; more; i++) {
        zmq_msg_init(&m);
        zmq_msg_recv(&m, s_dealer, 0);
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!s_srv)
        s_setup();
    if (size < 1)
        return 0;
    int nframes = (data[0] & 15) + 1, structured = data[0] & 16;
    size_t at = 1;
    uint8_t hbuf[8192];
    for (int f = 0; f < nframes; f++) {
        size_t len = 0;
        if (at + 2 <= size) {
            len = (size_t)data[at] | ((size_t)data[at + 1] << 8);
            at += 2;
        }
        if (len > size - at)
            len = size - at;
        const void *p = data + at;
        if (f == 0 && structured) {
            Zps__Header h = ZPS__HEADER__INIT;
            Zps__KeyRange r[8], *rp[8];
            size_t nr = len / 10 > 8 ? 8 : len / 10;
            for (size_t i = 0; i < nr; i++) {
                const uint8_t *q = data + at + 10 * i;
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
            len = zps__header__pack(&h, hbuf);
            p = hbuf;
        }
        if (f == 0) { // kept to say what went wrong (s_die)
            s_last_len = len < sizeof s_last ? len : sizeof s_last;
            memcpy(s_last, p, s_last_len);
            s_last_frames = nframes;
        }
        zmq_send(s_dealer, p, len, f + 1 < nframes ? ZMQ_SNDMORE : 0);
        at += (f == 0 && structured) ? (size_t)0 : len;
    }
    int handled = 0;
    for (int tries = 0; !handled && tries < 50; tries++)
        ps_server_run_once(s_srv, 100, &handled);
    if (!handled)
        s_die("the message never arrived as a whole");
    /* Every request gets a reply (pulls may wait in ssp/sync; this server is async). */
    zmq_pollitem_t it = {s_dealer, 0, ZMQ_POLLIN, 0};
    /* 10 s: a missing reply is a finding, a VM that stalls for a second or two (seen with
     * ASan and other work on the 2 cores) is not */
    if (zmq_poll(&it, 1, 10000) != 1)
        s_die("no reply within 10 s");
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, s_dealer, 0);
    Zps__Header *rh = zps__header__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    if (!rh || !rh->is_reply || rh->status > 0 || rh->status <= -ZPS_STATUS_COUNT)
        s_die("not a well-formed reply");
    int rejected = rh->status != 0 && rh->status != ZPS_ERR_STALE;
    zps__header__free_unpacked(rh, NULL);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) {
        zmq_msg_init(&m);
        zmq_msg_recv(&m, s_dealer, 0);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    if (rejected) {
        /* A rejected request changes nothing. */
        s_pull_all();
        if (memcmp(s_check, s_values, s_plan->total * 4))
            s_die("a rejected request changed the values");
    } else {
        s_pull_all();
        memcpy(s_values, s_check, s_plan->total * 4);
    }
    return 0;
}
