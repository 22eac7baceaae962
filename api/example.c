/* example.c — the C API of libzps.so in one page (docs/ps.md "C API"): one trainer of a sync
 * job trains y = w * x for three steps against the servers named on the command line.
 *   cc example.c $(pkg-config --cflags --libs zps) -o example
 *   ./example tcp://127.0.0.1:PORT [more servers...]
 * tests/test_capi.c builds it against the installed library and checks its last line. */
#include <stdio.h>
#include <zps/zps.h>

static int fail(zps_client *c, const char *what, zps_status st)
{
    fprintf(stderr, "%s: %s: %s\n", what, zps_strerror(st), zps_last_error(c));
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s tcp://HOST:PORT...\n", argv[0]);
        return 2;
    }
    zps_client *c;
    zps_status st = zps_connect((const char *const *)argv + 1, argc - 1, 0, NULL, &c);
    if (st != ZPS_OK)
        return fail(NULL, "connect", st);
    const char *names[] = {"w", "b"};
    const uint64_t counts[] = {4, 1};
    zps_job job = {.mode = ZPS_MODE_SYNC, .num_trainers = 1};
    if ((st = zps_register(c, names, counts, 2, 0, &job, NULL)) != ZPS_OK)
        return fail(c, "register", st);
    float model[5] = {1, 1, 1, 1, 0}; // w then b, back to back
    zps_optimizer opt;
    zps_optimizer_default(&opt);
    opt.lr = 0.5;
    if ((st = zps_init(c, model, &opt, NULL)) != ZPS_OK)
        return fail(c, "init", st);
    float gw[4], gb[1];
    for (int64_t step = 0; step < 3; step++) {
        for (int i = 0; i < 4; i++)
            gw[i] = model[i] - 0.5f; // d/dw of (w - 0.5)^2 / 2
        gb[0] = 1;
        zps_ticket tw, tb, tp;
        /* two pushes in flight at once (one per variable), then one pull of the model */
        if ((st = zps_push(c, 0, 1, gw, step, &tw)) || (st = zps_push(c, 1, 1, gb, step, &tb)))
            return fail(c, "push", st);
        if ((st = zps_wait(c, tw, NULL)) || (st = zps_wait(c, tb, NULL)))
            return fail(c, "push", st);
        uint64_t version;
        if ((st = zps_pull(c, 0, 2, model, step + 1, &tp)) || (st = zps_wait(c, tp, &version)))
            return fail(c, "pull", st);
        printf("step %lld: version %llu, w[0] %.4f, b %.4f\n", (long long)step,
               (unsigned long long)version, model[0], model[4]);
    }
    char *json;
    if ((st = zps_stats(c, 0, &json)) != ZPS_OK)
        return fail(c, "stats", st);
    zps_free(json);
    if ((st = zps_barrier(c)) != ZPS_OK || (st = zps_leave(c)) != ZPS_OK)
        return fail(c, "leave", st);
    zps_close(&c);
    printf("libzps %s: done\n", zps_library_version());
    return 0;
}
