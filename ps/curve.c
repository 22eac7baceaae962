/* curve.c — see curve.h and docs/ps.md ("Security").
 *
 * Secrets: the text of a key pair file and every decoded secret are wiped (explicit_bzero)
 * before their memory is freed or goes out of scope; messages never quote a file's lines.
 */
#include "ps/curve.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/fileio.h"
#include "common/mem.h"

#define S_MAX_FILE (1 << 20)
#define S_ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define S_SEEN 64 /* refused keys remembered, so each is logged once */

static const char s_z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                            ".-:+=^!/*?&<>()[]{}@%$#";

static int s_z85_digit(char ch)
{
    const char *p = ch ? strchr(s_z85, ch) : NULL;
    return p ? (int)(p - s_z85) : -1;
}

int ps_curve_key_valid(const char *s, size_t len)
{
    if (len != PS_CURVE_KEY_LEN)
        return 0;
    for (size_t g = 0; g < len; g += 5) {
        uint64_t v = 0;
        for (size_t k = 0; k < 5; k++) {
            int d = s_z85_digit(s[g + k]);
            if (d < 0)
                return 0;
            v = v * 85 + (uint64_t)d;
        }
        if (v > UINT32_MAX)
            return 0;
    }
    return 1;
}

/* Reads a whole (small) file; *mode (may be NULL) gets its permission bits. *text is
 * NUL-terminated and the caller's (wipe and free). */
static zps_status s_read_file(const char *path, unsigned *mode, char **text, char *why,
                              size_t wl)
{
    *text = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        snprintf(why, wl, "cannot open %s: %s", path, strerror(e));
        return e == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) == -1 || !S_ISREG(sb.st_mode)) {
        snprintf(why, wl, "%s is not a regular file", path);
        close(fd);
        return ZPS_ERR_IO;
    }
    if (mode)
        *mode = (unsigned)(sb.st_mode & 07777);
    if (sb.st_size > S_MAX_FILE) {
        snprintf(why, wl, "%s is larger than %d bytes: not a key file", path, S_MAX_FILE);
        close(fd);
        return ZPS_ERR_PARSE;
    }
    size_t cap = (size_t)sb.st_size + 1;
    char *buf = zps_xmalloc(cap);
    ssize_t got = zps_read_full(fd, buf, cap - 1);
    if (got < 0) {
        snprintf(why, wl, "cannot read %s: %s", path, strerror(errno));
        explicit_bzero(buf, cap);
        free(buf);
        close(fd);
        return ZPS_ERR_IO;
    }
    size_t n = (size_t)got;
    close(fd);
    buf[n] = 0;
    if (strlen(buf) != n) {
        snprintf(why, wl, "%s contains NUL bytes: not a key file", path);
        explicit_bzero(buf, cap);
        free(buf);
        return ZPS_ERR_PARSE;
    }
    *text = buf;
    return ZPS_OK;
}

/* Line walker: *line, *len of the next line with blanks trimmed at both ends; *no counts
 * lines from 1. Returns 0 at the end. */
