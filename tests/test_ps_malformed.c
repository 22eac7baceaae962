/* test_ps_malformed.c — malformed requests sent over a raw DEALER socket: each gets its
 * documented error status, the server stays up, the values do not change, and STATS
 * counts every rejection by reason. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <zmq.h>

#include "common/mem.h"
#include "common/proto.h"
#include "ps/client.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

static const ps_var s_vars[] = {{"w", 60000}, {"b", 10}};

typedef struct raw {
    void *ctx, *sock;
    uint64_t rid;
} raw;

/* Sends header bytes + payload frames; returns the reply status (or 1 on no reply). */
static int s_send_raw(raw *r, const void *hdr, size_t hl, const void *const *pl, const size_t *pll,
                      int npl, char *msg, size_t msg_len)
{
    zmq_send(r->sock, hdr, hl, npl ? ZMQ_SNDMORE : 0);
    for (int i = 0; i < npl; i++)
        zmq_send(r->sock, pl[i], pll[i], i + 1 < npl ? ZMQ_SNDMORE : 0);
    zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 5000) <= 0)
        return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, r->sock, 0);
    Zps__Header *h = zps__header__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) { // drain payload
        zmq_msg_init(&m);
        zmq_msg_recv(&m, r->sock, 0);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    if (!h)
        return 2;
    int st = h->status;
    if (msg)
        snprintf(msg, msg_len, "%s", h->message ? h->message : "");
    zps__header__free_unpacked(h, NULL);
    return st;
}

/* A request header for op with the given ranges; returns packed bytes (caller frees). */
static uint8_t *s_hdr(raw *r, int op, uint32_t version, uint32_t trainer, int64_t step,
                      const Zps__KeyRange *ranges, int n, int is_reply, size_t *len)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__KeyRange *rp[64];
    for (int i = 0; i < n; i++)
        rp[i] = (Zps__KeyRange *)&ranges[i];
    h.version = version;
    h.op = (Zps__Op)op;
    h.request_id = ++r->rid;
    h.trainer_id = trainer;
    h.step = step;
    h.n_ranges = (size_t)n;
    h.ranges = rp;
    h.is_reply = is_reply;
    *len = zps__header__get_packed_size(&h);
    uint8_t *b = zps_xmalloc(*len + 1);
    zps__header__pack(&h, b);
    return b;
}

/* A current-version request of op from trainer 0 at step 0 with ranges kr[0..n) and
 * payload frames pl/pll[0..npl): *h gets the packed header (freed by EXPECT); returns the
 * reply status as s_send_raw does. */
static int s_req(raw *r, uint8_t **h, int op, const Zps__KeyRange *kr, int n,
                 const void *const *pl, const size_t *pll, int npl, char *msg, size_t msg_len)
{
    size_t hl;
    *h = s_hdr(r, op, ZPS_PROTOCOL_VERSION, 0, 0, kr, n, 0, &hl);
    return s_send_raw(r, *h, hl, pl, pll, npl, msg, msg_len);
}

static Zps__KeyRange s_kr(uint32_t key, uint64_t off, uint64_t len)
{
    Zps__KeyRange k = ZPS__KEY_RANGE__INIT;
    k.key = key;
    k.offset = off;
    k.length = len;
    k.dtype = ZPS__DTYPE__DTYPE_F32;
    return k;
}

