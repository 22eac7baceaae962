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
    uint64_t nonce; // the incarnation its requests carry by default (0: none)
} raw;

/* Which incarnation a case's request carries (docs/ps.md "Trainer identity"). */
enum { I_OWN, I_NONE, I_OTHER, I_NO_HOST, I_BAD_HOST };

/* Incarnation kind `which` of raw r into *inc; NULL for none. */
static const Zps__Incarnation *s_inc(const raw *r, int which, Zps__Incarnation *inc)
{
    zps__incarnation__init(inc);
    if (which == I_NONE || (which == I_OWN && !r->nonce))
        return NULL;
    inc->nonce = which == I_OWN ? r->nonce : 0x5eed5eed5eedull;
    inc->start_unix_ms = 1;
    inc->pid = 4242;
    inc->host = which == I_NO_HOST ? NULL : which == I_BAD_HOST ? "bad host" : "other-host";
    return inc;
}

/* The REGISTER fields of a request for plan (job j filled). */
static void s_register_fields(Zps__Header *h, Zps__JobConfig *j, const ps_plan *plan)
{
    zps__job_config__init(j);
    j->num_chunks = plan->n_chunks;
    j->num_servers = 1;
    j->chunk_bytes = plan->chunk_bytes;
    j->num_variables = (uint32_t)plan->n_vars;
    j->total_count = plan->total;
    h->plan_hash = plan->hash;
    h->job = j;
}

/* A DEALER connected to uri; rcvhwm > 0: a peer that holds at most that many replies and
 * a small kernel buffer (one that stops reading). */
