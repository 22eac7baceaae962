/* test_ps_curve.c — CURVE key files and the allow-list (ps/curve.h, docs/ps.md "Security").
 *
 * ps_curve (unit, no processes): key validity, the allow-list parser, keygen round trip and
 * its refusal to overwrite, bad key files rejected with the file named, and the client's
 * refusal of a partial key set or bad options. The process suites are it_ps_curve in
 * test_ps_curve_auth.c (who the servers admit) and test_ps_curve_wire.c (what crosses the
 * wire).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "ps/client.h"
#include "ps/curve.h"
#include "tests/ps_curve_test_util.h"
#include "tests/testutil.h"

Test(ps_curve, key_validity)
{
    char pub[41], sec[41];
    cr_assert_eq(zmq_curve_keypair(pub, sec), 0);
    cr_assert(ps_curve_key_valid(pub, 40));
    cr_assert(ps_curve_key_valid(sec, 40));
    cr_assert_not(ps_curve_key_valid(pub, 39), "short");
    char bad[41];
    memcpy(bad, pub, 41);
    bad[7] = '"'; /* not in the Z85 alphabet */
    cr_assert_not(ps_curve_key_valid(bad, 40));
    memset(bad, '#', 40); /* Z85 characters, but each group of 5 exceeds 2^32 - 1 */
    cr_assert_not(ps_curve_key_valid(bad, 40));
}

/* A fresh public key holding '#' into key. '#' is a Z85 character: a key may hold it, just
 * never first (a group starting with '#' would exceed 2^32), so '#' lines are comments and
 * '#' inside a key is not. */
static void s_key_with_hash(char key[41])
{
    char sec[41];
    key[0] = 0;
    for (int tries = 0; tries < 100000 && !key[0]; tries++) {
        char p[41];
        cr_assert_eq(zmq_curve_keypair(p, sec), 0);
        cr_assert_neq(p[0], '#');
        if (strchr(p, '#'))
            memcpy(key, p, 41);
    }
    cr_assert_eq(strlen(key), 40, "no key holding '#' in 100000 tries");
}

/* Trainer bindings: "KEY trainer=N", with or without a comment; unbound keys stay -1; a key
 * listed twice must say the same. k: three allowed keys, other: one not listed. */
static void s_check_bindings(char k[3][41], const char *other)
{
    char text[1024], why[512] = "";
    uint8_t bin[32];
    ps_curve_allow *a = NULL;
    snprintf(text, sizeof text, "%s trainer=0\n%s\ttrainer=4095   # the last one\n%s\n%s trainer=0\n",
             k[0], k[1], k[2], k[0]);
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[0])), 0);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[1])), 4095);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[2])), -1);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, other)), -2);
    cr_assert_eq(ps_curve_allow_bound(a), 3);
    ps_curve_allow_destroy(&a);
    const char *conflicts[][2] = {{"trainer=0", "trainer=7"}, {"trainer=2", ""}, {"", "trainer=2"}};
    for (size_t i = 0; i < sizeof conflicts / sizeof *conflicts; i++) {
        snprintf(text, sizeof text, "%s %s\n%s\n%s %s\n", k[0], conflicts[i][0], k[1], k[0],
                 conflicts[i][1]);
        cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_ERR_PARSE,
                     "conflict %zu accepted", i);
        cr_assert_not_null(strstr(why, "allow.txt:3: this key is listed before with another "
                                       "trainer binding"), "%s", why);
    }
}

/* Operator keys: "KEY admin" (zps-ctl), with or without a comment; counted apart from
 * trainer bindings. */
static void s_check_admin(char k[3][41])
{
    char text[1024], why[512] = "";
    uint8_t bin[32];
    ps_curve_allow *a = NULL;
    snprintf(text, sizeof text, "%s admin\n%s\tadmin  # zps-ctl\n%s trainer=3\n", k[0], k[1], k[2]);
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[0])), PS_CURVE_ADMIN);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[1])), PS_CURVE_ADMIN);
    cr_assert_eq(ps_curve_allow_trainer(a, zmq_z85_decode(bin, k[2])), 3);
    cr_assert_eq(ps_curve_allow_admins(a), 2);
    cr_assert_eq(ps_curve_allow_bound(a), 1);
    ps_curve_allow_destroy(&a);
    snprintf(text, sizeof text, "%s admin\n%s trainer=0\n", k[0], k[0]);
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_ERR_PARSE,
                 "a key both admin and trainer 0's");
}

