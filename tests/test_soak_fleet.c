/* test_soak_fleet.c — the fault suite's fleet engine (soak_test_util.h): starts zps-launch
 * for a fleet, follows its output for the pids (restarts included), injects the fault
 * (kill -9, or the partition's link down and relay delay) once trainer 0 reached the chosen
 * step, reads every server's STATS while the launcher's --before-stop waits, and checks the
 * run. What is checked and why: test_soak.c. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/client.h"
#include "tests/soak_test_util.h"
#include "tests/testutil.h"


const sk_mode sk_modes[SK_NMODES] = {
    {"sync", "sync", 2, ""},
    {"sync+backup", "sync", 3, "--replicas-to-aggregate 2 --trainer-timeout 5"},
    {"async", "async", 2, ""},
    {"ssp", "ssp", 2, "--staleness 2"},
};

int sk_long(void)
{
    const char *v = getenv("ZPS_SOAK");
    return v && !strcmp(v, "long");
}

static double s_wall_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

const char *sk_root(void)
{
    const char *r = getenv("ZPS_ROOT");
    return r && *r ? r : ".";
}

static const char *s_bin(void)
{
    const char *b = getenv("ZPS_BIN");
    cr_assert(b && *b, "ZPS_BIN unset: run through make test");
    return b;
}

/* The whole of a file (NULL when it cannot be read); the caller frees. */
static char *s_slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = zps_xmalloc(cap);
    size_t k;
    while ((k = fread(buf + n, 1, cap - 1 - n, f)) > 0) {
        n += k;
        if (n + 1 >= cap)
            buf = zps_xrealloc(buf, cap *= 2);
    }
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* The number after "key": in json (-1 when absent). */
static long long s_num(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = json ? strstr(json, pat) : NULL;
    return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

int sk_sh(const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* A small Fashion-MNIST copy in dir/fm. */
void sk_make_data(const char *dir)
{
    char log[400];
    snprintf(log, sizeof log, "%s/data.log", dir);
    cr_assert_eq(sk_sh("'%s/zps-data' convert fashion-mnist --out '%s/fm' --limit 2048 "
                      "--shards 2 > '%s' 2>&1",
                      s_bin(), dir, log),
                 0, "zps-data convert failed (see %s)", log);
}

/* ---------------------------------------------------------------- the launcher */

/* The launcher's argv for fleet f in mode m (strings live in a static buffer). */
static int s_launch_argv(const sk_fleet *f, const sk_mode *m, int timeout_s, const char **argv)
{
    static char targs[1024], sargs[512], hook[700], tmo[16], scmd[512], tcmd[512];
    snprintf(targs, sizeof targs,
             "--mode %s --data %s/fm --model mlp --steps %d --batch-size 32 --eval-batches 4 "
             "--metrics {run_dir}/metrics-{index}.jsonl --export {run_dir}/final.w",
             m->mode, f->dir, f->steps);
    snprintf(sargs, sizeof sargs, "--mode %s --stats-every 0 %s", m->mode, m->server_args);
    /* the trainers are done: wait (bounded) until this test has read STATS */
    snprintf(hook, sizeof hook,
             "touch {run_dir}/trainers-done; i=0; while [ ! -e {run_dir}/stats-taken ] && "
             "[ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done");
    snprintf(tmo, sizeof tmo, "%d", timeout_s);
    int n = 0;
    argv[n++] = "/usr/bin/python3";
    static char launcher[600];
    snprintf(launcher, sizeof launcher, "%s/scripts/zps-launch", sk_root());
    argv[n++] = launcher;
    const char *fixed[] = {"--bin-dir", s_bin(), "--run-dir", f->run, "--timeout", tmo,
                           "--grace", "10", "--checkpoint-every-versions", "20",
                           "--restart-backoff", "0.2", "--before-stop", hook,
                           "--server-args", sargs, "--trainer-args", targs, NULL};
    for (int i = 0; fixed[i]; i++)
        argv[n++] = fixed[i];
    if (f->ns[0][0]) { /* partition: servers bind loopback in their namespace, behind the relay */
        snprintf(scmd, sizeof scmd,
                 "ip netns exec %s {bin}/zps-server --bind tcp://127.0.0.1:{port} --index {index} "
                 "--num-trainers {n_trainers}",
                 f->ns[0]);
        snprintf(tcmd, sizeof tcmd,
                 "ip netns exec %s {bin}/zps-trainer --cluster {cluster} --trainer-id {index}",
                 f->ns[1]);
        argv[n++] = "--server-cmd";
        argv[n++] = scmd;
        argv[n++] = "--trainer-cmd";
        argv[n++] = tcmd;
        static char cl[500];
        snprintf(cl, sizeof cl, "%s/cluster-in.txt", f->dir);
        argv[n++] = "--cluster";
        argv[n++] = cl;
    } else {
        static char nt[8];
        snprintf(nt, sizeof nt, "%d", m->trainers);
        argv[n++] = "--servers";
        argv[n++] = "2";
        argv[n++] = "--trainers";
        argv[n++] = nt;
    }
    argv[n] = NULL;
    return n;
}

/* Starts the launcher (own process group, output into RUN.out); returns its pid. */
static pid_t s_launch(sk_fleet *f, const sk_mode *m, int timeout_s)
{
    const char *argv[48];
    s_launch_argv(f, m, timeout_s, argv);
    char out[450];
    snprintf(out, sizeof out, "%s.out", f->run);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        setpgid(0, 0);
        /* a test that dies (timeout, crash) still stops its fleet: the launcher handles this */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* The launcher's "started ROLE I pid P" lines so far: the current pid of each slot. */
static void s_parse_pids(sk_fleet *f)
{
    char path[450];
    snprintf(path, sizeof path, "%s.out", f->run);
    free(f->out);
    f->out = s_slurp(path);
    if (!f->out)
        return;
    for (const char *p = f->out; (p = strstr(p, "zps-launch: started ")); p++) {
        char role[16];
        int idx, pid;
        if (sscanf(p, "zps-launch: started %15s %d pid %d", role, &idx, &pid) != 3 || idx < 0 ||
            idx >= SK_MAXP)
            continue;
        int r = strcmp(role, "server") ? 1 : 0;
        f->pid[r][idx] = pid;
        if (idx + 1 > f->n[r])
            f->n[r] = idx + 1;
    }
}

/* Steps trainer 0 has recorded so far. */
static int s_progress(const sk_fleet *f)
{
    char path[450];
    snprintf(path, sizeof path, "%s/metrics-0.jsonl", f->run);
    char *t = s_slurp(path);
    int n = 0;
    for (const char *p = t; p && (p = strstr(p, "\"type\":\"step\"")); p++)
        n++;
    free(t);
    return n;
}

/* ---------------------------------------------------------------- STATS */

/* The servers' ports, from the run's cluster file. */
static int s_ports(const sk_fleet *f, int *ports)
{
    char path[450];
    snprintf(path, sizeof path, "%s/cluster.txt", f->run);
    char *t = s_slurp(path);
    cr_assert_not_null(t, "%s", path);
    int n = 0;
    for (const char *p = t; (p = strstr(p, "server = ")) && n < SK_MAXP; p++) {
        const char *colon = strchr(p, '\n');
        const char *c = p;
        while (c < colon && strchr(c, ':') && strchr(c, ':') < colon)
            c = strchr(c, ':') + 1;
        ports[n++] = atoi(c);
    }
    free(t);
    return n;
}

/* In a child (which enters the servers' namespace when there is one): STATS of every
 * server into RUN/stats-I.json. The child exits 0 when all were read. */
static void s_stats_child(const sk_fleet *f, const int *ports, int n)
{
    if (f->ns[0][0]) {
        char path[128];
        snprintf(path, sizeof path, "/run/netns/%s", f->ns[0]);
        int fd = open(path, O_RDONLY);
        if (fd < 0 || setns(fd, CLONE_NEWNET) != 0)
            _exit(3);
    }
    char uris[SK_MAXP][64];
    const char *u[SK_MAXP];
    for (int i = 0; i < n; i++) {
        snprintf(uris[i], sizeof uris[i], "tcp://127.0.0.1:%d", ports[i]);
        u[i] = uris[i];
    }
    ps_client_opts o = {0};
    ps_client_opts_default(&o);
    o.timeout_ms = 3000;
    o.max_retries = 2;
    ps_client *c = NULL;
    if (ps_client_new(u, n, 0, &o, &c) != ZPS_OK)
        _exit(4);
    for (int i = 0; i < n; i++) {
        char *json = NULL, path[512];
        if (ps_client_stats(c, i, &json) != ZPS_OK)
            _exit(5);
        snprintf(path, sizeof path, "%s/stats-%d.json", f->run, i);
        FILE *out = fopen(path, "w");
        if (!out)
            _exit(6);
        fputs(json, out);
        fclose(out);
        free(json);
    }
    ps_client_destroy(&c);
    _exit(0);
}

/* Reads every server's STATS (the trainers are done, the servers still up), then lets the
 * launcher's --before-stop hook return. */
static void s_take_stats(sk_fleet *f)
{
    int ports[SK_MAXP], n = s_ports(f, ports);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0)
        s_stats_child(f, ports, n);
    int st = 0;
    waitpid(pid, &st, 0);
    for (int i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/stats-%d.json", f->run, i);
        f->stats[i] = s_slurp(path);
    }
    char done[512];
    snprintf(done, sizeof done, "%s/stats-taken", f->run);
    FILE *t = fopen(done, "w");
    cr_assert_not_null(t);
    fclose(t);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "soak: reading STATS failed (child status %d)\n", st);
}

/* ---------------------------------------------------------------- faults */


/* Kills the victim with SIGKILL once trainer 0 reached the fault's step. */
static void s_kill_step(sk_fleet *f, sk_fault_plan *pf)
{
    if (f->fault_ms || s_progress(f) < pf->at_step)
        return;
    int pid = f->pid[pf->role][pf->index];
    cr_assert_gt(pid, 0, "no pid for the victim");
    cr_assert_eq(kill(pid, SIGKILL), 0, "kill -9 %d: %s", pid, strerror(errno));
    f->fault_ms = s_wall_ms();
    f->victim_role = pf->role;
    f->victim = pf->index;
    fprintf(stderr, "soak: kill -9 %s %d (pid %d) at trainer 0's step %d\n",
            pf->role ? "trainer" : "server", pf->index, pid, pf->at_step);
}

/* Partition: link down for 10 s at the fault's step, then 5 s of delayed traffic through
 * the relay (150 ms per chunk, a fifth of them held 400 ms more), then normal. */
static void s_partition_step(sk_fleet *f, sk_fault_plan *pf)
{
    double now = s_wall_ms();
    if (pf->phase == 0 && s_progress(f) >= pf->at_step) {
        cr_assert_eq(sk_sh("ip netns exec %s ip link set %s down", f->ns[0], pf->link), 0);
        f->fault_ms = pf->down_ms = now;
        pf->phase = 1;
        fprintf(stderr, "soak: link down at trainer 0's step %d\n", pf->at_step);
    } else if (pf->phase == 1 && now - pf->down_ms >= 10000) {
        cr_assert_eq(sk_sh("ip netns exec %s ip link set %s up", f->ns[0], pf->link), 0);
        FILE *c = fopen(pf->relay_ctl, "w");
        cr_assert_not_null(c);
        fputs("150 20\n", c);
        fclose(c);
        pf->phase = 2;
        fprintf(stderr, "soak: link up after 10 s; relay delays for 5 s\n");
    } else if (pf->phase == 2 && now - pf->down_ms >= 15000) {
        unlink(pf->relay_ctl);
        pf->phase = 3;
    }
}

/* Runs the fleet to its end with the fault pf; bounded by limit_s (then stopped and
 * failed). Fills f->code, f->stats, f->out. */
void sk_run_fleet(sk_fleet *f, const sk_mode *m, sk_fault_plan *pf, int limit_s)
{
    pid_t pid = s_launch(f, m, limit_s);
    double t0 = s_wall_ms();
    int st = 0, stats = 0, stopping = 0;
    char flag[512];
    snprintf(flag, sizeof flag, "%s/trainers-done", f->run);
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            break;
        s_parse_pids(f);
        if (pf->kind == SK_KILL_SERVER || pf->kind == SK_KILL_TRAINER)
            s_kill_step(f, pf);
        else if (pf->kind == SK_PARTITION)
            s_partition_step(f, pf);
        if (!stats && access(flag, F_OK) == 0) {
            s_take_stats(f);
            stats = 1;
        }
        double el = (s_wall_ms() - t0) / 1e3;
        if (el > limit_s + 20 && !stopping) {
            kill(pid, SIGTERM); /* the launcher stops its fleet */
            stopping = 1;
        } else if (el > limit_s + 40) {
            kill(-pid, SIGKILL);
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < f->n[r]; i++)
                    kill(-f->pid[r][i], SIGKILL);
        }
        usleep(20000);
    }
    s_parse_pids(f);
    f->code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
    char path[450];
    snprintf(path, sizeof path, "%s/summary.json", f->run);
    char *sum = s_slurp(path);
    f->trainer_deaths = 0;
    for (const char *p = sum; p && (p = strstr(p, "\"action\":")); p++) {
        const char *role = p;
        static const char key[] = "\"role\": ", trainer[] = "\"role\": \"trainer\"";
        while (role > sum && strncmp(role, key, strlen(key)))
            role--;
        f->trainer_deaths += !strncmp(role, trainer, strlen(trainer));
    }
    free(sum);
}