static int s_next_line(const char **at, const char **line, size_t *len, int *no)
{
    const char *p = *at;
    if (!*p)
        return 0;
    const char *e = strchr(p, '\n');
    const char *end = e ? e : p + strlen(p);
    *at = e ? e + 1 : end;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    while (end > p && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    *line = p;
    *len = (size_t)(end - p);
    (*no)++;
    return 1;
}

static size_t s_token_len(const char *s, size_t len)
{
    size_t k = 0;
    while (k < len && s[k] != ' ' && s[k] != '\t')
        k++;
    return k;
}

/* ------------------------------------------------------------------------- allow-list */

struct ps_curve_allow {
    uint8_t (*keys)[32]; // (n) binary public keys
    int32_t *ids;        // (n) the trainer id each key is bound to, -1 (any), PS_CURVE_ADMIN
    size_t n, cap, n_bound, n_admin;
};

/* After a key: "trainer=N" (N in 0..4095) or "admin" sets *id; anything else but a
 * comment is wrong. */
static int s_parse_binding(const char *rest, size_t rl, int32_t *id)
{
    *id = -1;
    while (rl && (*rest == ' ' || *rest == '\t'))
        rest++, rl--;
    if (rl >= 5 && !strncmp(rest, "admin", 5) &&
        (rl == 5 || rest[5] == ' ' || rest[5] == '\t' || rest[5] == '#')) {
        *id = PS_CURVE_ADMIN;
        rest += 5, rl -= 5;
        while (rl && (*rest == ' ' || *rest == '\t'))
            rest++, rl--;
    } else if (rl >= 8 && !strncmp(rest, "trainer=", 8)) {
        rest += 8, rl -= 8;
        int32_t v = 0;
        size_t d = 0;
        while (d < rl && rest[d] >= '0' && rest[d] <= '9' && v <= 4095)
            v = v * 10 + (rest[d++] - '0');
        if (!d || v > 4095)
            return -1;
        *id = v;
        rest += d, rl -= d;
        while (rl && (*rest == ' ' || *rest == '\t'))
            rest++, rl--;
    }
    return rl && *rest != '#' ? -1 : 0;
}

zps_status ps_curve_allow_parse(const char *text, const char *name, ps_curve_allow **out,
                                char *why, size_t wl)
{
    *out = NULL;
    ps_curve_allow *a = zps_xcalloc(1, sizeof *a);
    const char *at = text, *line;
    size_t len;
    int no = 0;
    zps_status st = ZPS_OK;
    while (st == ZPS_OK && s_next_line(&at, &line, &len, &no)) {
        if (!len || line[0] == '#') /* no key starts with '#' (curve.h) */
            continue;
        size_t tl = s_token_len(line, len);
        if (tl == PS_CURVE_KEY_LEN && ps_curve_key_valid(line, tl)) {
            int32_t id;
            if (s_parse_binding(line + tl, len - tl, &id)) {
                snprintf(why, wl,
                         "%s:%d: text after the key (want nothing, 'trainer=N' with N in "
                         "0..4095, 'admin', or a comment starting with '#')",
                         name, no);
                st = ZPS_ERR_PARSE;
                break;
            }
            char z[PS_CURVE_KEY_LEN + 1];
            memcpy(z, line, PS_CURVE_KEY_LEN);
            z[PS_CURVE_KEY_LEN] = 0;
            if (a->n == a->cap) {
                a->cap = a->cap ? 2 * a->cap : 16;
                a->keys = zps_xrealloc(a->keys, a->cap * sizeof *a->keys);
                a->ids = zps_xrealloc(a->ids, a->cap * sizeof *a->ids);
            }
            if (!zmq_z85_decode(a->keys[a->n], z)) {
                snprintf(why, wl, "%s:%d: the key does not decode", name, no);
                st = ZPS_ERR_PARSE;
                break;
            }
            int32_t had = ps_curve_allow_trainer(a, a->keys[a->n]);
            if (had != -2 && had != id) {
                snprintf(why, wl, "%s:%d: this key is listed before with another trainer binding "
                         "(%d there, %d here; -1: none)", name, no, (int)had, (int)id);
                st = ZPS_ERR_PARSE;
                break;
            }
            a->ids[a->n] = id;
            a->n_bound += id >= 0;
            a->n_admin += id == PS_CURVE_ADMIN;
            a->n++;
            continue;
        }
        if ((len >= 6 && !strncmp(line, "secret", 6)) || (len >= 6 && !strncmp(line, "public", 6)))
            snprintf(why, wl,
                     "%s:%d: this is a key pair file (PREFIX.key); give public keys only, one "
                     "per line (the PREFIX.pub files)",
                     name, no);
        else if (tl == PS_CURVE_KEY_LEN)
            snprintf(why, wl,
                     "%s:%d: not a CURVE public key (40 characters, but not valid Z85)", name, no);
        else
            snprintf(why, wl,
                     "%s:%d: not a CURVE public key (want 40 Z85 characters, got %zu)", name, no,
                     tl);
        st = ZPS_ERR_PARSE;
    }
    if (st == ZPS_OK && a->n == 0) {
        snprintf(why, wl, "%s lists no keys (one Z85 public key per line)", name);
        st = ZPS_ERR_PARSE;
    }
    if (st != ZPS_OK) {
        ps_curve_allow_destroy(&a);
        return st;
    }
    *out = a;
    return ZPS_OK;
}

zps_status ps_curve_allow_load(const char *path, ps_curve_allow **out, char *why, size_t wl)
{
    *out = NULL;
    char *text;
    zps_status st = s_read_file(path, NULL, &text, why, wl);
    if (st != ZPS_OK)
        return st;
    st = ps_curve_allow_parse(text, path, out, why, wl);
    free(text);
    return st;
}

size_t ps_curve_allow_count(const ps_curve_allow *a) { return a ? a->n : 0; }

int ps_curve_allow_has(const ps_curve_allow *a, const uint8_t key[32])
{
    return ps_curve_allow_trainer(a, key) != -2;
}

int32_t ps_curve_allow_trainer(const ps_curve_allow *a, const uint8_t key[32])
{
    for (size_t i = 0; i < a->n; i++)
        if (!memcmp(a->keys[i], key, 32))
            return a->ids[i];
    return -2;
}

size_t ps_curve_allow_bound(const ps_curve_allow *a) { return a ? a->n_bound : 0; }

size_t ps_curve_allow_admins(const ps_curve_allow *a) { return a ? a->n_admin : 0; }

void ps_curve_allow_destroy(ps_curve_allow **pa)
{
    if (!pa || !*pa)
        return;
    free((*pa)->keys);
    free((*pa)->ids);
    free(*pa);
    *pa = NULL;
}

/* ------------------------------------------------------------------------- key files */

zps_status ps_curve_load_public(const char *path, char pub[PS_CURVE_KEY_LEN + 1], char *why,
                                size_t wl)
{
    pub[0] = 0;
    ps_curve_allow *a;
    zps_status st = ps_curve_allow_load(path, &a, why, wl);
    if (st != ZPS_OK)
        return st;
    if (a->n != 1) {
        snprintf(why, wl, "%s holds %zu keys; want exactly one public key (a .pub file)", path,
                 a->n);
        ps_curve_allow_destroy(&a);
        return ZPS_ERR_PARSE;
    }
    zmq_z85_encode(pub, a->keys[0], 32);
    ps_curve_allow_destroy(&a);
    return ZPS_OK;
}

zps_status ps_curve_load_keypair(const char *path, char pub[PS_CURVE_KEY_LEN + 1],
                                 char sec[PS_CURVE_KEY_LEN + 1], char *why, size_t wl)
{
    pub[0] = sec[0] = 0;
    char *text;
    unsigned mode = 0;
    zps_status st = s_read_file(path, &mode, &text, why, wl);
    if (st != ZPS_OK)
        return st;
    size_t tlen = strlen(text);
    const char *at = text, *line;
    size_t len;
    int no = 0, have_pub = 0, have_sec = 0;
    char given_pub[PS_CURVE_KEY_LEN + 1] = "";
    while (st == ZPS_OK && s_next_line(&at, &line, &len, &no)) {
        if (!len || line[0] == '#')
            continue;
        int is_sec = len >= 6 && !strncmp(line, "secret", 6);
        int is_pub = len >= 6 && !strncmp(line, "public", 6);
        const char *v = line + 6;
        size_t vl = len - 6;
        while (vl && (*v == ' ' || *v == '\t'))
            v++, vl--;
        if ((!is_sec && !is_pub) || !vl || *v != '=') {
            snprintf(why, wl, "%s:%d: expected 'public = KEY' or 'secret = KEY'%s", path, no,
                     ps_curve_key_valid(line, len) ? " (is this a .pub file? a key pair file "
                                                     "holds both keys)"
                                                   : "");
            st = ZPS_ERR_PARSE;
            break;
        }
        v++, vl--;
        while (vl && (*v == ' ' || *v == '\t'))
            v++, vl--;
        if ((is_sec && have_sec) || (is_pub && have_pub)) {
            snprintf(why, wl, "%s:%d: a second '%s' line", path, no, is_sec ? "secret" : "public");
            st = ZPS_ERR_PARSE;
            break;
        }
        if (!ps_curve_key_valid(v, vl)) {
            snprintf(why, wl, "%s:%d: the %s key is not 40 Z85 characters", path, no,
                     is_sec ? "secret" : "public");
            st = ZPS_ERR_PARSE;
            break;
        }
        memcpy(is_sec ? sec : given_pub, v, PS_CURVE_KEY_LEN);
        (is_sec ? sec : given_pub)[PS_CURVE_KEY_LEN] = 0;
        have_sec |= is_sec;
        have_pub |= is_pub;
    }
    explicit_bzero(text, tlen);
    free(text);
    if (st == ZPS_OK && !have_sec) {
        snprintf(why, wl, "%s has no 'secret = KEY' line: not a key pair file", path);
        st = ZPS_ERR_PARSE;
    }
    /* checked after parsing, so that a .pub given by mistake gets the message above */
    if (st == ZPS_OK && (mode & 077)) {
        snprintf(why, wl,
                 "%s holds a secret key but group or others may access it (mode %04o): "
                 "chmod 600 %s",
                 path, mode, path);
        st = ZPS_ERR_INVALID;
    }
    if (st == ZPS_OK && zmq_curve_public(pub, sec) == -1) {
        snprintf(why, wl, "%s: cannot derive the public key: %s", path, zmq_strerror(zmq_errno()));
        st = zmq_errno() == ENOTSUP ? ZPS_ERR_UNSUPPORTED : ZPS_ERR_PARSE;
    }
    if (st == ZPS_OK && have_pub && strcmp(pub, given_pub) != 0) {
        snprintf(why, wl, "%s: the public key does not belong to the secret key", path);
        st = ZPS_ERR_PARSE;
    }
    if (st != ZPS_OK) {
        explicit_bzero(sec, PS_CURVE_KEY_LEN + 1);
        pub[0] = 0;
    }
    return st;
}

/* Creates path exclusively with mode and writes text; on failure nothing is left behind. */
static zps_status s_write_new(const char *path, mode_t mode, const char *text, char *why,
                              size_t wl)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) {
        int e = errno;
        if (e == EEXIST)
            snprintf(why, wl, "%s exists; not overwriting a key (remove it first)", path);
        else
            snprintf(why, wl, "cannot create %s: %s", path, strerror(e));
        return e == EEXIST ? ZPS_ERR_EXISTS : ZPS_ERR_IO;
    }
    int bad = zps_write_full(fd, text, strlen(text)) == -1 || fsync(fd) == -1;
    int e = errno;
    if (close(fd) == -1)
        bad = 1;
    if (bad) {
        snprintf(why, wl, "cannot write %s: %s", path, strerror(e));
        unlink(path);
        return ZPS_ERR_IO;
    }
    return ZPS_OK;
}

