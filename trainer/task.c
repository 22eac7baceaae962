/* task.c — picks the task of a model (task.h): the detector for ssd, the classifier for the
 * rest. */
#include "trainer/task.h"

#include <string.h>

zps_status tr_task_new(const tr_config *cfg, nn_model *m, int classes, tr_task **out)
{
    *out = NULL;
    if (strcmp(cfg->model, "ssd") == 0)
        return tr_task_detect_new(m, cfg->batch, classes, out);
    return tr_task_classify_new(m, cfg->batch, out);
}

void tr_task_destroy(tr_task **pt)
{
    if (!pt || !*pt)
        return;
    (*pt)->destroy(*pt);
    *pt = NULL;
}
