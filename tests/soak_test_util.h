/* soak_test_util.h — the fault suite's fleet engine (test_soak_fleet.c) for its cases
 * (test_soak.c): a fleet under scripts/zps-launch, one fault injected at trainer 0's chosen
 * step, STATS read between the trainers' end and the servers' stop, and the checks. */
#ifndef ZPS_TESTS_SOAK_TEST_UTIL_H
#define ZPS_TESTS_SOAK_TEST_UTIL_H

#include <stdint.h>

#define SK_MAXP 8       // processes per role
#define SK_NMODES 4

typedef enum { SK_NONE, SK_KILL_SERVER, SK_KILL_TRAINER, SK_PARTITION } sk_fault;

typedef struct {
    const char *name;        // printed
    const char *mode;        // --mode
    int trainers;
    const char *server_args; // extra server flags
} sk_mode;


typedef struct {
    char dir[256];            // the test's temporary directory (data, runs)
    char run[400];            // this run's folder
    char ns[2][32];           // partition: server and trainer namespaces ("" when none)
    int steps;                // --steps per trainer
    int code;                 // launcher exit code (-signal)
    char *out;                // launcher output
    int pid[2][SK_MAXP];       // current pid per role (0 server, 1 trainer) and index
    int n[2];
    char *stats[SK_MAXP];      // STATS JSON per server, read in --before-stop
    double fault_ms;          // wall-clock ms of the fault (0: none)
    int victim_role, victim;  // what the fault hit
    int trainer_deaths;       // trainer deaths the launcher handled (its summary's events)
} sk_fleet;

/* sync, sync+backup, async, ssp */
extern const sk_mode sk_modes[SK_NMODES];

typedef struct {
    sk_fault kind;
    int at_step;        // trainer 0's step count that triggers it
    int role, index;    // kill: the victim
    double down_ms;     // partition: when the link went down (0: not yet)
    int phase;          // partition: 0 before, 1 link down, 2 delayed, 3 over
    char link[32];      // partition: the server side's veth
    char relay_ctl[450];
} sk_fault_plan;

/* ZPS_SOAK=long (make soak). */
int sk_long(void);
/* $ZPS_ROOT, else ".". */
const char *sk_root(void);
/* system() of the formatted command; its exit status (-1: killed). */
int sk_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A small Fashion-MNIST copy in dir/fm. */
void sk_make_data(const char *dir);
/* --steps of mode m (short or long). */
int sk_steps(const sk_mode *m);
/* Runs fleet f (f->dir, f->run, f->steps, f->ns set) to its end with fault pf, bounded by
 * limit_s: fills f->code, f->out, f->stats, f->trainer_deaths. */
void sk_run_fleet(sk_fleet *f, const sk_mode *m, sk_fault_plan *pf, int limit_s);
/* Exit 0, steps done, STATS adding up (asserts; seed in the messages). */
void sk_check_run(const sk_fleet *f, const sk_mode *m, uint64_t seed);
/* The longest stall of a trainer's steps after the fault (ms; -1: none). */
double sk_recovery_ms(const sk_fleet *f, int n_trainers);
/* 1 when both runs exported the same weight bytes. */
int sk_same_weights(const sk_fleet *a, const sk_fleet *b);
void sk_fleet_free(sk_fleet *f);

#endif