/* ---------------------------------------------------------------- checks */

/* Field key of the last record of trainer t's metrics file that contains what (-1: none). */
static long long s_last_record(const sk_fleet *f, int t, const char *what, const char *key)
{
    char path[450];
    snprintf(path, sizeof path, "%s/metrics-%d.jsonl", f->run, t);
    char *text = s_slurp(path);
    const char *last = NULL;
    for (const char *p = text; p && (p = strstr(p, what)); p++)
        last = p;
    long long v = last ? s_num(last, key) : -1;
    free(text);
    return v;
}

/* The steps trainer t's summary counts (-1: no summary). */
static long long s_summary_steps(const sk_fleet *f, int t)
{
    return s_last_record(f, t, "\"type\":\"summary\"", "steps");
}

/* The version server i started from: the last "restored ..., version V" of its log (a
 * restart), else 0. */
static long long s_start_version(const sk_fleet *f, int i)
{
    char path[450];
    snprintf(path, sizeof path, "%s/server-%d.log", f->run, i);
    char *text = s_slurp(path);
    long long v = 0;
    const char *restart = NULL;
    for (const char *p = text; p && (p = strstr(p, "---- zps-launch: restart")); p++)
        restart = p;
    for (const char *p = restart; p && (p = strstr(p, " values, version ")); p++)
        v = strtoll(p + strlen(" values, version "), NULL, 10);
    free(text);
    return v;
}

