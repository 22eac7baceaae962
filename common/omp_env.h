/* omp_env.h — the OpenMP settings every zps process that trains runs with.
 *
 * OpenMP (under oneDNN) reads its settings once, when the library loads, so a process sets
 * them and re-executes itself once: OMP_WAIT_POLICY=passive, because spinning worker threads
 * made a small model 20x slower on these 2-core VMs whenever anything else ran (servers,
 * other trainers); and, when several processes share the machine, OMP_NUM_THREADS = cores
 * divided among them. Values the user set are kept. zps-trainer and `zps-bench train-step`
 * both call it, so a benchmark's step runs as a trainer's does.
 */
#ifndef ZPS_COMMON_OMP_ENV_H
#define ZPS_COMMON_OMP_ENV_H

/* Sets the policy for `local` processes sharing this machine (1: this one alone) and, when
 * it changed anything, re-executes /proc/self/exe with argv (argv[0] first); returns only
 * when nothing changed, when it ran before in this process's ancestry (ZPS_OMP_CONFIGURED
 * set), or, after a warning, when the re-execution failed. ZPS_OMP_CONFIGURED holds the
 * names it set, comma-separated (zps_omp_env_set tells them apart). */
void zps_omp_env(int local, char **argv);
/* 1 when zps_omp_env set the variable name (rather than the user), else 0. */
int zps_omp_env_set(const char *name);

#endif
