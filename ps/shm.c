/* shm.c — the same-host data plane's segment (ps/shm.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/mem.h"
#include "ps/shm.h"

static uint64_t s_up64(uint64_t v)
{
    return (v + 63) & ~(uint64_t)63;
}

static ps_shm *s_wrap(void *base, size_t bytes, int fd)
{
    ps_shm *m = zps_xcalloc(1, sizeof *m);
    m->hdr = base;
    m->chunks = (ps_shm_chunk *)((char *)base + m->hdr->chunks_off);
    m->values = (float *)((char *)base + m->hdr->values_off);
    m->fd = fd;
    m->bytes = bytes;
    return m;
}

zps_status ps_shm_create(uint32_t n_local, const uint32_t *keys, const uint64_t *counts,
                         const uint64_t *offs, uint32_t num_chunks, uint64_t local_total,
                         uint32_t n_trainers, ps_shm **out)
{
    *out = NULL;
    uint64_t chunks_off = s_up64(sizeof(ps_shm_hdr));
    uint64_t values_off = s_up64(chunks_off + (uint64_t)n_local * sizeof(ps_shm_chunk));
    /* page-aligned slots: a trainer's writes never share a page with the values */
    uint64_t stride = (local_total * 4 + 4095) & ~(uint64_t)4095;
    uint64_t slots_off = (values_off + local_total * 4 + 4095) & ~(uint64_t)4095;
    uint64_t bytes = slots_off + stride * n_trainers;
    int fd = memfd_create("zps-ps-shm", MFD_CLOEXEC);
    if (fd < 0) {
        zps_log(ZPS_WARN, "ps", "shared memory: memfd_create: %s", strerror(errno));
        return ZPS_ERR_SYS;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        zps_log(ZPS_WARN, "ps", "shared memory: ftruncate to %llu bytes: %s",
                (unsigned long long)bytes, strerror(errno));
        close(fd);
        return ZPS_ERR_SYS;
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        zps_log(ZPS_WARN, "ps", "shared memory: mmap of %llu bytes: %s", (unsigned long long)bytes,
                strerror(errno));
        close(fd);
        return ZPS_ERR_SYS;
    }
    ps_shm_hdr *h = base;
    uint64_t nonce = 0;
    while (!nonce)
        if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
            nonce = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)base;
    h->nonce = nonce;
    h->n_local = n_local;
    h->n_trainers = n_trainers;
    h->num_chunks = num_chunks;
    h->local_total = local_total;
    h->chunks_off = chunks_off;
    h->values_off = values_off;
    h->slots_off = slots_off;
    h->slot_stride_bytes = stride;
    h->bytes = bytes;
    ps_shm_chunk *c = (ps_shm_chunk *)((char *)base + chunks_off);
    for (uint32_t i = 0; i < n_local; i++) {
        c[i].key = keys[i];
        c[i].count = counts[i];
        c[i].off = offs[i];
        atomic_init(&c[i].seq, 0);
    }
    atomic_store_explicit(&h->valid, 1, memory_order_relaxed);
    h->magic = PS_SHM_MAGIC;
    *out = s_wrap(base, bytes, fd);
    return ZPS_OK;
}

zps_status ps_shm_attach(uint32_t pid, uint32_t fd, uint64_t bytes, uint64_t nonce, ps_shm **out,
                         char *why, size_t why_len)
{
    *out = NULL;
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%u", pid, fd);
    int f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) {
        snprintf(why, why_len, "cannot open %s: %s", path, strerror(errno));
        return ZPS_ERR_NOT_FOUND;
    }
    struct stat st;
    if (fstat(f, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != bytes ||
        bytes < sizeof(ps_shm_hdr)) {
        snprintf(why, why_len, "%s is not the segment offered (size)", path);
        close(f);
        return ZPS_ERR_CORRUPT;
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    close(f); // the mapping keeps the memory
    if (base == MAP_FAILED) {
        snprintf(why, why_len, "mmap of %s: %s", path, strerror(errno));
        return ZPS_ERR_NOT_FOUND;
    }
    const ps_shm_hdr *h = base;
    uint64_t need = 0;
    int ok = h->magic == PS_SHM_MAGIC && h->nonce == nonce && h->bytes == bytes;
    if (ok) {
        need = h->slots_off + h->slot_stride_bytes * h->n_trainers;
        ok = need <= bytes && h->values_off + h->local_total * 4 <= h->slots_off &&
             h->chunks_off + (uint64_t)h->n_local * sizeof(ps_shm_chunk) <= h->values_off &&
             h->slot_stride_bytes >= h->local_total * 4;
    }
    if (!ok) {
        snprintf(why, why_len, "%s is not the segment offered (header)", path);
        munmap(base, bytes);
        return ZPS_ERR_CORRUPT;
    }
    ps_shm *m = s_wrap(base, bytes, -1);
    m->key_to_local = zps_xmalloc(((size_t)h->num_chunks + 1) * sizeof *m->key_to_local);
    for (uint32_t k = 0; k < h->num_chunks; k++)
        m->key_to_local[k] = -1;
    for (uint32_t i = 0; i < h->n_local; i++) {
        const ps_shm_chunk *c = &m->chunks[i];
        if (c->key >= h->num_chunks || c->off + c->count > h->local_total) {
            snprintf(why, why_len, "%s: chunk %u is outside the segment", path, i);
            ps_shm_destroy(&m);
            return ZPS_ERR_CORRUPT;
        }
        m->key_to_local[c->key] = (int32_t)i;
    }
    *out = m;
    return ZPS_OK;
}

void ps_shm_destroy(ps_shm **mp)
{
    ps_shm *m = *mp;
    if (!m)
        return;
    munmap(m->hdr, m->bytes);
    if (m->fd >= 0)
        close(m->fd);
    free(m->key_to_local);
    free(m);
    *mp = NULL;
}

int ps_shm_valid(const ps_shm *m)
{
    return m && atomic_load_explicit(&((ps_shm_hdr *)m->hdr)->valid, memory_order_acquire) == 1;
}

void ps_shm_invalidate(ps_shm *m)
{
    if (m)
        atomic_store_explicit(&m->hdr->valid, 0, memory_order_release);
}

float *ps_shm_slot(const ps_shm *m, uint32_t t)
{
    return (float *)((char *)m->hdr + m->hdr->slots_off + m->hdr->slot_stride_bytes * t);
}

void ps_shm_write_begin(ps_shm *m, uint32_t lc)
{
    atomic_fetch_add_explicit(&m->chunks[lc].seq, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); // the odd word before any value changes
}

void ps_shm_write_end(ps_shm *m, uint32_t lc)
{
    atomic_fetch_add_explicit(&m->chunks[lc].seq, 1, memory_order_release);
}

int ps_shm_read(const ps_shm *m, uint32_t lc, uint64_t off, uint64_t n, float *dst)
{
    ps_shm_chunk *c = &m->chunks[lc];
    uint64_t s0 = atomic_load_explicit(&c->seq, memory_order_acquire);
    if (s0 & 1)
        return -1;
    memcpy(dst, m->values + c->off + off, n * 4);
    atomic_thread_fence(memory_order_acquire); // the copy before the second look
    return atomic_load_explicit(&c->seq, memory_order_relaxed) == s0 ? 0 : -1;
}
