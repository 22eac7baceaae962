/* test_omp_env.c — common/omp_env.h, suite omp_env: which variables the policy set (the
 * names in ZPS_OMP_CONFIGURED, whole names only), and a process that ran it before (or
 * whose user set everything) is left alone: no re-execution, values kept. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/omp_env.h"

Test(omp_env, tells_which_names_it_set)
{
    setenv("ZPS_OMP_CONFIGURED", "OMP_WAIT_POLICY,OMP_NUM_THREADS", 1);
    cr_expect(zps_omp_env_set("OMP_WAIT_POLICY"));
    cr_expect(zps_omp_env_set("OMP_NUM_THREADS"));
    cr_expect_not(zps_omp_env_set("OMP_NUM"));
    cr_expect_not(zps_omp_env_set("WAIT_POLICY"));
    setenv("ZPS_OMP_CONFIGURED", "OMP_NUM_THREADS", 1);
    cr_expect_not(zps_omp_env_set("OMP_WAIT_POLICY"));
    unsetenv("ZPS_OMP_CONFIGURED");
    cr_expect_not(zps_omp_env_set("OMP_WAIT_POLICY"));
}

Test(omp_env, keeps_the_users_values_without_re_executing)
{
    unsetenv("ZPS_OMP_CONFIGURED");
    setenv("OMP_WAIT_POLICY", "active", 1);
    setenv("OMP_NUM_THREADS", "7", 1);
    char *argv[] = {"/nonexistent", NULL};
    zps_omp_env(2, argv); // returns: nothing to change
    cr_expect_str_eq(getenv("OMP_WAIT_POLICY"), "active");
    cr_expect_str_eq(getenv("OMP_NUM_THREADS"), "7");
    cr_expect_null(getenv("ZPS_OMP_CONFIGURED"));
}