Test(it_ps_malformed, every_bad_request_gets_its_error_and_changes_nothing, .timeout = 30)
{
    uint64_t seed = pst_seed();
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv;
    const char *args[] = {"--mode", "async", "--num-trainers", "2", "--max-message-bytes", "300000", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    const char *uris[1] = {srv.uri};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &c), ZPS_OK);
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK);
    float *init = zps_xmalloc(n * 4), *v = zps_xmalloc(n * 4);
    uint64_t r = seed;
    for (uint64_t i = 0; i < n; i++)
        init[i] = pst_uniform(&r);
    ps_optim_config o;
    ps_optim_default(&o);
    cr_assert_eq(ps_client_init(c, init, &o, NULL), ZPS_OK);

    raw rw = {0};
    rw.ctx = zmq_ctx_new();
    rw.sock = zmq_socket(rw.ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(rw.sock, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(rw.sock, srv.uri), 0);

    const uint64_t chunk0 = plan->chunks[0].count;
    float *good = zps_xmalloc(64 * 1024 + 16);
    for (int i = 0; i < 16 * 1024 + 4; i++)
        good[i] = pst_uniform(&r);
    char msg[512];
    int expected = 0;
    size_t hl;
    uint8_t *h;

#define EXPECT(st_, what_)                                                             \
    do {                                                                               \
        cr_expect_eq(got, (st_), "%s: got %d (%s) want %s; message '%s' (seed %llu)", (what_), \
                     got, zps_status_name(got) ? zps_status_name(got) : "?", #st_, msg,  \
                     (unsigned long long)seed);                                         \
        expected++;                                                                    \
        free(h);                                                                       \
    } while (0)
    int got;

    /* garbage: 0xff is field 31 with wire type 7, which does not exist */
    uint8_t junk[64];
    memset(junk, 0xff, sizeof junk);
    h = zps_xmalloc(1);
    got = s_send_raw(&rw, junk, sizeof junk, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_PROTO, "garbage header");

    /* truncated header: cut inside the ranges */
    Zps__KeyRange kr[64];
    kr[0] = s_kr(plan->chunks[0].key, 0, 4096);
    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 0, 0, kr, 1, 0, &hl);
    got = s_send_raw(&rw, h, hl - 3, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_PROTO, "truncated header");

    /* an empty header frame decodes as version 0 */
    h = zps_xmalloc(1);
    got = s_send_raw(&rw, h, 0, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_VERSION, "empty header");

    const void *pl[64];
    size_t pll[64];
    pl[0] = good;
    pll[0] = 4096;
    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION + 7, 0, 0, kr, 1, 0, &hl);
    got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_VERSION, "wrong protocol version");

    h = s_hdr(&rw, 99, ZPS_PROTOCOL_VERSION, 0, 0, NULL, 0, 0, &hl);
    got = s_send_raw(&rw, h, hl, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_OP, "unknown op");

    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 0, 0, kr, 1, 1, &hl);
    got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_OP, "a reply sent as a request");

    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 7, 0, kr, 1, 0, &hl);
    got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_TRAINER, "trainer id outside the job");

    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 1, 0, kr, 1, 0, &hl);
    got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_TRAINER, "unregistered trainer");

    kr[1] = s_kr(plan->chunks[1].key, 0, 4096);
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 2, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "fewer frames than ranges");

    h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 0, 0, kr, 1, 0, &hl);
    pl[1] = good;
    pll[1] = 4096;
    got = s_send_raw(&rw, h, hl, pl, pll, 2, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "more frames than ranges");

    pll[0] = 4092;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "frame shorter than its range");
    pll[0] = 4096;

    kr[0] = s_kr(plan->n_chunks + 5, 0, 4096);
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_KEY, "unknown key");

    kr[0] = s_kr(plan->chunks[0].key, chunk0 - 10, 4096);
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_RANGE, "range past the end of its chunk");

    kr[0] = s_kr(plan->chunks[0].key, UINT64_MAX - 2, 4096);
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_RANGE, "offset that overflows");

    kr[0] = s_kr(plan->chunks[0].key, 0, 4094);
    pll[0] = 4094;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_RANGE, "length not a whole number of floats");
    pll[0] = 4096;

    kr[0] = s_kr(plan->chunks[0].key, 0, 4096);
    kr[0].dtype = ZPS__DTYPE__DTYPE_F16;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_DTYPE, "f16 dtype");

    /* bfloat16 is served for pushed gradients only: 2 bytes a value, finite */
    kr[0] = s_kr(plan->chunks[0].key, 0, 4096);
    kr[0].dtype = ZPS__DTYPE__DTYPE_BF16;
    got = s_req(&rw, &h, ZPS__OP__OP_PULL, kr, 1, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_DTYPE, "bf16 dtype on a pull");
    kr[0].length = 2047;
    pll[0] = 2047;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_RANGE, "bf16 length not a whole number of values");
    kr[0].length = 2 * chunk0 + 2;
    pll[0] = 2 * chunk0 + 2;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_RANGE, "bf16 range one value past its chunk");
    kr[0].length = 2048;
    pll[0] = 1024;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "bf16 frame of half its range's bytes");
    pll[0] = 2048;
    uint16_t *b16 = zps_xmalloc(2048);
    for (int i = 0; i < 1024; i++)
        b16[i] = 0x3f80; // 1.0
    b16[999] = 0x7fc0;  // NaN
    pl[0] = b16;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_NONFINITE, "NaN in bf16 gradients");
    b16[999] = 0x3f80;
    b16[7] = 0xff80; // -Inf
    pl[0] = b16;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSHPULL, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_NONFINITE, "-Inf in bf16 gradients (pushpull)");
    free(b16);
    pl[0] = good;
    pll[0] = 4096;

    kr[0] = s_kr(plan->chunks[0].key, 0, 4096);
    float *bad = zps_xmalloc(4096);
    memcpy(bad, good, 4096);
    bad[517] = NAN;
    pl[0] = bad;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_NONFINITE, "NaN in gradients");
    bad[517] = 1.0f;
    bad[1000] = -INFINITY;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSHPULL, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_NONFINITE, "-Inf in gradients (pushpull)");
    pl[0] = good;

    /* every chunk twice, whole: about 480 KB > --max-message-bytes 300000 */
    int nr = 0;
    for (uint32_t k = 0; nr < 64 && k < 2 * plan->n_chunks; k++) {
        const ps_chunk *ch = &plan->chunks[k % plan->n_chunks];
        kr[nr] = s_kr(ch->key, 0, ch->count * 4);
        pl[nr] = good;
        pll[nr] = ch->count * 4;
        nr++;
    }
    cr_assert(plan->chunks[0].count * 4 * (uint64_t)nr > 300000);
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, nr, pl, pll, nr, msg, sizeof msg);
    EXPECT(ZPS_ERR_TOO_LARGE, "oversized message");

    kr[0] = s_kr(plan->chunks[0].key, 0, 4096);
    got = s_req(&rw, &h, ZPS__OP__OP_PULL, kr, 1, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "pull with a payload frame");

    got = s_req(&rw, &h, ZPS__OP__OP_PULL, kr, 0, NULL, NULL, 0, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "pull of no ranges");

    h = s_hdr(&rw, ZPS__OP__OP_HEARTBEAT, ZPS_PROTOCOL_VERSION, 0, 0, NULL, 0, 0, &hl);
    got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
    EXPECT(ZPS_ERR_FRAMES, "heartbeat with a payload frame");

    /* a second INIT (first writer wins) */
    int first = -1;
    for (uint64_t i = 0; i < n; i++)
        v[i] = pst_uniform(&r);
    got = ps_client_init(c, v, &o, &first) == ZPS_OK && first == 0 ? ZPS_ERR_ALREADY_INIT : -999;
    snprintf(msg, sizeof msg, "%s", ps_client_last_error(c));
    h = NULL;
    EXPECT(ZPS_ERR_ALREADY_INIT, "second INIT");
    expected--; // not counted by ps_client_init's success path... counted below by the server

    /* The server is alive and the values are the initial ones. */
    int wst;
    cr_assert_eq(waitpid(srv.pid, &wst, WNOHANG), 0, "zps-server died");
    ps_ticket tk;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, 0, &tk), ZPS_OK);
    uint64_t ver = 99;
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, 0);
    cr_assert(!memcmp(v, init, n * 4), "a rejected request changed the values (seed %llu)",
              (unsigned long long)seed);
    char *json;
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK);
    char want[64];
    snprintf(want, sizeof want, "\"rejected_total\":%d,", expected + 1);
    cr_expect(strstr(json, want), "want %s in %s", want, json);
    cr_expect(strstr(json, "\"ZPS_ERR_NONFINITE\":4"), "%s", json);
    cr_expect(strstr(json, "\"ZPS_ERR_FRAMES\":7"), "%s", json);
    cr_expect(strstr(json, "\"updates\":0,"), "%s", json);
    free(json);

    zmq_close(rw.sock);
    zmq_ctx_term(rw.ctx);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    free(init);
    free(v);
    free(good);
    free(bad);
    ps_plan_destroy(&plan);
}