/* Recovery: the longest stall of a trainer's steps in the 20 s after the fault, from the
 * fault or the last step before it to the next step, over the trainers that lived through
 * it (a killed trainer: its restarted incarnation, from the kill to its first step)
 * (ms; -1 when none). */
double sk_recovery_ms(const sk_fleet *f, int n_trainers)
{
    double worst = -1;
    for (int t = 0; t < n_trainers; t++) {
        if (f->victim_role == 1 && f->victim != t)
            continue;
        char path[450];
        snprintf(path, sizeof path, "%s/metrics-%d.jsonl", f->run, t);
        char *text = s_slurp(path);
        long long wall = s_num(text, "wall_ms");
        double prev = 0;
        for (const char *p = text; p && wall > 0 && (p = strstr(p, "\"type\":\"step\"")); p++) {
            const char *tm = strstr(p, "\"time\":");
            double at = tm ? (double)wall + 1e3 * strtod(tm + 7, NULL) : 0;
            double from = prev > f->fault_ms ? prev : f->fault_ms;
            if (at > f->fault_ms && from < f->fault_ms + 20000 && at - from > worst)
                worst = at - from;
            prev = at;
        }
        free(text);
    }
    return worst;
}

/* Every step applied exactly once, from the servers' STATS (see the file comment). */
static void s_check_stats(const sk_fleet *f, const sk_mode *m, uint64_t seed)
{
    int sync = !strcmp(m->mode, "sync"), backup = m->trainers > 2;
    long long all_pushes = (long long)f->steps * m->trainers;
    for (int i = 0; i < f->n[0]; i++) {
        const char *js = f->stats[i];
        cr_assert_not_null(js, "no STATS from server %d (seed %llu)", i, (unsigned long long)seed);
        long long v = s_num(js, "version"), up = s_num(js, "updates"), ch = s_num(js, "chunks");
        long long vals = s_num(js, "values"), in = s_num(js, "bytes_in");
        long long v0 = s_start_version(f, i);
        /* a sync rollback discards the versions past the cut on every server (docs/ps.md
         * "Recovery": updates + updates_restored - updates_undone adds up); the restored
         * server's loaded ones are below v0 already */
        long long undone = s_num(js, "updates_undone");
        up -= undone > 0 ? undone : 0;
        fprintf(stderr, "soak: %s server %d: version %lld (from %lld), updates %lld (net of %lld "
                "undone by a rollback), chunks %lld, values %lld, bytes_in %lld, stale %lld\n",
                m->name, i, v, v0, up, undone > 0 ? undone : 0, ch, vals, in,
                s_num(js, "stale_dropped"));
        /* a kill can cut a step's push in pieces (async and ssp apply each piece): a restored
         * server's chunks may start up to one version per trainer apart (each trainer's step
         * in flight at the checkpoint) and end so (each one's step cut by the kill), and each
         * dead trainer may leave some chunks one version ahead ("version" is the smallest);
         * otherwise every chunk moves with every step */
        int deaths = f->trainer_deaths;
        long long slack = ch * ((v0 ? 2 * m->trainers : 0) + deaths);
        cr_assert(up >= ch * (v - v0) - slack && up <= ch * (v - v0) + slack,
                  "%s server %d: %lld updates for %lld chunks from version %lld to %lld: a step "
                  "applied twice or lost (seed %llu)", m->name, i, up, ch, v0, v,
                  (unsigned long long)seed);
        /* versions need R gradients in sync, but min(R, live): once the others finished, a
         * restarted trainer's extra steps go alone; so do a backup worker's, which is behind
         * by the steps its stale pushes skipped when the two others leave */
        int r = sync && !deaths && !backup ? m->trainers : 1;
        long long whole = v - v0 - (v0 ? 2 * m->trainers : 0) - deaths; /* surely complete */
        long long need = 4 * vals * (whole > 0 ? whole : 0) * r;
        cr_assert_geq(in, need, "%s server %d: %lld bytes in, %lld needed for %lld versions "
                      "(seed %llu)", m->name, i, in, need, v - v0, (unsigned long long)seed);
        /* a restarted sync trainer joins at the servers' version (sync.h, start_step), so
         * the job ends at its target; with backup workers versions outrun the steps */
        if (sync && !backup)
            cr_assert_eq(v, f->steps, "%s server %d at version %lld, the job ran %d steps "
                         "(seed %llu)", m->name, i, v, f->steps, (unsigned long long)seed);
        else if (sync)
            cr_assert_geq(v, f->steps, "%s server %d at version %lld (seed %llu)", m->name, i,
                          v, (unsigned long long)seed);
        else if (v0 == 0) /* async/ssp: one version per trainer step pushed */
            cr_assert(v >= all_pushes && v <= all_pushes + deaths * f->steps,
                      "%s server %d at version %lld, the trainers pushed %lld steps and %d "
                      "died (seed %llu)", m->name, i, v, all_pushes, deaths,
                      (unsigned long long)seed);
    }
}

