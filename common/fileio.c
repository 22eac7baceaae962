/* fileio.c — see fileio.h. */
#include "common/fileio.h"

#include <errno.h>
#include <unistd.h>

ssize_t zps_read_full(int fd, void *buf, size_t n)
{
    unsigned char *b = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, b + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -1;
        if (k == 0)
            break;
        got += (size_t)k;
    }
    return (ssize_t)got;
}

int zps_write_full(int fd, const void *buf, size_t n)
{
    const unsigned char *b = buf;
    while (n) {
        size_t part = n > (1u << 30) ? (1u << 30) : n;
        ssize_t k = write(fd, b, part);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -1;
        if (k == 0) {
            errno = EIO;
            return -1;
        }
        b += k;
        n -= (size_t)k;
    }
    return 0;
}
