/* test_soak.c — the fault suite (suite it_soak): real fleets under scripts/zps-launch, one
 * fault each, and what must hold afterwards.
 *
 * For each mode (sync, sync with one backup worker, async, ssp) a fleet of 2 servers and
 * 2 trainers (3 for the backup case) trains the MLP on a small Fashion-MNIST copy; when
 * trainer 0 has done a random number of steps, kill -9 goes to a random server (one run)
 * or a random trainer (another run). Then:
 *  - the launcher exits 0 and every trainer's metrics summary says it did its --steps;
 *  - STATS, read from every server between the trainers' end and the servers' stop
 *    (zps-launch --before-stop), adds up: every chunk is at the same version on a server,
 *    updates = chunks x (versions advanced since the server started or was restored), and
 *    enough bytes came in for those updates; in sync every server ends at the job's last
 *    version (no step lost, none applied twice);
 *  - in sync (no backup workers) the final weights equal a fault-free run bit for bit.
 * The recovery time after a fault (the longest stall of a trainer's steps after it, from the
 * metrics files) is printed per mode: a figure, not an assertion.
 * The partition variant puts the servers and the trainers in two network namespaces joined
 * by a veth pair (made and removed here; needs root, else it skips), takes the link down for
 * 10 s, then delays the traffic through scripts/soak-relay (the kernel here has no netem).
 *
 * Seeded: the seed (zt_seed_init, $ZPS_TEST_SEED) and every random choice are printed.
 * Short by default (make test); ZPS_SOAK=long (make soak) runs longer fleets, several rounds.
 * The fleet engine is in test_soak_fleet.c (soak_test_util.h).
 * Every run is bounded (launcher --timeout, and a hard limit here), every process reaped.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/soak_test_util.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- cases */


/* One fleet of mode m with fault kind; prints the recovery time and checks the run. ref: a
 * fault-free run to compare sync weights with (NULL: none). */
static void s_one(const char *dir, const sk_mode *m, sk_fault kind, int round, uint64_t seed,
                    const sk_fleet *ref, sk_fault_plan *pf)
{
    sk_fleet f = {0};
    snprintf(f.dir, sizeof f.dir, "%s", dir);
    snprintf(f.run, sizeof f.run, "%s/%s-%d-%d", dir, m->name, (int)kind, round);
    f.steps = sk_steps(m);
    f.victim_role = -1;
    if (pf->kind == SK_PARTITION) {
        snprintf(f.ns[0], sizeof f.ns[0], "zpsS%d", (int)getpid());
        snprintf(f.ns[1], sizeof f.ns[1], "zpsT%d", (int)getpid());
    }
    pf->kind = kind;
    pf->at_step = zt_irand(f.steps / 5, f.steps * 3 / 5);
    pf->role = kind == SK_KILL_TRAINER;
    pf->index = zt_irand(0, kind == SK_KILL_TRAINER ? m->trainers - 1 : 1);
    if (kind != SK_NONE)
        fprintf(stderr, "soak: %s round %d: %s at trainer 0's step %d of %d (seed %llu)\n",
                m->name, round, kind == SK_PARTITION ? "partition" : "kill", pf->at_step,
                f.steps, (unsigned long long)seed);
    sk_run_fleet(&f, m, pf, sk_long() ? 180 : 90);
    double rec = kind == SK_NONE ? -1 : sk_recovery_ms(&f, m->trainers);
    if (kind != SK_NONE && rec < 0) /* printed before the checks: a failed run's says how */
        fprintf(stderr, "soak: %s, kill -9 of %s %d: no step after it\n", m->name,
                pf->role ? "trainer" : "server", pf->index);
    else if (kind != SK_NONE)
        fprintf(stderr, "soak: %s, kill -9 of %s %d: recovery %.2f s (%s)\n", m->name,
                pf->role ? "trainer" : "server", pf->index, rec / 1e3,
                pf->role ? "to its restarted incarnation's first step"
                         : "the longest stall of a trainer's steps");
    sk_check_run(&f, m, seed);
    if (ref && !strcmp(m->mode, "sync") && m->trainers == 2)
        cr_assert(sk_same_weights(&f, ref), "%s: the final weights differ from the fault-free "
                  "run (seed %llu; runs %s and %s)", m->name, (unsigned long long)seed, f.run,
                  ref->run);
    sk_fleet_free(&f);
}