/* sync: a range overlapping elements the trainer already pushed for this step (in an
 * earlier request or earlier in the same one) is refused and changes nothing; the trainer's
 * other ranges still complete the chunk, which is then applied exactly once. */
Test(it_ps_malformed, sync_overlapping_ranges_are_refused, .timeout = 30)
{
    uint64_t seed = pst_seed();
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv;
    const char *args[] = {"--mode", "sync", "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    float *init = zps_xmalloc(n * 4), *v = zps_xmalloc(n * 4), *gr = zps_xmalloc(n * 4);
    ps_client *c = pst_client_init(srv.uri, plan, seed, init); // sgd, lr 0.01
    uint64_t r = ~seed;
    for (uint64_t i = 0; i < n; i++)
        gr[i] = pst_uniform(&r);
    cr_assert_eq(plan->chunks[0].offset, 0u);
    const uint64_t cnt = plan->chunks[0].count;
    cr_assert(cnt >= 1024); // chunks of at least 1024 elements (ps/plan.h)
    const uint64_t q = cnt / 4;

    raw rw = {0};
    rw.ctx = zmq_ctx_new();
    rw.sock = zmq_socket(rw.ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(rw.sock, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(rw.sock, srv.uri), 0);
    char msg[512];
    size_t hl;
    uint32_t key = plan->chunks[0].key;
    Zps__KeyRange kr[2];
    const void *pl[2];
    size_t pll[2];
#define PUSH1(off_, cnt_)                                                                  \
    (kr[0] = s_kr(key, (off_), (cnt_) * 4), pl[0] = gr + (off_), pll[0] = (cnt_) * 4,       \
     h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 0, 0, kr, 1, 0, &hl),           \
     got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg), free(h), got)
    uint8_t *h;
    int got;
    cr_assert_eq(PUSH1(0, q), ZPS_OK, "%s", msg);
    cr_assert_eq(PUSH1(q / 2, q), ZPS_ERR_INVALID, "overlap with an earlier request: %s", msg);
    cr_assert(strstr(msg, "more than once"), "%s", msg);
    /* two ranges in one request overlapping each other: refused, and the first one's
     * elements are not counted as pushed */
    kr[0] = s_kr(key, 2 * q, q * 4), pl[0] = gr + 2 * q, pll[0] = q * 4;
    kr[1] = s_kr(key, 2 * q + q / 2, q * 4), pl[1] = gr + 2 * q + q / 2, pll[1] = q * 4;
    got = s_req(&rw, &h, ZPS__OP__OP_PUSH, kr, 2, pl, pll, 2, msg, sizeof msg);
    free(h);
    cr_assert_eq(got, ZPS_ERR_INVALID, "overlap inside one request: %s", msg);
    cr_assert_eq(PUSH1(q, 2 * q), ZPS_OK, "%s", msg);
    /* nothing applied yet: the chunk is not complete */
    ps_ticket tk;
    uint64_t ver = 99;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, -1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, 0);
    cr_assert(!memcmp(v, init, n * 4), "values changed before the chunk was complete");
    cr_assert_eq(PUSH1(3 * q, cnt - 3 * q), ZPS_OK, "%s", msg);
