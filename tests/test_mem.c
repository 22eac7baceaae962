/* test_mem.c — the per-step arena: alignment, reuse, no growth in the steady state. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"

/* One "training step": a fixed sequence of buffers of mixed sizes, each written fully. */
static void s_step(zps_arena *a, void **ptrs, const size_t *sizes, int n)
{
    for (int i = 0; i < n; i++) {
        ptrs[i] = zps_arena_alloc(a, sizes[i]);
        cr_assert_eq((uintptr_t)ptrs[i] % ZPS_ARENA_ALIGN, 0, "allocation %d misaligned", i);
        memset(ptrs[i], i & 0xff, sizes[i]);
    }
    /* Distinct allocations never overlap. */
    for (int i = 0; i < n; i++)
        cr_assert_eq(((unsigned char *)ptrs[i])[0], i & 0xff);
}

Test(mem, arena_reuses_addresses_and_stops_growing)
{
    enum { N = 40 };
    size_t sizes[N];
    srand(1234);
    for (int i = 0; i < N; i++)
        sizes[i] = (size_t)(rand() % (3 << 20)) + 1; /* up to 3 MiB: forces several blocks */
    zps_arena *a = zps_arena_new(0);
    void *first[N], *second[N], *now[N];
    s_step(a, first, sizes, N);
    cr_assert(zps_arena_grow_count(a) > 1, "the first step should need several blocks");
    zps_arena_reset(a);
    s_step(a, second, sizes, N);
    size_t cap = zps_arena_capacity(a), grows = zps_arena_grow_count(a);
    cr_assert_eq(cap, zps_arena_high_water(a), "steady state is one block of high-water size");
    for (int step = 0; step < 5; step++) {
        zps_arena_reset(a);
        cr_assert_eq(zps_arena_used(a), 0);
        s_step(a, now, sizes, N);
        for (int i = 0; i < N; i++)
            cr_assert_eq(now[i], second[i], "step %d buffer %d moved", step, i);
        cr_assert_eq(zps_arena_capacity(a), cap, "arena grew at step %d", step);
        cr_assert_eq(zps_arena_grow_count(a), grows, "arena asked the system at step %d", step);
    }
    zps_arena_destroy(&a);
    cr_assert_null(a);
    zps_arena_destroy(&a); /* idempotent */
}

Test(mem, arena_zero_size_and_calloc)
{
    zps_arena *a = zps_arena_new(4096);
    void *p = zps_arena_alloc(a, 0), *q = zps_arena_alloc(a, 0);
    cr_assert_neq(p, q);
    unsigned char *z = zps_arena_calloc(a, 1000);
    for (int i = 0; i < 1000; i++)
        cr_assert_eq(z[i], 0);
    cr_assert_eq(zps_arena_grow_count(a), 1);
    zps_arena_destroy(&a);
}

Test(mem, aligned_alloc)
{
    for (size_t align = 16; align <= 4096; align *= 2) {
        void *p = zps_xaligned(align, 1000);
        cr_assert_eq((uintptr_t)p % align, 0);
        memset(p, 1, 1000);
        zps_aligned_free(p);
    }
    char *s = zps_xstrdup("zps");
    cr_assert_str_eq(s, "zps");
    free(s);
}