Test(ps_curve, allow_list_parser)
{
    char k[3][41], sec[41];
    for (int i = 0; i < 3; i++)
        cr_assert_eq(zmq_curve_keypair(k[i], sec), 0);
    char hashkey[41];
    s_key_with_hash(hashkey);
    char comment[41];
    memcpy(comment, hashkey, 41);
    comment[0] = '#'; /* 40 characters, the rest Z85: still a comment */
    char text[1024];
    snprintf(text, sizeof text,
             "# trainers of job x\r\n"
             "\n"
             "  %s  \r\n"
             "%s # trainer 1\n"
             "\t# indented comment\n"
             "%s\n"
             "%s\n"
             "%s", /* last line without a newline */
             k[0], k[1], comment, hashkey, k[2]);
    char why[512] = "";
    ps_curve_allow *a = NULL;
    cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_allow_count(a), 4);
    uint8_t bin[32];
    for (int i = 0; i < 3; i++)
        cr_assert(ps_curve_allow_has(a, zmq_z85_decode(bin, k[i])), "key %d missing", i);
    cr_assert(ps_curve_allow_has(a, zmq_z85_decode(bin, hashkey)));
    char other[41];
    cr_assert_eq(zmq_curve_keypair(other, sec), 0);
    cr_assert_not(ps_curve_allow_has(a, zmq_z85_decode(bin, other)));
    ps_curve_allow_destroy(&a);
    cr_assert_null(a);

    static const struct {
        const char *text, *want;
    } bad[] = {
        {"# nothing\n\n", "allow.txt lists no keys"},
        {"", "allow.txt lists no keys"},
        {"# a\nshortkey\n", "allow.txt:2: not a CURVE public key (want 40 Z85 characters, got 8)"},
        {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"\n", "allow.txt:1: not a CURVE public key (40 characters, but not valid Z85)"},
        {"secret = x\n", "allow.txt:1: this is a key pair file"},
        {"public = x\n", "allow.txt:1: this is a key pair file"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        why[0] = 0;
        cr_assert_eq(ps_curve_allow_parse(bad[i].text, "allow.txt", &a, why, sizeof why),
                     ZPS_ERR_PARSE, "case %zu accepted", i);
        cr_assert_null(a);
        cr_assert_not_null(strstr(why, bad[i].want), "case %zu: '%s' not in '%s'", i,
                           bad[i].want, why);
    }
    /* text after a key that is neither a binding nor a comment */
    const char *after[] = {"trainer-1", "trainer=", "trainer=4096", "trainer=x", "trainer=3 x",
                           "trainer=-1", "admins", "admin x", "admin trainer=1"};
    for (size_t i = 0; i < sizeof after / sizeof *after; i++) {
        snprintf(text, sizeof text, "%s %s\n", k[0], after[i]);
        cr_assert_eq(ps_curve_allow_parse(text, "allow.txt", &a, why, sizeof why), ZPS_ERR_PARSE,
                     "'%s' accepted", after[i]);
        cr_assert_not_null(strstr(why, "allow.txt:1: text after the key"), "%s", why);
    }

    s_check_bindings(k, other);
    s_check_admin(k);
}