zps_status ps_curve_keygen(const char *prefix, char *why, size_t wl)
{
    char kpath[4096], ppath[4096];
    if ((size_t)snprintf(kpath, sizeof kpath, "%s.key", prefix) >= sizeof kpath ||
        (size_t)snprintf(ppath, sizeof ppath, "%s.pub", prefix) >= sizeof ppath || !*prefix) {
        snprintf(why, wl, "bad key file prefix '%s'", prefix);
        return ZPS_ERR_INVALID;
    }
    if (access(ppath, F_OK) == 0) {
        snprintf(why, wl, "%s exists; not overwriting a key (remove it first)", ppath);
        return ZPS_ERR_EXISTS;
    }
    char pub[PS_CURVE_KEY_LEN + 1], sec[PS_CURVE_KEY_LEN + 1];
    if (zmq_curve_keypair(pub, sec) == -1) {
        snprintf(why, wl, "zmq_curve_keypair: %s (libzmq built without CURVE?)",
                 zmq_strerror(zmq_errno()));
        return ZPS_ERR_UNSUPPORTED;
    }
    char text[512];
    snprintf(text, sizeof text,
             "# zps CURVE key pair (zps-server --keygen). The secret key is its holder's "
             "identity:\n# keep this file private (mode 0600) and share %s.pub instead.\n"
             "public = %s\nsecret = %s\n",
             prefix, pub, sec);
    zps_status st = s_write_new(kpath, 0600, text, why, wl);
    explicit_bzero(text, sizeof text);
    explicit_bzero(sec, sizeof sec);
    if (st != ZPS_OK)
        return st;
    snprintf(text, sizeof text,
             "# zps CURVE public key (zps-server --keygen). Servers list trainers' keys in\n"
             "# --curve-allow (zps-ctl's as 'KEY admin'); trainers and zps-ctl name the\n"
             "# server's in --curve-server-key.\n%s\n",
             pub);
    st = s_write_new(ppath, 0644, text, why, wl);
    if (st != ZPS_OK)
        unlink(kpath);
    return st;
}