/* What every run must show: exit 0, every trainer's steps done, STATS adding up. */
void sk_check_run(const sk_fleet *f, const sk_mode *m, uint64_t seed)
{
    cr_assert_eq(f->code, 0, "%s: launcher exit %d (seed %llu; run %s)\n%s", m->name, f->code,
                 (unsigned long long)seed, f->run, f->out ? f->out : "");
    for (int t = 0; t < m->trainers; t++) {
        long long did = s_summary_steps(f, t);
        if (f->victim_role == 1 && f->victim == t) /* a restarted incarnation: it finished; in
                                                     * sync it joins at the servers' step, 0
                                                     * steps when the others had finished */
            cr_assert_geq(did, 0, "%s: restarted trainer %d wrote no summary (seed %llu)",
                          m->name, t, (unsigned long long)seed);
        else if (m->trainers > 2) /* backup workers: the first two trainers up may run ahead,
                                   * and a later one joins at the servers' step (train.c) */
            cr_assert_eq(s_last_record(f, t, "\"type\":\"step\"", "step"), f->steps,
                         "%s: trainer %d did not reach step %d (seed %llu)", m->name, t,
                         f->steps, (unsigned long long)seed);
        else
            cr_assert_eq(did, f->steps, "%s: trainer %d did %lld of %d steps (seed %llu)",
                         m->name, t, did, f->steps, (unsigned long long)seed);
    }
    s_check_stats(f, m, seed);
}

/* 1 when the two runs' exported weights are the same bytes. */
int sk_same_weights(const sk_fleet *a, const sk_fleet *b)
{
    char pa[450], pb[450];
    snprintf(pa, sizeof pa, "%s/final.w", a->run);
    snprintf(pb, sizeof pb, "%s/final.w", b->run);
    return sk_sh("cmp -s '%s' '%s'", pa, pb) == 0;
}

void sk_fleet_free(sk_fleet *f)
{
    free(f->out);
    for (int i = 0; i < SK_MAXP; i++)
        free(f->stats[i]);
    memset(f->stats, 0, sizeof f->stats);
    f->out = NULL;
}

int sk_steps(const sk_mode *m)
{
    int sync = !strcmp(m->mode, "sync");
    return (sk_long() ? 4 : 1) * (sync ? 500 : 300);
}