/* A fault-free run of mode m in dir/reference (sync: the weights a faulty run must equal). */
static void s_reference(const char *dir, const sk_mode *m, uint64_t seed, sk_fleet *ref)
{
    snprintf(ref->dir, sizeof ref->dir, "%s", dir);
    snprintf(ref->run, sizeof ref->run, "%s/reference", dir);
    ref->steps = sk_steps(m);
    ref->victim_role = -1;
    sk_fault_plan none = {.kind = SK_NONE};
    sk_run_fleet(ref, m, &none, 90);
    sk_check_run(ref, m, seed);
}

static char s_tmp[256]; /* the test's directory, removed by s_tmp_fini however it ends */

static void s_tmp_fini(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
    s_tmp[0] = 0;
}

/* mode mi, kill of a random server or trainer at a random step, rounds times (long: 3). */
static void s_kill_case(int mi, sk_fault kind)
{
    uint64_t seed = zt_seed_init();
    const sk_mode *m = &sk_modes[mi];
    char *dir = s_tmp;
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-soak");
    sk_make_data(dir);
    sk_fleet ref = {0}; /* sync: the fault-free run the weights must equal */
    int want_ref = kind == SK_KILL_SERVER && !strcmp(m->mode, "sync") && m->trainers == 2;
    if (want_ref)
        s_reference(dir, m, seed, &ref);
    int rounds = sk_long() ? 3 : 1;
    for (int r = 0; r < rounds; r++) {
        sk_fault_plan pf = {.kind = kind};
        s_one(dir, m, kind, r, seed, want_ref ? &ref : NULL, &pf);
    }
    sk_fleet_free(&ref);
}

/* one case per mode and victim: a kill -9 at a random step, rounds as s_kill_case says */
#define S_KILL_TEST(name, mi, kind)                                                      \
    Test(it_soak, name, .timeout = 900, .fini = s_tmp_fini) { s_kill_case(mi, kind); }

S_KILL_TEST(sync_server_kill, 0, SK_KILL_SERVER)
S_KILL_TEST(sync_trainer_kill, 0, SK_KILL_TRAINER)
S_KILL_TEST(backup_server_kill, 1, SK_KILL_SERVER)
S_KILL_TEST(backup_trainer_kill, 1, SK_KILL_TRAINER)
S_KILL_TEST(async_server_kill, 2, SK_KILL_SERVER)
S_KILL_TEST(async_trainer_kill, 2, SK_KILL_TRAINER)
S_KILL_TEST(ssp_server_kill, 3, SK_KILL_SERVER)
S_KILL_TEST(ssp_trainer_kill, 3, SK_KILL_TRAINER)


/* ---------------------------------------------------------------- partition */

typedef struct {
    char ns[2][32];     // servers', trainers' namespace
    char link[32];      // the servers' end of the veth pair
    pid_t relay;        // soak-relay in the servers' namespace
    int ports[2];
} s_net;

/* Two namespaces joined by veth (10.213.0.1 servers, 10.213.0.2 trainers); 0 when this
 * machine cannot (not root, no netns): the caller skips. */
static int s_net_up(s_net *n)
{
    int id = (int)getpid();
    snprintf(n->ns[0], sizeof n->ns[0], "zpsS%d", id);
    snprintf(n->ns[1], sizeof n->ns[1], "zpsT%d", id);
    snprintf(n->link, sizeof n->link, "zs%d", id);
    if (geteuid() != 0 || sk_sh("ip netns add %s 2>/dev/null", n->ns[0]) != 0)
        return 0;
    int rc = sk_sh("ip netns add %s && ip link add %s netns %s type veth peer name zt%d netns %s "
                  "&& ip -n %s addr add 10.213.0.1/24 dev %s && ip -n %s addr add 10.213.0.2/24 "
                  "dev zt%d && ip -n %s link set %s up && ip -n %s link set zt%d up && "
                  "ip -n %s link set lo up && ip -n %s link set lo up",
                  n->ns[1], n->link, n->ns[0], id, n->ns[1], n->ns[0], n->link, n->ns[1], id,
                  n->ns[0], n->link, n->ns[1], id, n->ns[0], n->ns[1]);
    cr_assert_eq(rc, 0, "setting up the namespaces failed");
    return 1;
}

/* Removes the namespaces (and with them the veth pair). */
static void s_net_down(s_net *n)
{
    if (n->relay > 0) {
        kill(n->relay, SIGTERM);
        waitpid(n->relay, NULL, 0);
        n->relay = 0;
    }
    sk_sh("ip netns del %s 2>/dev/null; ip netns del %s 2>/dev/null", n->ns[0], n->ns[1]);
}