/* ------------------------------------------------------------------------- ZAP handler */

struct ps_curve_zap {
    void *rep;             // bound to S_ZAP_ENDPOINT (used by the thread only)
    void *mon;             // PAIR: the server socket's handshake failures (thread only)
    void *ctl_in;          // PAIR: the thread's end of the stop signal
    void *ctl_out;         // PAIR: destroy's end
    ps_curve_allow *allow; // NULL: any key
    pthread_t thread;
    int running;
    atomic_uint_fast64_t accepted, rejected, failed;
    uint8_t seen[S_SEEN][32]; // refused keys already logged (thread only)
    unsigned n_seen;
    int logged[4]; // kinds of handshake failure already logged (thread only)
};

/* Receives one multipart message into f (at most nf frames; extra frames are dropped).
 * Returns the number of frames, -1 on error. */
static int s_recv_frames(void *sock, zmq_msg_t *f, int nf)
{
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, 0) == -1) {
            zmq_msg_close(&m);
            for (int i = 0; i < n && i < nf; i++)
                zmq_msg_close(&f[i]);
            return -1;
        }
        more = zmq_msg_more(&m);
        if (n < nf) {
            f[n] = m;
        } else {
            zmq_msg_close(&m);
        }
        n++;
    }
    return n < nf ? n : nf;
}

