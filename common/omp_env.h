/* omp_env.h — the OpenMP settings every zps process that trains runs with.
 *
 * OpenMP (under oneDNN) reads its settings once, when the library loads, so a process sets
 * them and re-executes itself once:
 *  - a short spin before an idle worker sleeps (GOMP_SPINCOUNT=3000, libgomp's, which
 *    Debian's oneDNN uses). Inception-v3's hundreds of small primitives a step each end in a
 *    barrier: with OMP_WAIT_POLICY=passive (never spin, zps's choice until 2026-12-07) every
 *    one paid a futex wake, and a lone 2-thread trainer ran the thin Inception at 260-336
 *    img/s against 510 on one thread; spinning 3000 times, 541-614. libgomp's own default
 *    (300,000 spins) is as fast alone but costs 3.8x when trainers overrun the cores
 *    (2 trainers x 2 threads on 2 cores: mlp 3,400 img/s against 13,100 passive, 10,700
 *    with 3000 spins);
 *  - when several processes share the machine, OMP_NUM_THREADS = cores divided among them.
 * Values the user set are kept (OMP_WAIT_POLICY or GOMP_SPINCOUNT: the wait; OMP_NUM_THREADS).
 * zps-trainer and `zps-bench train-step` both call it, so a benchmark's step runs as a
 * trainer's does.
 */
#ifndef ZPS_COMMON_OMP_ENV_H
#define ZPS_COMMON_OMP_ENV_H

#define ZPS_OMP_SPINCOUNT "3000" /* GOMP_SPINCOUNT where the user set no wait policy */

/* Sets the policy for `local` processes sharing this machine (1: this one alone) and, when
 * it changed anything, re-executes /proc/self/exe with argv (argv[0] first); returns only
 * when nothing changed, when it ran before in this process's ancestry (ZPS_OMP_CONFIGURED
 * set), or, after a warning, when the re-execution failed. ZPS_OMP_CONFIGURED holds the
 * names it set, comma-separated (zps_omp_env_set tells them apart). */
void zps_omp_env(int local, char **argv);
/* 1 when zps_omp_env set the variable name (rather than the user), else 0. */
int zps_omp_env_set(const char *name);

#endif