/* The cluster file (servers on 10.213.0.1) and the relay in front of the servers. */
static void s_net_fleet(s_net *n, const char *dir, const sk_mode *m, const char *ctl)
{
    char path[400];
    snprintf(path, sizeof path, "%s/cluster-in.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "job = soak\n");
    for (int i = 0; i < 2; i++) {
        n->ports[i] = 21000 + zt_irand(0, 8000) * 2 + i;
        fprintf(f, "server = 10.213.0.1:%d\n", n->ports[i]);
    }
    for (int t = 0; t < m->trainers; t++)
        fprintf(f, "trainer = 10.213.0.2\n");
    fclose(f);
    char relay[600], p0[64], p1[64], seed[24], log[450];
    snprintf(relay, sizeof relay, "%s/scripts/soak-relay", sk_root());
    snprintf(p0, sizeof p0, "10.213.0.1:%d=127.0.0.1:%d", n->ports[0], n->ports[0]);
    snprintf(p1, sizeof p1, "10.213.0.1:%d=127.0.0.1:%d", n->ports[1], n->ports[1]);
    snprintf(seed, sizeof seed, "%u", zt_rand());
    snprintf(log, sizeof log, "%s/relay.log", dir);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execl("/usr/sbin/ip", "ip", "netns", "exec", n->ns[0], "/usr/bin/python3", relay,
              "--control", ctl, "--seed", seed, p0, p1, (char *)NULL);
        _exit(127);
    }
    n->relay = pid;
}

/* One partitioned run of mode m: link down 10 s at a random step, then 5 s of delay. */
static s_net s_the_net; /* removed by s_net_fini however the test ends */

static void s_tmp_fini(void);

static void s_net_fini(void)
{
    if (s_the_net.ns[0][0])
        s_net_down(&s_the_net);
    s_tmp_fini();
}

static void s_partition_mode(const char *dir, const sk_mode *m, uint64_t seed, int round,
                             const sk_fleet *ref)
{
    s_net n = {0};
    int up = s_net_up(&n);
    s_the_net = n;
    if (!up) {
        s_the_net.ns[0][0] = 0;
        ZPS_TEST_SKIP("the partition needs root and network namespaces (ip netns)");
    }
    sk_fault_plan pf = {.kind = SK_PARTITION};
    snprintf(pf.link, sizeof pf.link, "%s", n.link);
    snprintf(pf.relay_ctl, sizeof pf.relay_ctl, "%s/relay.ctl", dir);
    unlink(pf.relay_ctl);
    s_net_fleet(&n, dir, m, pf.relay_ctl);
    s_the_net = n;
    sk_fleet f = {0};
    snprintf(f.dir, sizeof f.dir, "%s", dir);
    snprintf(f.run, sizeof f.run, "%s/%s-partition-%d", dir, m->name, round);
    memcpy(f.ns, n.ns, sizeof f.ns);
    f.steps = sk_steps(m);
    f.victim_role = -1;
    pf.at_step = zt_irand(f.steps / 5, f.steps * 2 / 5);
    fprintf(stderr, "soak: %s round %d: partition at trainer 0's step %d of %d (seed %llu)\n",
            m->name, round, pf.at_step, f.steps, (unsigned long long)seed);
    sk_run_fleet(&f, m, &pf, sk_long() ? 180 : 120);
    s_net_down(&n);
    s_the_net.ns[0][0] = 0;
    sk_check_run(&f, m, seed);
    if (ref && !strcmp(m->mode, "sync") && m->trainers == 2)
        cr_assert(sk_same_weights(&f, ref), "%s: the final weights after the partition differ "
                  "from the fault-free run (seed %llu)", m->name, (unsigned long long)seed);
    fprintf(stderr, "soak: %s partition: recovery %.2f s (the longest stall of a trainer's "
            "steps; the link was down 10 s, then 5 s delayed)\n",
            m->name, sk_recovery_ms(&f, m->trainers) / 1e3);
    sk_fleet_free(&f);
}

/* The partition in sync (long: every mode). */
Test(it_soak, network_partition, .timeout = 1800, .fini = s_net_fini)
{
    uint64_t seed = zt_seed_init();
    char *dir = s_tmp;
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-soak");
    sk_make_data(dir);
    sk_fleet ref = {0};
    s_reference(dir, &sk_modes[0], seed, &ref);
    for (int mi = 0; mi < 4; mi++) {
        if (!sk_long() && mi != 0)
            continue;
        s_partition_mode(dir, &sk_modes[mi], seed, mi, &ref);
    }
    sk_fleet_free(&ref);
}