static int s_frame_is(zmq_msg_t *m, const char *s)
{
    return zmq_msg_size(m) == strlen(s) && !memcmp(zmq_msg_data(m), s, strlen(s));
}

/* One ZAP request: frames version, request id, domain, address, routing id, mechanism,
 * credentials (CURVE: the client's 32-byte public key). Always answers (REP). */
static void s_zap_one(ps_curve_zap *z)
{
    zmq_msg_t f[8];
    int n = s_recv_frames(z->rep, f, 8);
    if (n < 0)
        return;
    const char *code = "400", *text = "key not in the allow-list";
    char z85[PS_CURVE_KEY_LEN + 1] = "", addr[64] = "?";
    int ok_req = n >= 7 && s_frame_is(&f[0], "1.0");
    if (!ok_req) {
        code = "500";
        text = "malformed ZAP request";
    } else if (!s_frame_is(&f[5], "CURVE") || zmq_msg_size(&f[6]) != 32) {
        text = "CURVE required";
    } else {
        const uint8_t *key = zmq_msg_data(&f[6]);
        zmq_z85_encode(z85, key, 32);
        size_t al = zmq_msg_size(&f[3]) < sizeof addr - 1 ? zmq_msg_size(&f[3]) : sizeof addr - 1;
        memcpy(addr, zmq_msg_data(&f[3]), al);
        addr[al] = 0;
        if (!z->allow || ps_curve_allow_has(z->allow, key)) {
            code = "200";
            text = "OK";
            atomic_fetch_add(&z->accepted, 1);
            zps_log(ZPS_DEBUG, "curve", "accepted key %.8s... from %s", z85, addr);
        } else {
            atomic_fetch_add(&z->rejected, 1);
            unsigned i = 0;
            while (i < z->n_seen && memcmp(z->seen[i], key, 32))
                i++;
            if (i == z->n_seen) {
                if (z->n_seen < S_SEEN)
                    memcpy(z->seen[z->n_seen++], key, 32);
                zps_log(ZPS_WARN, "curve",
                        "refused a client from %s: its key %.8s... is not in --curve-allow "
                        "(further refusals of this key are counted in STATS auth_rejected, "
                        "not logged)",
                        addr, z85);
            } else {
                zps_log(ZPS_DEBUG, "curve", "refused key %.8s... from %s again", z85, addr);
            }
        }
    }
    /* reply: version, request id, status code, status text, user id, metadata */
    zmq_send(z->rep, "1.0", 3, ZMQ_SNDMORE);
    if (n >= 2)
        zmq_send(z->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
    else
        zmq_send(z->rep, "", 0, ZMQ_SNDMORE);
    zmq_send(z->rep, code, 3, ZMQ_SNDMORE);
    zmq_send(z->rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(z->rep, code[0] == '2' ? z85 : "", code[0] == '2' ? strlen(z85) : 0, ZMQ_SNDMORE);
    zmq_send(z->rep, "", 0, 0);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
}

/* One monitor event of the server socket: a handshake that failed before ZAP was asked. */
static void s_monitor_one(ps_curve_zap *z)
{
    zmq_msg_t f[2];
    int n = s_recv_frames(z->mon, f, 2);
    if (n < 0)
        return;
    uint16_t ev = 0;
    uint32_t val = 0;
    if (n >= 1 && zmq_msg_size(&f[0]) >= 6) {
        memcpy(&ev, zmq_msg_data(&f[0]), 2);
        memcpy(&val, (char *)zmq_msg_data(&f[0]) + 2, 4);
    }
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
    if (ev != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && ev != ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        return;
    atomic_fetch_add(&z->failed, 1);
    /* kinds: 0 mechanism mismatch, 1 undecryptable, 2 other protocol error, 3 no detail */
    int kind = ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL                  ? 3
               : val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH ? 0
               : val == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC     ? 1
                                                                   : 2;
    static const char *const what[4] = {
        "refused a client without CURVE keys (security mechanism mismatch)",
        "a client's CURVE handshake did not decrypt: it uses another server public key",
        "a client failed the CURVE handshake (ZMTP protocol error)",
        "a client closed the connection during the handshake (no CURVE keys, or it does not "
        "accept this server's key)"};
    zps_log(z->logged[kind] ? ZPS_DEBUG : ZPS_WARN, "curve", "%s [0x%x]%s", what[kind], val,
            z->logged[kind] ? "" : "; further ones are only counted (STATS handshake_failed)");
    z->logged[kind] = 1;
}

static void *s_zap_main(void *arg)
{
    ps_curve_zap *z = arg;
    for (;;) {
        zmq_pollitem_t it[3] = {{z->rep, 0, ZMQ_POLLIN, 0},
                                {z->mon, 0, ZMQ_POLLIN, 0},
                                {z->ctl_in, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 3, -1) == -1) {
            if (zmq_errno() == EINTR)
                continue;
            zps_log(ZPS_ERROR, "curve", "ZAP handler: zmq_poll: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (it[2].revents & ZMQ_POLLIN)
            break;
        if (it[0].revents & ZMQ_POLLIN)
            s_zap_one(z);
        if (it[1].revents & ZMQ_POLLIN)
            s_monitor_one(z);
    }
    return NULL;
}

zps_status ps_curve_zap_new(void *ctx, void *sock, ps_curve_allow **allow, ps_curve_zap **out)
{
    *out = NULL;
    ps_curve_zap *z = zps_xcalloc(1, sizeof *z);
    z->allow = allow ? *allow : NULL;
    if (allow)
        *allow = NULL;
    char mon_ep[96], ctl_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://zps-curve-monitor-%p", (void *)z);
    snprintf(ctl_ep, sizeof ctl_ep, "inproc://zps-curve-control-%p", (void *)z);
    int zero = 0;
    z->rep = zmq_socket(ctx, ZMQ_REP);
    z->mon = zmq_socket(ctx, ZMQ_PAIR);
    z->ctl_in = zmq_socket(ctx, ZMQ_PAIR);
    z->ctl_out = zmq_socket(ctx, ZMQ_PAIR);
    if (!z->rep || !z->mon || !z->ctl_in || !z->ctl_out ||
        zmq_setsockopt(z->rep, ZMQ_LINGER, &zero, sizeof zero) == -1 ||
        zmq_bind(z->rep, S_ZAP_ENDPOINT) == -1 ||
        zmq_socket_monitor(sock, mon_ep,
                           ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) == -1 ||
        zmq_connect(z->mon, mon_ep) == -1 || zmq_bind(z->ctl_in, ctl_ep) == -1 ||
        zmq_connect(z->ctl_out, ctl_ep) == -1) {
        zps_log(ZPS_ERROR, "curve", "cannot start the ZAP handler: %s", zmq_strerror(zmq_errno()));
        ps_curve_zap_destroy(&z);
        return ZPS_ERR_ZMQ;
    }
    int rc = pthread_create(&z->thread, NULL, s_zap_main, z);
    if (rc != 0) {
        zps_log(ZPS_ERROR, "curve", "cannot start the ZAP thread: %s", strerror(rc));
        ps_curve_zap_destroy(&z);
        return ZPS_ERR_SYS;
    }
    z->running = 1;
    *out = z;
    return ZPS_OK;
}

const ps_curve_allow *ps_curve_zap_allow(const ps_curve_zap *z) { return z ? z->allow : NULL; }

void ps_curve_zap_counts(const ps_curve_zap *z, ps_curve_counts *out)
{
    out->accepted = atomic_load(&z->accepted);
    out->rejected = atomic_load(&z->rejected);
    out->handshake_failed = atomic_load(&z->failed);
}

void ps_curve_zap_destroy(ps_curve_zap **pz)
{
    if (!pz || !*pz)
        return;
    ps_curve_zap *z = *pz;
    if (z->running) {
        zmq_send(z->ctl_out, "", 0, 0);
        pthread_join(z->thread, NULL);
    }
    int zero = 0;
    void *socks[4] = {z->rep, z->mon, z->ctl_in, z->ctl_out};
    for (int i = 0; i < 4; i++)
        if (socks[i]) {
            zmq_setsockopt(socks[i], ZMQ_LINGER, &zero, sizeof zero);
            zmq_close(socks[i]);
        }
    ps_curve_allow_destroy(&z->allow);
    free(z);
    *pz = NULL;
}