#undef PUSH1
    for (uint32_t k = 1; k < plan->n_chunks; k++) { // the other chunks, whole
        const ps_chunk *ch = &plan->chunks[k];
        kr[0] = s_kr(ch->key, 0, ch->count * 4), pl[0] = gr + ch->offset, pll[0] = ch->count * 4;
        h = s_hdr(&rw, ZPS__OP__OP_PUSH, ZPS_PROTOCOL_VERSION, 0, 0, kr, 1, 0, &hl);
        got = s_send_raw(&rw, h, hl, pl, pll, 1, msg, sizeof msg);
        free(h);
        cr_assert_eq(got, ZPS_OK, "chunk %u: %s", k, msg);
    }
    cr_assert_eq(ps_client_pull(c, 0, 2, v, 1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, 1);
    for (uint64_t i = 0; i < n; i++) {
        float want = init[i] - 0.01f * gr[i];
        cr_assert(v[i] == want, "value %llu: %.9g, want %.9g (seed %llu)", (unsigned long long)i,
                  v[i], want, (unsigned long long)seed);
    }
    char *json;
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK);
    cr_expect(strstr(json, "\"ZPS_ERR_INVALID\":2"), "%s", json);
    char want[32];
    snprintf(want, sizeof want, "\"updates\":%u,", plan->n_chunks);
    cr_expect(strstr(json, want), "%s", json);
    free(json);
    zmq_close(rw.sock);
    zmq_ctx_term(rw.ctx);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    free(init), free(v), free(gr);
    ps_plan_destroy(&plan);
}

/* A peer that asks for large pulls and never reads the replies must not stall updates:
 * after a short wait the server moves the values to a fresh copy (values_cow) and goes on;
 * the values stay exactly what the pushes make them. */
