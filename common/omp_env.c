/* omp_env.c — the OpenMP settings of training processes (omp_env.h). */
#include "common/omp_env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

#define S_MARK "ZPS_OMP_CONFIGURED"

void zps_omp_env(int local, char **argv)
{
    if (getenv(S_MARK))
        return;
    char set[64] = "";
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) {
        setenv("GOMP_SPINCOUNT", ZPS_OMP_SPINCOUNT, 1);
        snprintf(set, sizeof set, "GOMP_SPINCOUNT");
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (!getenv("OMP_NUM_THREADS") && local > 1 && cores > 0) {
        char buf[16];
        snprintf(buf, sizeof buf, "%ld", cores / local > 0 ? cores / local : 1);
        setenv("OMP_NUM_THREADS", buf, 1);
        size_t n = strlen(set);
        snprintf(set + n, sizeof set - n, "%sOMP_NUM_THREADS", n ? "," : "");
    }
    if (!set[0])
        return;
    setenv(S_MARK, set, 1);
    execv("/proc/self/exe", argv);
    zps_log(ZPS_WARN, "omp", "could not re-execute with OpenMP settings; going on");
}

int zps_omp_env_set(const char *name)
{
    const char *m = getenv(S_MARK);
    size_t n = strlen(name);
    for (const char *p = m; p && (p = strstr(p, name)) != NULL; p += n)
        if ((p == m || p[-1] == ',') && (p[n] == '\0' || p[n] == ','))
            return 1;
    return 0;
}
