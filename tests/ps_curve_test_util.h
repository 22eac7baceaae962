/* ps_curve_test_util.h — helpers shared by the CURVE suites (test_ps_curve.c: key files and
 * the allow-list; test_ps_curve_auth.c: who the servers admit; test_ps_curve_wire.c: what
 * crosses the wire). Each asserts on failure. */
#ifndef ZPS_TESTS_PS_CURVE_TEST_UTIL_H
#define ZPS_TESTS_PS_CURVE_TEST_UTIL_H

#include <stdint.h>
#include <sys/types.h>

#include "ps/client.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

/* path with text and mode (replaced when it exists). */
void pct_write(const char *path, const char *text, mode_t mode);
/* The first 64 KiB of path as a string (the caller frees it). */
char *pct_slurp(const char *path);
/* dir/name.key and dir/name.pub through the library. */
void pct_keygen(const char *dir, const char *name);
/* The public key of dir/name.pub, appended as a line to dir/allow.txt. */
void pct_allow(const char *dir, const char *name);
/* A client of uri; with keys (server_pub, name: dir/<server_pub>.pub and dir/<name>.key)
 * unless name is NULL. */
zps_status pct_client(const char *uri, const char *dir, const char *server_pub,
                      const char *name, uint32_t trainer, int hb_thread, ps_client **c);
/* Starts a CURVE server with dir/server.key and dir/allow.txt (sync, ntrainers trainers). */
void pct_curve_server(pst_server *srv, const char *dir, const char *ntrainers);
/* Register, init with values from the seed (or fill when not 0), push a gradient, pull:
 * the values must be what ps_optim_apply gives (tolerance 1e-7 + 1e-6 |ref|). */
void pct_train_round(ps_client *c, const ps_plan *plan, uint64_t seed, float fill);

#endif
