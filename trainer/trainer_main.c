/* trainer_main.c — zps-trainer: one trainer process (flags: trainer/config.c).
 *
 * Before anything loads OpenMP, main sets its policy and re-executes itself once
 * (common/omp_env.h): a short spin before idle workers sleep, and the cores divided among the
 * trainers that share this machine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/omp_env.h"
#include "trainer/config.h"
#include "trainer/train.h"

int main(int argc, char **argv)
{
    tr_config cfg;
    tr_config_default(&cfg);
    zps_log_init("trainer", -1);
    int code;
    if (tr_config_parse(&cfg, argc, argv, &code) != ZPS_OK || code >= 0)
        return code >= 0 ? code : 2;
    zps_omp_env(tr_config_local_trainers(&cfg), argv);
    zps_malloc_keep_warm();
    zps_log_set_role("trainer", cfg.trainer_id);
    tr_result res;
    zps_status st = tr_run(&cfg, &res);
    if (st != ZPS_OK) {
        zps_log_failure("zps-trainer", st, "trainer %d", cfg.trainer_id);
        return 1;
    }
    /* "test accuracy A" or, for the detector, "test mAP@0.5 M": scripts read these lines */
    const char *what = strcmp(res.score_name, "map") == 0 ? "mAP@0.5" : "accuracy";
    if (res.accuracy >= 0 && cfg.eval_only)
        printf("%s: test %s %.4f (loss %.4f) on %d test images\n", cfg.init_weights, what,
               res.accuracy, res.test_loss, res.eval_images);
    else if (res.accuracy >= 0)
        printf("trainer %d: test %s %.4f (loss %.4f) on %d test images after %lld steps\n",
               cfg.trainer_id, what, res.accuracy, res.test_loss, res.eval_images,
               (long long)res.steps);
    if (cfg.dump_detections >= 0 && res.accuracy >= 0 && cfg.trainer_id == 0)
        printf("detections drawn in %s\n", cfg.dump_out);
    return 0;
}
