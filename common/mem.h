/* mem.h — allocation that cannot fail silently, and the per-step buffer arena.
 *
 * zps_xmalloc and friends abort with file:line when memory runs out (the style's rule: out of
 * memory is not a recoverable status). Aligned blocks are freed with zps_aligned_free.
 *
 * The arena exists because, on the VMs zps runs on, memory freed and faulted back in costs
 * more than the copy itself (freeing and re-faulting large buffers every step made PyTorch's
 * CPU training 3-4x slower). A training step or a message handler allocates all its scratch
 * from an arena and calls zps_arena_reset() at the end; the memory is never returned to the
 * system until zps_arena_destroy(). Invariant: once a step has run with no growth, later
 * steps that make the same requests get the same addresses and the arena never grows again.
 * An arena is not thread-safe; give each thread its own.
 */
#ifndef ZPS_COMMON_MEM_H
#define ZPS_COMMON_MEM_H

#include <stddef.h>

void *zps_xmalloc_at(size_t n, const char *file, int line);
void *zps_xcalloc_at(size_t count, size_t n, const char *file, int line);
void *zps_xrealloc_at(void *p, size_t n, const char *file, int line);
char *zps_xstrdup_at(const char *s, const char *file, int line);
/* align: a power of two >= sizeof(void *); n is rounded up to a multiple of align. */
void *zps_xaligned_at(size_t align, size_t n, const char *file, int line);

#define zps_xmalloc(n) zps_xmalloc_at((n), __FILE__, __LINE__)
#define zps_xcalloc(c, n) zps_xcalloc_at((c), (n), __FILE__, __LINE__)
#define zps_xrealloc(p, n) zps_xrealloc_at((p), (n), __FILE__, __LINE__)
#define zps_xstrdup(s) zps_xstrdup_at((s), __FILE__, __LINE__)
#define zps_xaligned(align, n) zps_xaligned_at((align), (n), __FILE__, __LINE__)
void zps_aligned_free(void *p);

/* Writes one byte per page so the pages are resident before the hot path touches them. */
void zps_prefault(void *p, size_t n);

/* Keeps large allocations on the heap and never trims it, so memory freed after a message
 * or a step is reused warm (mmap + munmap per large buffer faults every page again; on
 * these VMs that costs more than the copy). zps-server and zps-trainer call it at start.
 * Process-wide: call once at process start, before any thread exists. */
void zps_malloc_keep_warm(void);

/* Alignment of every arena allocation (cache line and AVX-512 vector). */
#define ZPS_ARENA_ALIGN 64

typedef struct zps_arena zps_arena;

/* An arena with one block of at least initial_bytes (0: grow on first use). Never NULL. */
zps_arena *zps_arena_new(size_t initial_bytes);
/* Frees everything; *pa becomes NULL. Safe on NULL and on *pa == NULL. */
void zps_arena_destroy(zps_arena **pa);
/* A block of n bytes aligned to ZPS_ARENA_ALIGN, valid until the next reset or destroy.
 * Contents are undefined (not zeroed). n == 0 gives a valid unique pointer. */
void *zps_arena_alloc(zps_arena *a, size_t n);
/* zps_arena_alloc + zero fill. */
void *zps_arena_calloc(zps_arena *a, size_t n);
/* Ends a step: all allocations become invalid. If the step needed more than one block, the
 * blocks are replaced by one block of the high-water size, so the next step runs in one
 * contiguous block and never grows again for the same requests. */
void zps_arena_reset(zps_arena *a);
/* Bytes handed out since the last reset. */
size_t zps_arena_used(const zps_arena *a);
/* Bytes reserved from the system (all blocks). */
size_t zps_arena_capacity(const zps_arena *a);
/* Largest zps_arena_used() seen. */
size_t zps_arena_high_water(const zps_arena *a);
/* Number of times the arena asked the system for memory. */
size_t zps_arena_grow_count(const zps_arena *a);

#endif