static void s_raw_open(raw *r, const char *uri, int rcvhwm)
{
    memset(r, 0, sizeof *r);
    r->ctx = zmq_ctx_new();
    r->sock = zmq_socket(r->ctx, ZMQ_DEALER);
    int linger = 0, small = 4096;
    zmq_setsockopt(r->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (rcvhwm) {
        zmq_setsockopt(r->sock, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
        zmq_setsockopt(r->sock, ZMQ_RCVBUF, &small, sizeof small);
    }
    cr_assert_eq(zmq_connect(r->sock, uri), 0);
}

static void s_raw_close(raw *r)
{
    zmq_close(r->sock);
    zmq_ctx_term(r->ctx);
}

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

/* The headers s_hdr makes say Header.packed (one payload frame for all ranges). */
static int s_packed;

/* A request header for op with the given ranges and r's incarnation (inc: another one,
 * or I_NONE; REGISTER: with plan's job); returns packed bytes (caller frees). */
static uint8_t *s_hdr(raw *r, int op, uint32_t version, uint32_t trainer, int64_t step,
                      const Zps__KeyRange *ranges, int n, int is_reply, int inc,
                      const ps_plan *plan, size_t *len)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__Incarnation in;
    Zps__JobConfig j;
    Zps__KeyRange *rp[64];
    h.incarnation = (Zps__Incarnation *)s_inc(r, inc, &in);
    if (op == ZPS__OP__OP_REGISTER && plan)
        s_register_fields(&h, &j, plan);
    for (int i = 0; i < n; i++)
        rp[i] = (Zps__KeyRange *)&ranges[i];
    h.version = version;
    h.op = (Zps__Op)op;
    h.request_id = ++r->rid;
    h.trainer_id = trainer;
    h.step = step;
    if ((op == ZPS__OP__OP_CHECKPOINT || op == ZPS__OP__OP_SHUTDOWN) && step > 0) { // a cut
        h.cut = 1;
        h.cut_version = (uint64_t)step;
    }
    h.n_ranges = (size_t)n;
    h.ranges = rp;
    h.is_reply = is_reply;
    h.packed = s_packed;
    *len = zps__header__get_packed_size(&h);
    uint8_t *b = zps_xmalloc(*len + 1);
    zps__header__pack(&h, b);
    return b;
}

/* A current-version request of op from trainer 0 at step 0 with ranges kr[0..n) and
 * payload frames pl/pll[0..npl); returns the reply status as s_send_raw does. */
static int s_req(raw *r, int op, const Zps__KeyRange *kr, int n, const void *const *pl,
                 const size_t *pll, int npl, char *msg, size_t msg_len)
{
    size_t hl;
    uint8_t *h = s_hdr(r, op, ZPS_PROTOCOL_VERSION, 0, 0, kr, n, 0, I_OWN, NULL, &hl);
    int st = s_send_raw(r, h, hl, pl, pll, npl, msg, msg_len);
    free(h);
    return st;
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

/* A PUSH from trainer 0 at step 0 of values g[off, off + n) into [off, off + n) of key. */
static int s_push1(raw *r, uint32_t key, const float *g, uint64_t off, uint64_t n, char *msg,
                   size_t msg_len)
{
    Zps__KeyRange kr = s_kr(key, off, n * 4);
    const void *pl = g + off;
    size_t pll = n * 4;
    return s_req(r, ZPS__OP__OP_PUSH, &kr, 1, &pl, &pll, 1, msg, msg_len);
}

/* ---------------------------------------------------------------- the table */

enum { K0, K1, K_NONE };                 // chunk 0, chunk 1, a key no server holds
enum { P_GOOD, P_NAN, P_NINF, P_BF16_NAN, P_BF16_NINF }; // payload contents (s_payloads)
enum { M_HEADER, M_GARBAGE, M_TRUNCATED, M_EMPTY, M_ALL_CHUNKS_TWICE }; // request shapes

/* A byte count or offset: k + c0 x (chunk 0's values), modulo 2^64. */
typedef struct m_size {
    uint64_t k;
    int c0;
} m_size;

typedef struct m_range {
    int key;       // K0, K1, K_NONE
    m_size off;    // elements
    m_size len;    // bytes
    int dtype;     // 0: f32
} m_range;

typedef struct m_frame {
    int src;       // P_*
    m_size len;    // bytes
} m_frame;

/* One malformed request and the status its reply must carry. */
typedef struct m_case {
    const char *name;
    zps_status want;
    int shape;           // M_HEADER: a header with the fields below (M_*: the comment there)
    int op;              // Zps__Op
    uint32_t version_add; // added to ZPS_PROTOCOL_VERSION
    uint32_t trainer;
    int is_reply;
    int n_ranges;
    m_range r[2];
    int n_frames;
    m_frame f[2];
    int inc;             // I_*: the incarnation the request carries (default trainer 0's)
    const char *msg_has; // the reply's message contains it (NULL: not checked)
    int64_t step;        // the header's step (CHECKPOINT, SHUTDOWN: > 0 asks for a cut of it)
} m_case;

#define B(k) {(uint64_t)(k), 0}
#define R0(len) {K0, B(0), B(len), 0}
#define F(src, len) {src, B(len)}
#define PUSH1(...) .op = ZPS__OP__OP_PUSH, .n_ranges = 1, .r = {__VA_ARGS__}
#define GOOD1 .n_frames = 1, .f = {F(P_GOOD, 4096)}
#define BF16 ZPS__DTYPE__DTYPE_BF16

/* The server runs async with 2 trainers (0 registered) and --max-message-bytes 300000. */
static const m_case s_cases[] = {
    /* 64 bytes of 0xff: field 31 with wire type 7, which does not exist */
    {"garbage header", ZPS_ERR_PROTO, .shape = M_GARBAGE},
    /* cut 3 bytes short, inside the ranges */
    {"truncated header", ZPS_ERR_PROTO, .shape = M_TRUNCATED, PUSH1(R0(4096))},
    /* a header frame of 0 bytes decodes as version 0 */
    {"empty header", ZPS_ERR_VERSION, .shape = M_EMPTY},
    {"wrong protocol version", ZPS_ERR_VERSION, .version_add = 7, PUSH1(R0(4096)), GOOD1},
    {"unknown op", ZPS_ERR_OP, .op = 99},
    {"a reply sent as a request", ZPS_ERR_OP, .is_reply = 1, PUSH1(R0(4096)), GOOD1},
    {"trainer id outside the job", ZPS_ERR_TRAINER, .trainer = 7, PUSH1(R0(4096)), GOOD1},
    {"unregistered trainer", ZPS_ERR_TRAINER, .trainer = 1, PUSH1(R0(4096)), GOOD1},
    {"fewer frames than ranges", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_PUSH, .n_ranges = 2,
     .r = {R0(4096), {K1, B(0), B(4096), 0}}, GOOD1},
    {"more frames than ranges", ZPS_ERR_FRAMES, PUSH1(R0(4096)), .n_frames = 2,
     .f = {F(P_GOOD, 4096), F(P_GOOD, 4096)}},
    {"frame shorter than its range", ZPS_ERR_FRAMES, PUSH1(R0(4096)), .n_frames = 1,
     .f = {F(P_GOOD, 4092)}},
    {"unknown key", ZPS_ERR_KEY, PUSH1({K_NONE, B(0), B(4096), 0}), GOOD1},
    {"range past the end of its chunk", ZPS_ERR_RANGE, PUSH1({K0, {(uint64_t)-10, 1}, B(4096), 0}),
     GOOD1},
    {"offset that overflows", ZPS_ERR_RANGE, PUSH1({K0, B(UINT64_MAX - 2), B(4096), 0}), GOOD1},
    {"length not a whole number of floats", ZPS_ERR_RANGE, PUSH1(R0(4094)), .n_frames = 1,
     .f = {F(P_GOOD, 4094)}},
    {"f16 dtype", ZPS_ERR_DTYPE, PUSH1({K0, B(0), B(4096), ZPS__DTYPE__DTYPE_F16}), GOOD1},
    /* bfloat16 is served for pushed gradients only: 2 bytes a value, finite */
    {"bf16 dtype on a pull", ZPS_ERR_DTYPE, .op = ZPS__OP__OP_PULL, .n_ranges = 1,
     .r = {{K0, B(0), B(4096), BF16}}},
    {"bf16 length not a whole number of values", ZPS_ERR_RANGE,
     PUSH1({K0, B(0), B(2047), BF16}), .n_frames = 1, .f = {F(P_GOOD, 2047)}},
    {"bf16 range one value past its chunk", ZPS_ERR_RANGE, PUSH1({K0, B(0), {2, 2}, BF16}),
     .n_frames = 1, .f = {{P_GOOD, {2, 2}}}},
    {"bf16 frame of half its range's bytes", ZPS_ERR_FRAMES, PUSH1({K0, B(0), B(2048), BF16}),
     .n_frames = 1, .f = {F(P_GOOD, 1024)}},
    {"NaN in bf16 gradients", ZPS_ERR_NONFINITE, PUSH1({K0, B(0), B(2048), BF16}),
     .n_frames = 1, .f = {F(P_BF16_NAN, 2048)}},
    {"-Inf in bf16 gradients (pushpull)", ZPS_ERR_NONFINITE, .op = ZPS__OP__OP_PUSHPULL,
     .n_ranges = 1, .r = {{K0, B(0), B(2048), BF16}}, .n_frames = 1, .f = {F(P_BF16_NINF, 2048)}},
    {"NaN in gradients", ZPS_ERR_NONFINITE, PUSH1(R0(4096)), .n_frames = 1, .f = {F(P_NAN, 4096)}},
    {"-Inf in gradients (pushpull)", ZPS_ERR_NONFINITE, .op = ZPS__OP__OP_PUSHPULL,
     .n_ranges = 1, .r = {R0(4096)}, .n_frames = 1, .f = {F(P_NINF, 4096)}},
    /* every chunk twice, whole: about 480 KB > --max-message-bytes 300000 */
    {"oversized message", ZPS_ERR_TOO_LARGE, .shape = M_ALL_CHUNKS_TWICE, .op = ZPS__OP__OP_PUSH},
    {"pull with a payload frame", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_PULL, .n_ranges = 1,
     .r = {R0(4096)}, GOOD1},
    {"pull of no ranges", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_PULL},
    {"heartbeat with a payload frame", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_HEARTBEAT, GOOD1},
    /* trainer identity: every request of a registered trainer carries its incarnation */
    {"push without an incarnation", ZPS_ERR_TRAINER, PUSH1(R0(4096)), GOOD1, .inc = I_NONE},
    {"push from another incarnation", ZPS_ERR_TRAINER, PUSH1(R0(4096)), GOOD1, .inc = I_OTHER,
     .msg_has = "incarnation 00005eed5eed5eed"},
    {"pull from another incarnation", ZPS_ERR_TRAINER, .op = ZPS__OP__OP_PULL, .n_ranges = 1,
     .r = {R0(4096)}, .inc = I_OTHER},
    {"heartbeat from another incarnation", ZPS_ERR_TRAINER, .op = ZPS__OP__OP_HEARTBEAT,
     .inc = I_OTHER},
    {"leave from another incarnation", ZPS_ERR_TRAINER, .op = ZPS__OP__OP_LEAVE, .inc = I_OTHER},
    {"REGISTER without an incarnation", ZPS_ERR_INVALID, .op = ZPS__OP__OP_REGISTER,
     .inc = I_NONE, .msg_has = "without an incarnation"},
    {"REGISTER with an incarnation without a host", ZPS_ERR_INVALID, .op = ZPS__OP__OP_REGISTER,
     .inc = I_NO_HOST},
    {"REGISTER with a host name that has a space", ZPS_ERR_INVALID, .op = ZPS__OP__OP_REGISTER,
     .inc = I_BAD_HOST, .msg_has = "printable"},
    /* trainer 0's client is live: a second process with its id is refused, named */
    {"REGISTER of a second live incarnation", ZPS_ERR_EXISTS, .op = ZPS__OP__OP_REGISTER,
     .inc = I_OTHER, .msg_has = "this REGISTER comes from host other-host pid 4242"},
    /* ROLLBACK: sync only, with a token; async here */
    {"rollback outside sync mode", ZPS_ERR_INVALID, .op = ZPS__OP__OP_ROLLBACK},
    {"rollback from an unregistered trainer", ZPS_ERR_TRAINER, .op = ZPS__OP__OP_ROLLBACK,
     .trainer = 1},
    {"rollback with a payload frame", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_ROLLBACK, GOOD1},
    /* the operator's ops (zps-ctl): a cut is sync only; no payloads */
    {"checkpoint cut outside sync mode", ZPS_ERR_UNSUPPORTED, .op = ZPS__OP__OP_CHECKPOINT,
     .step = 5, .msg_has = "needs sync mode"},
    {"shutdown cut outside sync mode", ZPS_ERR_UNSUPPORTED, .op = ZPS__OP__OP_SHUTDOWN,
     .step = 5, .msg_has = "needs sync mode"},
    {"checkpoint with a payload frame", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_CHECKPOINT, GOOD1},
    {"shutdown with a payload frame", ZPS_ERR_FRAMES, .op = ZPS__OP__OP_SHUTDOWN, GOOD1},
};

#undef B
#undef R0
#undef F
#undef PUSH1
#undef GOOD1
#undef BF16

/* The payloads a case can send, each at least 64 KiB + 16 bytes. */
typedef struct m_payloads {
    const void *p[5]; // by P_*
    void *own[5];
} m_payloads;

static void s_payloads(m_payloads *m, uint64_t *rng)
{
    const size_t bytes = 64 * 1024 + 16;
    for (int i = 0; i < 5; i++)
        m->p[i] = m->own[i] = zps_xmalloc(bytes);
    float *good = m->own[P_GOOD];
    for (size_t i = 0; i < bytes / 4; i++)
        good[i] = pst_uniform(rng);
    memcpy(m->own[P_NAN], good, bytes);
    memcpy(m->own[P_NINF], good, bytes);
    ((float *)m->own[P_NAN])[517] = NAN;
    ((float *)m->own[P_NINF])[1000] = -INFINITY;
    uint16_t *bn = m->own[P_BF16_NAN], *bi = m->own[P_BF16_NINF];
    for (size_t i = 0; i < bytes / 2; i++)
        bn[i] = bi[i] = 0x3f80; // 1.0
    bn[999] = 0x7fc0;           // NaN
    bi[7] = 0xff80;             // -Inf
}

static uint64_t s_size(m_size z, uint64_t chunk0) { return z.k + (uint64_t)z.c0 * chunk0; }

/* Sends case c; returns the reply's status (msg its message). */
static int s_run_case(raw *rw, const m_case *c, const ps_plan *plan, const m_payloads *pls,
                      char *msg, size_t msg_len)
{
    uint8_t junk[64];
    memset(junk, 0xff, sizeof junk);
    if (c->shape == M_GARBAGE)
        return s_send_raw(rw, junk, sizeof junk, NULL, NULL, 0, msg, msg_len);
    if (c->shape == M_EMPTY)
        return s_send_raw(rw, junk, 0, NULL, NULL, 0, msg, msg_len);
    const uint64_t chunk0 = plan->chunks[0].count;
    const uint32_t keys[3] = {plan->chunks[0].key, plan->chunks[1].key, plan->n_chunks + 5};
    Zps__KeyRange kr[64];
    const void *pl[64];
    size_t pll[64];
    int nr = c->n_ranges, nf = c->n_frames;
    for (int i = 0; i < nr; i++) {
        kr[i] = s_kr(keys[c->r[i].key], s_size(c->r[i].off, chunk0), s_size(c->r[i].len, chunk0));
        if (c->r[i].dtype)
            kr[i].dtype = (Zps__DType)c->r[i].dtype;
    }
    for (int i = 0; i < nf; i++) {
        pl[i] = pls->p[c->f[i].src];
        pll[i] = s_size(c->f[i].len, chunk0);
    }
    if (c->shape == M_ALL_CHUNKS_TWICE) {
        for (uint32_t k = 0; nr < 64 && k < 2 * plan->n_chunks; k++) {
            const ps_chunk *ch = &plan->chunks[k % plan->n_chunks];
            kr[nr] = s_kr(ch->key, 0, ch->count * 4);
            pl[nr] = pls->p[P_GOOD];
            pll[nr++] = ch->count * 4;
        }
        nf = nr;
        cr_assert(plan->chunks[0].count * 4 * (uint64_t)nr > 300000);
    }
    size_t hl;
    uint8_t *h = s_hdr(rw, c->op, ZPS_PROTOCOL_VERSION + c->version_add, c->trainer, c->step, kr, nr,
                       c->is_reply, c->inc, plan, &hl);
    int got = s_send_raw(rw, h, c->shape == M_TRUNCATED ? hl - 3 : hl, pl, pll, nf, msg, msg_len);
    free(h);
    return got;
}

/* Each case's status is counted under "rejected" in STATS, by its name. */
static void s_expect_counts(const char *json, int extra_already_init)
{
    for (int st = 1; st < ZPS_STATUS_COUNT; st++) {
        int n = st == -ZPS_ERR_ALREADY_INIT ? extra_already_init : 0;
        for (size_t i = 0; i < sizeof s_cases / sizeof *s_cases; i++)
            n += s_cases[i].want == -st;
        if (!n)
            continue;
        char want[96];
        snprintf(want, sizeof want, "\"%s\":%d", zps_status_name(-st), n);
        cr_expect(strstr(json, want), "want %s in %s", want, json);
    }
}

Test(it_ps_malformed, every_bad_request_gets_its_error_and_changes_nothing, .timeout = 30)
{
    uint64_t seed = pst_seed(), r = ~seed;
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv;
    const char *args[] = {"--mode", "async", "--num-trainers", "2", "--max-message-bytes", "300000", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    float *init = zps_xmalloc(n * 4), *v = zps_xmalloc(n * 4);
    ps_client *c = pst_client_init(srv.uri, plan, seed, init); // sgd, lr 0.01
    raw rw;
    s_raw_open(&rw, srv.uri, 0);
    rw.nonce = ps_client_incarnation(c); // the raw requests speak for trainer 0's client
    m_payloads pls;
    s_payloads(&pls, &r);
    char msg[512];
    const size_t n_cases = sizeof s_cases / sizeof *s_cases;
    for (size_t i = 0; i < n_cases; i++) {
        const m_case *mc = &s_cases[i];
        int got = s_run_case(&rw, mc, plan, &pls, msg, sizeof msg);
        cr_expect_eq(got, mc->want, "%s: got %d (%s) want %s; message '%s' (seed %llu)", mc->name,
                     got, zps_status_name(got) ? zps_status_name(got) : "?",
                     zps_status_name(mc->want), msg, (unsigned long long)seed);
        cr_expect(!mc->msg_has || strstr(msg, mc->msg_has), "%s: message '%s' lacks '%s'",
                  mc->name, msg, mc->msg_has);
    }
    /* a second INIT (first writer wins), through the client */
    for (uint64_t i = 0; i < n; i++)
        v[i] = pst_uniform(&r);
    ps_optim_config o;
    ps_optim_default(&o);
    int first = -1;
    cr_expect_eq(ps_client_init(c, v, &o, &first), ZPS_OK, "%s", ps_client_last_error(c));
    cr_expect_eq(first, 0, "second INIT: the server took it (seed %llu)", (unsigned long long)seed);

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
    snprintf(want, sizeof want, "\"rejected_total\":%zu,", n_cases + 1);
    cr_expect(strstr(json, want), "want %s in %s", want, json);
    s_expect_counts(json, 1);
    cr_expect(strstr(json, "\"updates\":0,"), "%s", json);
    free(json);

    s_raw_close(&rw);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    for (int i = 0; i < 5; i++)
        free(pls.own[i]);
    free(init);
    free(v);
    ps_plan_destroy(&plan);
}

/* One server in mode with one trainer (a client that initialised it: sgd, lr 0.01), the
 * initial values and random gradients, for the tests below. */
typedef struct s_one {
    uint64_t seed, n;
    ps_plan *plan;
    pst_server srv;
    float *init, *v, *gr;
    ps_client *c;
} s_one;

static void s_one_start(s_one *o, const char *mode)
{
    o->seed = pst_seed();
    cr_assert_eq(ps_plan_new(s_vars, 2, 1, 0, &o->plan), ZPS_OK);
    o->n = o->plan->total;
    const char *args[] = {"--mode", mode, "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&o->srv, NULL, args), 0);
    o->init = zps_xmalloc(o->n * 4), o->v = zps_xmalloc(o->n * 4), o->gr = zps_xmalloc(o->n * 4);
    o->c = pst_client_init(o->srv.uri, o->plan, o->seed, o->init);
    uint64_t r = ~o->seed;
    for (uint64_t i = 0; i < o->n; i++)
        o->gr[i] = pst_uniform(&r);
}

static void s_one_stop(s_one *o)
{
    ps_client_destroy(&o->c);
    pst_kill(&o->srv, SIGTERM);
    free(o->init), free(o->v), free(o->gr);
    ps_plan_destroy(&o->plan);
}

/* sync: a range overlapping elements the trainer already pushed for this step (in an
 * earlier request or earlier in the same one) is refused and changes nothing; the trainer's
 * other ranges still complete the chunk, which is then applied exactly once. */
Test(it_ps_malformed, sync_overlapping_ranges_are_refused, .timeout = 30)
{
    s_one o;
    s_one_start(&o, "sync");
    ps_plan *plan = o.plan;
    uint64_t seed = o.seed, n = o.n;
    float *init = o.init, *v = o.v, *gr = o.gr;
    ps_client *c = o.c;
    cr_assert_eq(plan->chunks[0].offset, 0u);
    const uint64_t cnt = plan->chunks[0].count;
    cr_assert(cnt >= 1024); // chunks of at least 1024 elements (ps/plan.h)
    const uint64_t q = cnt / 4;

    raw rw;
    s_raw_open(&rw, o.srv.uri, 0);
    rw.nonce = ps_client_incarnation(c);
    char msg[512];
    uint32_t key = plan->chunks[0].key;
    cr_assert_eq(s_push1(&rw, key, gr, 0, q, msg, sizeof msg), ZPS_OK, "%s", msg);
    cr_assert_eq(s_push1(&rw, key, gr, q / 2, q, msg, sizeof msg), ZPS_ERR_INVALID,
                 "overlap with an earlier request: %s", msg);
    cr_assert(strstr(msg, "more than once"), "%s", msg);
    /* two ranges in one request overlapping each other: refused, and the first one's
     * elements are not counted as pushed */
    Zps__KeyRange kr[2] = {s_kr(key, 2 * q, q * 4), s_kr(key, 2 * q + q / 2, q * 4)};
    const void *pl[2] = {gr + 2 * q, gr + 2 * q + q / 2};
    size_t pll[2] = {q * 4, q * 4};
    int got = s_req(&rw, ZPS__OP__OP_PUSH, kr, 2, pl, pll, 2, msg, sizeof msg);
    cr_assert_eq(got, ZPS_ERR_INVALID, "overlap inside one request: %s", msg);
    cr_assert_eq(s_push1(&rw, key, gr, q, 2 * q, msg, sizeof msg), ZPS_OK, "%s", msg);
    /* nothing applied yet: the chunk is not complete */
    ps_ticket tk;
    uint64_t ver = 99;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, -1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(c, tk, &ver), ZPS_OK);
    cr_assert_eq(ver, 0);
    cr_assert(!memcmp(v, init, n * 4), "values changed before the chunk was complete");
    cr_assert_eq(s_push1(&rw, key, gr, 3 * q, cnt - 3 * q, msg, sizeof msg), ZPS_OK, "%s", msg);
    for (uint32_t k = 1; k < plan->n_chunks; k++) { // the other chunks, whole
        const ps_chunk *ch = &plan->chunks[k];
        got = s_push1(&rw, ch->key, gr + ch->offset, 0, ch->count, msg, sizeof msg);
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
    s_raw_close(&rw);
    s_one_stop(&o);
}

/* Trainer 1 on r registers, then asks for 40 pulls of every chunk and never reads the
 * replies. */
static void s_stuck_peer(raw *r, const ps_plan *plan)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__JobConfig j;
    Zps__Incarnation in;
    r->nonce = 77;
    h.incarnation = (Zps__Incarnation *)s_inc(r, I_OWN, &in);
    s_register_fields(&h, &j, plan);
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = ZPS__OP__OP_REGISTER;
    h.request_id = 1;
    h.trainer_id = 1;
    uint8_t buf[512];
    size_t hl = zps__header__pack(&h, buf);
    cr_assert_eq(s_send_raw(r, buf, hl, NULL, NULL, 0, NULL, 0), ZPS_OK);
    Zps__KeyRange kr[64], *rp[64];
    size_t nr = plan->n_chunks < 64 ? plan->n_chunks : 64;
    for (size_t i = 0; i < nr; i++) {
        kr[i] = s_kr(plan->chunks[i].key, 0, plan->chunks[i].count * 4);
        rp[i] = &kr[i];
    }
    h.op = ZPS__OP__OP_PULL;
    h.job = NULL;
    in.host = NULL; // the nonce alone, as a client sends it
    in.pid = 0;
    h.step = -1;
    h.n_ranges = nr;
    h.ranges = rp;
    for (int k = 0; k < 40; k++) { // 40 x 4 MiB of replies nobody reads
        h.request_id = 2 + (uint64_t)k;
        hl = zps__header__pack(&h, buf);
        zmq_send(r->sock, buf, hl, 0);
    }
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
    raw peer;
    s_raw_open(&peer, srv.uri, 1);
    s_stuck_peer(&peer, plan);
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
    s_raw_close(&peer);
    ps_client_destroy(&c);
    pst_kill(&srv, SIGTERM);
    free(v);
    free(g);
    free(ref);
    ps_plan_destroy(&plan);
}

/* Header.packed: the ranges' bytes in one payload frame. A frame count or a size that
 * disagrees with the ranges is refused ZPS_ERR_FRAMES and changes nothing; a good one lands
 * each range where a frame per range would (read back by the client's own packed pulls). */
Test(it_ps_malformed, packed_payloads, .timeout = 30)
{
    s_one o;
    s_one_start(&o, "async");
    ps_plan *plan = o.plan;
    uint64_t seed = o.seed, n = o.n;
    float *init = o.init, *v = o.v, *gr = o.gr, *pk = zps_xmalloc(n * 4);
    ps_client *c = o.c;
    const uint64_t q = plan->chunks[0].count / 4;
    uint32_t key = plan->chunks[0].key;
    raw rw;
    s_raw_open(&rw, o.srv.uri, 0);
    rw.nonce = ps_client_incarnation(c);
    char msg[512];
    Zps__KeyRange kr[2] = {s_kr(key, 0, q * 4), s_kr(key, 2 * q, q * 4)};
    memcpy(pk, gr, q * 4);
    memcpy(pk + q, gr + 2 * q, q * 4);
    s_packed = 1;
    const void *pl[2] = {pk, pk + q};
    size_t short_len = 2 * q * 4 - 4, pll[2] = {q * 4, q * 4}, all = 2 * q * 4;
    int got = s_req(&rw, ZPS__OP__OP_PUSH, kr, 2, pl, &short_len, 1, msg, sizeof msg);
    cr_assert_eq(got, ZPS_ERR_FRAMES, "a packed payload 4 bytes short: %s", msg);
    got = s_req(&rw, ZPS__OP__OP_PUSH, kr, 2, pl, pll, 2, msg, sizeof msg);
    cr_assert_eq(got, ZPS_ERR_FRAMES, "two payload frames, packed: %s", msg);
    got = s_req(&rw, ZPS__OP__OP_PUSH, kr, 2, pl, &all, 1, msg, sizeof msg);
    cr_assert_eq(got, ZPS_OK, "%s", msg);
    s_packed = 0;
    ps_ticket tk;
    cr_assert_eq(ps_client_pull(c, 0, 2, v, -1, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(c, tk), ZPS_OK);
    for (uint64_t i = 0; i < n; i++) {
        int pushed = i < q || (i >= 2 * q && i < 3 * q);
        float want = pushed ? init[i] - 0.01f * gr[i] : init[i];
        cr_assert(v[i] == want, "value %llu: %.9g, want %.9g (seed %llu)", (unsigned long long)i,
                  v[i], want, (unsigned long long)seed);
    }
    s_raw_close(&rw);
    free(pk);
    s_one_stop(&o);
}
