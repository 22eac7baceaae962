/* fileio.h — whole-buffer read and write on a file descriptor: short transfers are
 * continued and EINTR is retried, so callers see only "all of it", end of file, or an
 * error with errno set. */
#ifndef ZPS_COMMON_FILEIO_H
#define ZPS_COMMON_FILEIO_H

#include <stddef.h>
#include <sys/types.h>

/* Reads up to n bytes into buf, stopping early only at end of file. Returns the count
 * read, or -1 with errno set. */
ssize_t zps_read_full(int fd, void *buf, size_t n);
/* Writes all n bytes of buf (in parts of at most 1 GiB). Returns 0, or -1 with errno set
 * (a write that makes no progress sets EIO). */
int zps_write_full(int fd, const void *buf, size_t n);

#endif