Test(ps_curve, keygen_round_trip_and_no_overwrite)
{
    char dir[256], prefix[300], kpath[320], ppath[320], why[1024];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    snprintf(prefix, sizeof prefix, "%s/t0", dir);
    snprintf(kpath, sizeof kpath, "%s.key", prefix);
    snprintf(ppath, sizeof ppath, "%s.pub", prefix);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_OK, "%s", why);
    struct stat sk, sp;
    cr_assert_eq(stat(kpath, &sk), 0);
    cr_assert_eq(stat(ppath, &sp), 0);
    cr_assert_eq(sk.st_mode & 0777, 0600, "key pair mode %o", sk.st_mode & 0777);
    cr_assert_eq(sp.st_mode & 0022, 0, "public key mode %o", sp.st_mode & 0777);
    char pub[41], sec[41], pub2[41], derived[41];
    cr_assert_eq(ps_curve_load_keypair(kpath, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(ps_curve_load_public(ppath, pub2, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, pub2);
    cr_assert_eq(zmq_curve_public(derived, sec), 0);
    cr_assert_str_eq(derived, pub);
    char *pub_text = pct_slurp(ppath);
    cr_assert_null(strstr(pub_text, sec), "the .pub file holds the secret key");
    char *before = pct_slurp(kpath);
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_ERR_EXISTS);
    cr_assert_not_null(strstr(why, ppath), "%s", why);
    unlink(ppath); /* only the .key left: still refused, and the .pub is not recreated */
    cr_assert_eq(ps_curve_keygen(prefix, why, sizeof why), ZPS_ERR_EXISTS);
    cr_assert_not_null(strstr(why, kpath), "%s", why);
    cr_assert_neq(access(ppath, F_OK), 0);
    char *after = pct_slurp(kpath);
    cr_assert_str_eq(before, after, "the key pair was overwritten");
    free(pub_text);
    free(before);
    free(after);
    zt_rmtmp(dir);
}

Test(ps_curve, bad_key_files_name_the_file)
{
    char dir[256], why[1024], pub[41], sec[41], k[41], s[41], path[320], text[512];
    zt_mktmp(dir, sizeof dir, "zps-curve");
    cr_assert_eq(zmq_curve_keypair(k, s), 0);
    char other[41], osec[41];
    cr_assert_eq(zmq_curve_keypair(other, osec), 0);

    snprintf(path, sizeof path, "%s/missing.key", dir);
    cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(why, path), "%s", why);
    cr_assert_eq(ps_curve_load_public(path, pub, why, sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(why, path), "%s", why);

    static const struct {
        const char *fmt;
        mode_t mode;
        zps_status st;
        const char *want;
    } cases[] = {
        {"public = %1$s\nsecret = %2$s\n", 0644, ZPS_ERR_INVALID, "group or others may access it (mode 0644)"},
        {"public = %1$s\nsecret = %2$s\n", 0604, ZPS_ERR_INVALID, "(mode 0604)"},
        {"public = %1$s\nsecret = %2$.39s\n", 0600, ZPS_ERR_PARSE, ":2: the secret key is not 40 Z85 characters"},
        {"public = %1$s\nsecret = %2$.39s\"\n", 0600, ZPS_ERR_PARSE, ":2: the secret key is not 40 Z85 characters"},
        {"public = %3$s\nsecret = %2$s\n", 0600, ZPS_ERR_PARSE, "the public key does not belong to the secret key"},
        {"public = %1$s\n", 0600, ZPS_ERR_PARSE, "no 'secret = KEY' line"},
        {"%1$s\n", 0600, ZPS_ERR_PARSE, ":1: expected 'public = KEY' or 'secret = KEY' (is this a .pub file?"},
        {"secret = %2$s\nsecret = %2$s\n", 0600, ZPS_ERR_PARSE, ":2: a second 'secret' line"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(path, sizeof path, "%s/case%zu.key", dir, i);
        snprintf(text, sizeof text, cases[i].fmt, k, s, other);
        pct_write(path, text, cases[i].mode);
        why[0] = 0;
        cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), cases[i].st,
                     "case %zu: %s", i, why);
        cr_assert_not_null(strstr(why, path), "case %zu: file not named: %s", i, why);
        cr_assert_not_null(strstr(why, cases[i].want), "case %zu: '%s' not in '%s'", i,
                           cases[i].want, why);
        cr_assert_null(strstr(why, s), "case %zu: the message quotes the secret key", i);
        cr_assert_eq(sec[0], 0, "case %zu: a secret was returned on failure", i);
    }
    /* a secret-less file may be readable by anyone; only the secret is protected */
    snprintf(path, sizeof path, "%s/ok.key", dir);
    snprintf(text, sizeof text, "# mine\nsecret = %s\n", s);
    pct_write(path, text, 0600);
    cr_assert_eq(ps_curve_load_keypair(path, pub, sec, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_str_eq(pub, k, "public key derived from the secret");
    /* a public key file with two keys is not a .pub */
    snprintf(path, sizeof path, "%s/two.pub", dir);
    snprintf(text, sizeof text, "%s\n%s\n", k, other);
    pct_write(path, text, 0644);
    cr_assert_eq(ps_curve_load_public(path, pub, why, sizeof why), ZPS_ERR_PARSE);
    cr_assert_not_null(strstr(why, "holds 2 keys"), "%s", why);
    cr_assert_not_null(strstr(why, path), "%s", why);
    zt_rmtmp(dir);
}

Test(ps_curve, client_wants_all_three_keys)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    char sec[41];
    cr_assert_eq(zmq_curve_keypair(o.curve_server_key, sec), 0);
    const char *uris[1] = {"tcp://127.0.0.1:9"};
    ps_client *c = NULL;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "server key alone");
    cr_assert_null(c);
    cr_assert_eq(zmq_curve_keypair(o.curve_public_key, o.curve_secret_key), 0);
    o.curve_secret_key[5] = '"';
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "bad Z85");
    cr_assert_eq(zmq_curve_keypair(o.curve_public_key, o.curve_secret_key), 0);
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
}

Test(ps_curve, client_refuses_bad_streams_and_push_dtype)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    const char *uris[1] = {"tcp://127.0.0.1:9"};
    ps_client *c = NULL;
    static const int bad[] = {0, 9};
    for (int k = 0; k < 2; k++) {
        o.streams = bad[k];
        cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID, "streams %d", o.streams);
        cr_assert_null(c);
    }
    o.streams = 8;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
    o.push_dtype = (ps_dtype)2; // neither f32 nor bf16
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_ERR_INVALID);
    cr_assert_null(c);
    o.push_dtype = PS_DTYPE_BF16;
    cr_assert_eq(ps_client_new(uris, 1, 0, &o, &c), ZPS_OK);
    ps_client_destroy(&c);
}
