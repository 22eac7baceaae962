/* mem.c — see mem.h. The arena is a list of blocks; in the steady state it is exactly one. */
#include "common/mem.h"

#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void s_oom(size_t n, const char *file, int line)
{
    fprintf(stderr, "zps: out of memory allocating %zu bytes at %s:%d\n", n, file, line);
    abort();
}

void *zps_xmalloc_at(size_t n, const char *file, int line)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        s_oom(n, file, line);
    return p;
}

void *zps_xcalloc_at(size_t count, size_t n, const char *file, int line)
{
    void *p = calloc(count ? count : 1, n ? n : 1);
    if (!p)
        s_oom(count * n, file, line);
    return p;
}

void *zps_xrealloc_at(void *p, size_t n, const char *file, int line)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        s_oom(n, file, line);
    return q;
}

char *zps_xstrdup_at(const char *s, const char *file, int line)
{
    size_t n = strlen(s) + 1;
    char *d = zps_xmalloc_at(n, file, line);
    memcpy(d, s, n);
    return d;
}

void *zps_xaligned_at(size_t align, size_t n, const char *file, int line)
{
    size_t rounded = (n + align - 1) / align * align;
    if (rounded == 0)
        rounded = align;
    void *p = NULL;
    if (posix_memalign(&p, align, rounded) != 0 || !p)
        s_oom(n, file, line);
    return p;
}

void zps_aligned_free(void *p) { free(p); }

void zps_malloc_keep_warm(void)
{
    mallopt(M_ARENA_MAX, 1);
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_TOP_PAD, 64 << 20);
}

void zps_prefault(void *p, size_t n)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    volatile char *c = p;
    for (size_t i = 0; i < n; i += (size_t)page)
        c[i] = 0;
}

typedef struct s_block {
    struct s_block *next; // older block, or NULL
    size_t size;          // usable bytes in data
    size_t used;          // bytes handed out from data
    char *data;           // ZPS_ARENA_ALIGN-aligned
} s_block;

struct zps_arena {
    s_block *head;     // block allocations come from; older blocks follow
    size_t used;       // bytes handed out since reset (all blocks, with padding)
    size_t capacity;   // sum of block sizes
    size_t high_water; // max of used
    size_t grows;      // blocks requested from the system
};

static s_block *s_block_new(zps_arena *a, size_t size)
{
    s_block *b = zps_xmalloc(sizeof *b);
    b->next = NULL;
    b->size = size;
    b->used = 0;
    b->data = zps_xaligned(ZPS_ARENA_ALIGN, size);
    zps_prefault(b->data, size);
    a->capacity += size;
    a->grows++;
    return b;
}

static void s_block_free(s_block *b)
{
    zps_aligned_free(b->data);
    free(b);
}

zps_arena *zps_arena_new(size_t initial_bytes)
{
    zps_arena *a = zps_xcalloc(1, sizeof *a);
    if (initial_bytes)
        a->head = s_block_new(a, initial_bytes);
    return a;
}

void zps_arena_destroy(zps_arena **pa)
{
    if (!pa || !*pa)
        return;
    zps_arena *a = *pa;
    for (s_block *b = a->head, *next; b; b = next) {
        next = b->next;
        s_block_free(b);
    }
    free(a);
    *pa = NULL;
}

void *zps_arena_alloc(zps_arena *a, size_t n)
{
    size_t need = (n + ZPS_ARENA_ALIGN - 1) / ZPS_ARENA_ALIGN * ZPS_ARENA_ALIGN;
    if (need == 0)
        need = ZPS_ARENA_ALIGN;
    s_block *b = a->head;
    if (!b || b->size - b->used < need) {
        /* Grow geometrically so a first step with many requests makes few blocks. */
        size_t size = a->capacity > need ? a->capacity : need;
        if (size < (1u << 20))
            size = (size_t)1 << 20;
        s_block *nb = s_block_new(a, size);
        nb->next = b;
        a->head = b = nb;
    }
    void *p = b->data + b->used;
    b->used += need;
    a->used += need;
    if (a->used > a->high_water)
        a->high_water = a->used;
    return p;
}

void *zps_arena_calloc(zps_arena *a, size_t n)
{
    void *p = zps_arena_alloc(a, n);
    memset(p, 0, n);
    return p;
}

void zps_arena_reset(zps_arena *a)
{
    if (a->head && a->head->next) {
        /* More than one block: coalesce into one of the high-water size. */
        size_t size = a->high_water;
        for (s_block *b = a->head, *next; b; b = next) {
            next = b->next;
            s_block_free(b);
        }
        a->head = NULL;
        a->capacity = 0;
        a->head = s_block_new(a, size);
    }
    if (a->head)
        a->head->used = 0;
    a->used = 0;
}

size_t zps_arena_used(const zps_arena *a) { return a->used; }
size_t zps_arena_capacity(const zps_arena *a) { return a->capacity; }
size_t zps_arena_high_water(const zps_arena *a) { return a->high_water; }
size_t zps_arena_grow_count(const zps_arena *a) { return a->grows; }