Test(it_ps_malformed, a_peer_that_stops_reading_does_not_stall_pushes, .timeout = 30)
{
    uint64_t seed = pst_seed(), r = seed;
    ps_var var = {"w", 1u << 20};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(&var, 1, 1, 0, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv;
    const char *args[] = {"--mode", "async", "--num-trainers", "2", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    const char *uris[1] = {srv.uri};
    ps_client *c;
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &c), ZPS_OK);
    cr_assert_eq(ps_client_register(c, plan, NULL, NULL), ZPS_OK);
    float *v = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4);
    for (uint64_t i = 0; i < n; i++)
        v[i] = pst_uniform(&r);
    ps_optim_config o;
    ps_optim_default(&o);
    o.lr = 0.5;
    cr_assert_eq(ps_client_init(c, v, &o, NULL), ZPS_OK);

    /* the stuck peer: trainer 1 over a raw DEALER with tiny buffers, never reading */
    void *ctx = zmq_ctx_new(), *sock = zmq_socket(ctx, ZMQ_DEALER);
    int one = 1, small = 4096, zero = 0;
    zmq_setsockopt(sock, ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(sock, ZMQ_RCVBUF, &small, sizeof small);
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(sock, srv.uri), 0);
    {
        Zps__Header h = ZPS__HEADER__INIT;
        Zps__JobConfig j = ZPS__JOB_CONFIG__INIT;
        j.num_chunks = plan->n_chunks;
        j.num_servers = 1;
        j.chunk_bytes = plan->chunk_bytes;
        j.num_variables = 1;
        j.total_count = n;
        h.version = ZPS_PROTOCOL_VERSION;
        h.op = ZPS__OP__OP_REGISTER;
        h.request_id = 1;
        h.trainer_id = 1;
        h.plan_hash = plan->hash;
        h.job = &j;
        uint8_t buf[512];
        size_t hl = zps__header__pack(&h, buf);
        zmq_send(sock, buf, hl, 0);
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        cr_assert_eq(zmq_poll(&it, 1, 5000), 1);
        zmq_msg_t m;
        zmq_msg_init(&m);
        zmq_msg_recv(&m, sock, 0);
        zmq_msg_close(&m);
        Zps__KeyRange kr[64], *rp[64];
        size_t nr = plan->n_chunks < 64 ? plan->n_chunks : 64;
        for (size_t i = 0; i < nr; i++) {
            zps__key_range__init(&kr[i]);
            kr[i].key = plan->chunks[i].key;
            kr[i].length = plan->chunks[i].count * 4;
            kr[i].dtype = ZPS__DTYPE__DTYPE_F32;
            rp[i] = &kr[i];
        }
        h.op = ZPS__OP__OP_PULL;
        h.job = NULL;
        h.step = -1;
        h.n_ranges = nr;
        h.ranges = rp;
        for (int k = 0; k < 40; k++) { // 40 x 4 MiB of replies nobody reads
            h.request_id = 2 + (uint64_t)k;
            hl = zps__header__pack(&h, buf);
            zmq_send(sock, buf, hl, 0);
        }
    }
    /* pushes from the healthy trainer still go through, and the values are right */
    float *ref = zps_xmalloc(n * 4);
    memcpy(ref, v, n * 4);
    ps_ticket tk;
    for (int k = 0; k < 3; k++) {
        for (uint64_t i = 0; i < n; i++)
            g[i] = pst_uniform(&r);
        cr_assert_eq(ps_client_push(c, 0, 1, g, k, &tk), ZPS_OK);
        cr_assert_eq(ps_client_wait(c, tk), ZPS_OK, "%s", ps_client_last_error(c));
        ps_optim_apply(&o, (uint64_t)k, ref, NULL, g, n);
    }
    cr_assert_eq(ps_client_pull(c, 0, 1, v, -1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_OK);
    cr_assert(!memcmp(v, ref, n * 4), "values differ (seed %llu)", (unsigned long long)seed);
    char *json;
    cr_assert_eq(ps_client_stats(c, 0, &json), ZPS_OK);
    cr_expect(!strstr(json, "\"values_cow\":0"), "the stuck peer was never detected: %s", json);
    free(json);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    free(v);
    free(g);
    free(ref);
    ps_plan_destroy(&plan);
}
