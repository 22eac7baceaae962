/* version.h — what build this is: the release version and the git commit it was built from.
 *
 * Every binary prints zps_version_line() for --version, and the metrics start records carry
 * both fields, so a result can always be traced to the code that produced it. The Makefile
 * writes the commit into $(B)/gen/zps_git.h (only when it changes, so nothing else rebuilds).
 */
#ifndef ZPS_COMMON_VERSION_H
#define ZPS_COMMON_VERSION_H

#define ZPS_VERSION "0.3.0"

/* The release version, e.g. "0.3.0". */
const char *zps_version(void);
/* The git commit, 12 hex digits with "-dirty" when the tree had changes, or "unknown"
 * when the source was not a git checkout. */
const char *zps_git_hash(void);
/* "zps-PROG 0.3.0 (git 0123456789ab)" for PROG's --version. */
const char *zps_version_line(const char *prog);

#endif
