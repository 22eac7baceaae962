/* trainer_main.c — zps-trainer: one trainer process (flags: trainer/config.c). */
#include <stdio.h>

#include "common/log.h"
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
    zps_log_set_role("trainer", cfg.trainer_id);
    return tr_run(&cfg) == ZPS_OK ? 0 : 1;
}
