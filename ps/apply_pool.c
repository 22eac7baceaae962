/* apply_pool.c — see apply_pool.h. */
#include "ps/apply_pool.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"

typedef struct s_worker {
    struct ps_apply_pool *pool;
    int index; // its slice (1 .. threads - 1; the caller runs slice 0)
} s_worker;

struct ps_apply_pool {
    int threads;
    pthread_t *tid;       // (threads - 1)
    s_worker *workers;    // (threads - 1)
    int started;          // workers running (destroy joins these)
    pthread_mutex_t mu;
    pthread_cond_t go;    // a new update (gen) or quit
    pthread_cond_t done;  // pending reached 0
    uint64_t gen;         // updates handed out so far
    int pending;          // workers still on the current update
    int quit;
    /* the current update (read by the workers between go and their pending--) */
    const ps_optim_config *c;
    uint64_t step;
    float *w;
    float *slots[2];
    const float *g;
    size_t n;
    int parts;            // slices it is cut into (<= threads)
};

/* Slice i of parts over n floats: [lo, hi), whole cache lines but for the last. */
static void s_slice(size_t n, int parts, int i, size_t *lo, size_t *hi)
{
    size_t lines = (n + 15) / 16, per = lines / (size_t)parts, extra = lines % (size_t)parts;
    size_t a = (size_t)i * per + ((size_t)i < extra ? (size_t)i : extra);
    size_t b = a + per + ((size_t)i < extra ? 1 : 0);
    *lo = a * 16 < n ? a * 16 : n;
    *hi = b * 16 < n ? b * 16 : n;
}

static void s_run_slice(struct ps_apply_pool *p, int i)
{
    if (i >= p->parts)
        return;
    size_t lo, hi;
    s_slice(p->n, p->parts, i, &lo, &hi);
    if (lo >= hi)
        return;
    float *sl[2] = {p->slots[0] ? p->slots[0] + lo : NULL, p->slots[1] ? p->slots[1] + lo : NULL};
    ps_optim_apply(p->c, p->step, p->w + lo, sl, p->g + lo, hi - lo);
}

static void *s_thread(void *arg)
{
    s_worker *wk = arg;
    struct ps_apply_pool *p = wk->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->quit)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->quit)
            break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        s_run_slice(p, wk->index);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

zps_status ps_apply_pool_new(int threads, ps_apply_pool **out)
{
    *out = NULL;
    if (threads < 1 || threads > PS_APPLY_MAX_THREADS)
        return ZPS_ERR_INVALID;
    ps_apply_pool *p = zps_xcalloc(1, sizeof *p);
    p->threads = threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    if (threads > 1) {
        p->tid = zps_xcalloc((size_t)threads - 1, sizeof *p->tid);
        p->workers = zps_xcalloc((size_t)threads - 1, sizeof *p->workers);
    }
    for (int i = 1; i < threads; i++) {
        p->workers[i - 1] = (s_worker){.pool = p, .index = i};
        int rc = pthread_create(&p->tid[i - 1], NULL, s_thread, &p->workers[i - 1]);
        if (rc != 0) {
            zps_log(ZPS_ERROR, "ps", "--apply-threads %d: thread %d: pthread_create: %s",
                    threads, i, strerror(rc));
            ps_apply_pool_destroy(&p);
            return ZPS_ERR_INTERNAL;
        }
        p->started++;
    }
    *out = p;
    return ZPS_OK;
}

void ps_apply_pool_destroy(ps_apply_pool **pp)
{
    ps_apply_pool *p = *pp;
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++)
        pthread_join(p->tid[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p->tid);
    free(p->workers);
    free(p);
    *pp = NULL;
}

int ps_apply_pool_threads(const ps_apply_pool *p) { return p ? p->threads : 1; }

void ps_apply_pool_run(ps_apply_pool *p, const ps_optim_config *c, uint64_t step, float *w,
                       float *const *slots, const float *g, size_t n)
{
    size_t most = n / PS_APPLY_MIN;
    if (!p || p->threads == 1 || most < 2) {
        ps_optim_apply(c, step, w, slots, g, n);
        return;
    }
    int k = ps_optim_slots(c->kind);
    pthread_mutex_lock(&p->mu);
    p->c = c, p->step = step, p->w = w, p->g = g, p->n = n;
    p->slots[0] = k > 0 ? slots[0] : NULL;
    p->slots[1] = k > 1 ? slots[1] : NULL;
    p->parts = most < (size_t)p->threads ? (int)most : p->threads;
    p->pending = p->threads - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    s_run_slice(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
