/* version.c — the build's version and git commit (see version.h). */
#include "common/version.h"

#include <stdio.h>

#include "zps_git.h"

const char *zps_version(void) { return ZPS_VERSION; }

const char *zps_git_hash(void) { return ZPS_GIT_HASH; }

const char *zps_version_line(const char *prog) {
    static _Thread_local char line[160];
    snprintf(line, sizeof line, "%s %s (git %s)", prog, ZPS_VERSION, ZPS_GIT_HASH);
    return line;
}
