/* curve.h — CURVE key files, the trainer allow-list and the server's ZAP handler.
 *
 * ZeroMQ's CURVE mechanism (CurveZMQ) authenticates both ends of a connection with
 * Curve25519 key pairs and encrypts every frame after the handshake. zps keeps keys as Z85
 * text (40 characters for a 32-byte key):
 *   PREFIX.key  a key pair, mode 0600: lines "public = KEY" and "secret = KEY"
 *   PREFIX.pub  the public key alone: one line "KEY"
 * An allow-list holds one public key per line, with '#' comment lines and blank lines, so
 * `cat trainer-*.pub > allow.txt` makes one; `KEY  # comment` is allowed too, and
 * `KEY trainer=N` binds the key to trainer id N: the server then refuses any request made
 * with that key that says another trainer id (ZPS_ERR_UNAUTHORIZED); `KEY admin` makes the
 * key an operator's (zps-ctl): once any key is one, CHECKPOINT and SHUTDOWN need such a key
 * (or, for SHUTDOWN, trainer 0's), and an admin key sends nothing but STATS, CHECKPOINT and
 * SHUTDOWN (docs/ps.md "Admin ops"). ('#' is a Z85
 * character, but never the first of a key: a 5-character group starting with '#' would
 * exceed 2^32, so a line starting with '#' is always a comment.)
 *
 * Readers check everything and say what is wrong with which file (and line) in `why`: a
 * missing file, a key of the wrong length or alphabet, a key pair whose halves do not
 * belong together, a key pair file that group or others may access. They never copy a
 * secret into a message.
 *
 * The ZAP handler (ZeroMQ RFC 27) is a thread with a REP socket bound to
 * inproc://zeromq.zap.01 on the server's context. libzmq asks it about every CURVE
 * handshake the server's socket sees; it answers 200 for a key in the allow-list (any key
 * when there is none) and 400 otherwise. The first refusal of each key is logged with its
 * first characters, every refusal is counted. The same thread reads the server socket's
 * monitor for handshakes that fail before ZAP is asked (a client without CURVE, a client
 * using another server key) and counts them. A thread rather than the server loop, so a
 * handshake is answered even while the loop applies a large push, and so the loop is
 * unchanged when CURVE is off.
 */
#ifndef ZPS_PS_CURVE_H
#define ZPS_PS_CURVE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Z85 characters of a 32-byte key; key strings are this plus a NUL. */
#define PS_CURVE_KEY_LEN 40

/* 1 when s[0..len) is a Z85 CURVE key: 40 characters of the Z85 alphabet whose 5-character
 * groups each encode a value below 2^32. */
int ps_curve_key_valid(const char *s, size_t len);

/* Writes a new key pair to PREFIX.key (mode 0600) and its public key to PREFIX.pub.
 * Refuses to overwrite either file (ZPS_ERR_EXISTS, nothing written). */
zps_status ps_curve_keygen(const char *prefix, char *why, size_t why_len);

/* Reads a key pair file into pub and sec (Z85, NUL-terminated). The "public" line may be
 * left out (it is derived); when present it must belong to the secret key. Errors:
 * ZPS_ERR_NOT_FOUND / ZPS_ERR_IO (file), ZPS_ERR_INVALID (group/other access),
 * ZPS_ERR_PARSE (content). */
zps_status ps_curve_load_keypair(const char *path, char pub[PS_CURVE_KEY_LEN + 1],
                                 char sec[PS_CURVE_KEY_LEN + 1], char *why, size_t why_len);

/* Reads a public key file (exactly one key, the format of an allow-list), e.g. the
 * server's .pub for a trainer. */
zps_status ps_curve_load_public(const char *path, char pub[PS_CURVE_KEY_LEN + 1], char *why,
                                size_t why_len);

typedef struct ps_curve_allow ps_curve_allow;

/* Parses allow-list text; name (a file name) prefixes every message. At least one key.
 * *out is the caller's (ps_curve_allow_destroy). */
zps_status ps_curve_allow_parse(const char *text, const char *name, ps_curve_allow **out,
                                char *why, size_t why_len);
zps_status ps_curve_allow_load(const char *path, ps_curve_allow **out, char *why,
                               size_t why_len);
size_t ps_curve_allow_count(const ps_curve_allow *a);
/* 1 when the binary key is listed. */
int ps_curve_allow_has(const ps_curve_allow *a, const uint8_t key[32]);
/* The role of an operator's key ("KEY admin"). */
#define PS_CURVE_ADMIN (-3)

/* The trainer id key is bound to ("KEY trainer=N"), -1 when it may speak for any trainer,
 * -2 when it is not in the list, PS_CURVE_ADMIN for an operator's key. */
int32_t ps_curve_allow_trainer(const ps_curve_allow *a, const uint8_t key[32]);
/* How many keys are bound to a trainer id (0 for NULL). */
size_t ps_curve_allow_bound(const ps_curve_allow *a);
/* How many keys are operators' (0 for NULL). */
size_t ps_curve_allow_admins(const ps_curve_allow *a);
void ps_curve_allow_destroy(ps_curve_allow **pa);

typedef struct ps_curve_zap ps_curve_zap;

/* Starts the ZAP handler on ctx for server socket sock (not yet bound): binds
 * inproc://zeromq.zap.01, starts monitoring sock's handshakes, starts the thread. Consumes
 * *allow (NULL: accept any key). Errors: ZPS_ERR_ZMQ (e.g. a second handler on ctx),
 * ZPS_ERR_SYS (thread). */
zps_status ps_curve_zap_new(void *ctx, void *sock, ps_curve_allow **allow,
                            ps_curve_zap **out);

typedef struct ps_curve_counts {
    uint64_t accepted;         // ZAP answered 200
    uint64_t rejected;         // ZAP answered 400: key not in the allow-list
    uint64_t handshake_failed; // failed before ZAP: no CURVE on the client, wrong server key
} ps_curve_counts;

/* The allow-list the handler consumed (NULL: any key). It never changes, so the server
 * loop may read it while the handler runs. */
const ps_curve_allow *ps_curve_zap_allow(const ps_curve_zap *z);
/* Safe from any thread while the handler runs. */
void ps_curve_zap_counts(const ps_curve_zap *z, ps_curve_counts *out);
/* Stops and joins the thread, closes its sockets. Call before zmq_ctx_term. */
void ps_curve_zap_destroy(ps_curve_zap **pz);

#endif
