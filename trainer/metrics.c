/* metrics.c — JSON Lines per step, a summary record, and the progress line (see metrics.h).
 *
 * Everything a step needs lives in struct tr_metrics: the line buffer, sized once at
 * creation (room for the start record's configuration), is formatted with bounded appends
 * (a line that would not fit is a bug, caught by an assert) and written with one fwrite +
 * fflush. The option strings are used only by the start record, written at creation.
 */
#include "trainer/metrics.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/json.h"
#include "common/log.h"
#include "common/mem.h"

#define S_LINE 2048
#define S_TTY_PERIOD_S 0.2

struct tr_metrics {
    tr_metrics_opts o;        // copy of the options (its strings are not kept: NULL)
    char path[1024];          // the JSONL path, for error messages
    FILE *f;                  // JSONL file or NULL
    FILE *out;                // progress stream
    int tty;                  // progress rewritten in place
    int finished;             // summary written
    int dirty_tty;            // an in-place line is on screen (needs a newline at the end)
    uint64_t t0_ns;           // clock start
    double fake_now;          // >= 0: test clock
    double last_t;            // time of the previous step record
    double last_print_t;      // time of the previous progress output
    int64_t print_images;     // images since the previous progress output
    double print_net_wait;    // network wait since the previous progress output
    double print_eval_s;      // evaluation time since the previous progress output
    tr_metrics_totals tot;    // running totals
    double staleness_sum;     // for the mean
    int64_t staleness_n;      // steps that reported staleness
    int64_t last_step;        // step number of the last record
    int64_t max_step;         // the highest step number recorded (redone steps are below)
    int64_t skipped;          // corrupt training records skipped (tr_metrics_set_end)
    const char *end;          // how the run ended: "done", "signal", "error" (a literal)
    char *line;               // (cap) the reused output buffer
    size_t cap;               // S_LINE + room for the start record's configuration
    size_t len;               // bytes used in line
};

/* ---------------------------------------------------------------- formatting */

static void s_reset(tr_metrics *m) { m->len = 0; m->line[0] = 0; }

static void s_append(tr_metrics *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void s_append(tr_metrics *m, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(m->line + m->len, m->cap - m->len, fmt, ap);
    va_end(ap);
    assert(n >= 0 && (size_t)n < m->cap - m->len && "metrics line too long");
    m->len += (size_t)n;
}

/* ,"key":value with %.*g, or null when not finite */
static void s_num(tr_metrics *m, const char *key, double v, int prec)
{
    if (isfinite(v))
        s_append(m, ",\"%s\":%.*g", key, prec, v);
    else
        s_append(m, ",\"%s\":null", key);
}

/* ,"key":value, or null when v < 0 (not measured) */
static void s_opt(tr_metrics *m, const char *key, double v, int prec)
{
    s_num(m, key, v < 0 ? NAN : v, prec);
}

static zps_status s_write_line(tr_metrics *m)
{
    if (!m->f)
        return ZPS_OK;
    s_append(m, "\n");
    if (fwrite(m->line, 1, m->len, m->f) != m->len || fflush(m->f) != 0) {
        zps_log(ZPS_ERROR, "metrics", "cannot write %s: %s", m->path, strerror(errno));
        return ZPS_ERR_IO;
    }
    return ZPS_OK;
}

static double s_now(const tr_metrics *m)
{
    if (m->fake_now >= 0)
        return m->fake_now;
    return (double)(zps_now_ns() - m->t0_ns) * 1e-9;
}

/* "1h02m", "3m05s", "12s" */
static void s_duration(char *buf, size_t len, double s)
{
    if (!(s >= 0) || s > 1e8) {
        snprintf(buf, len, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, len, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
        snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, len, "%lds", t);
}

/* ---------------------------------------------------------------- progress */

static void s_progress(tr_metrics *m, double now, int force)
{
    if (m->o.mode == TR_PROGRESS_OFF)
        return;
    double since = now - m->last_print_t;
    double period = m->tty ? S_TTY_PERIOD_S : m->o.progress_every_s;
    if (!force && since < period)
        return;
    /* the progress text is built in the same buffer after the JSON line was written */
    s_reset(m);
    if (m->tty)
        s_append(m, "\r");
    if (m->o.trainer_id >= 0)
        s_append(m, "trainer %d | ", m->o.trainer_id);
    s_append(m, "step %lld", (long long)m->last_step);
    if (m->o.total_steps > 0)
        s_append(m, "/%lld (%.0f%%)", (long long)m->o.total_steps,
                 100.0 * (double)m->last_step / (double)m->o.total_steps);
    if (isfinite(m->tot.last_loss))
        s_append(m, " | loss %.4f", m->tot.last_loss);
    if (m->tot.last_accuracy >= 0)
        s_append(m, m->o.score_map ? " | test mAP %.2f%%" : " | test acc %.2f%%",
                 100.0 * m->tot.last_accuracy);
    double busy = since - m->print_eval_s; /* training's rate: evaluations left out */
    double rate = busy > 0 ? (double)m->print_images / busy : 0;
    if (rate > 0)
        s_append(m, " | %.0f img/s", rate);
    if (since > 0 && m->print_net_wait > 0)
        s_append(m, " | net %.0f%%", 100.0 * m->print_net_wait / since);
    if (m->staleness_n > 0)
        s_append(m, " | stale %.1f", m->tot.staleness_mean);
    char d[32];
    s_duration(d, sizeof d, now);
    s_append(m, " | %s", d);
    if (m->o.total_steps > 0 && m->last_step > 0 && m->last_step < m->o.total_steps) {
        double left = now / (double)m->last_step * (double)(m->o.total_steps - m->last_step);
        s_duration(d, sizeof d, left);
        s_append(m, ", %s left", d);
    }
    s_append(m, m->tty ? "\033[K" : "\n");
    fwrite(m->line, 1, m->len, m->out);
    fflush(m->out);
    m->dirty_tty = m->tty;
    m->last_print_t = now;
    m->print_images = 0;
    m->print_net_wait = 0;
    m->print_eval_s = 0;
}

/* ---------------------------------------------------------------- API */

tr_step_record tr_step_record_empty(int64_t step)
{
    tr_step_record r = {0};
    r.step = step;
    r.loss = NAN;
    r.staleness = -1;
    r.lr = -1;
    r.train_accuracy = -1;
    r.test_accuracy = -1;
    r.test_loss = -1;
    r.test_map = -1;
    r.matched = -1;
    r.eval_s = -1;
    return r;
}

/* The start record (metrics.h) into j. */
static void s_start_json(zps_json *j, const tr_metrics_opts *o)
{
    zps_json_raw(j, "{\"type\":\"start\",\"trainer\":%d,\"mode\":", o->trainer_id);
    zps_json_str(j, o->mode_name ? o->mode_name : "");
    zps_json_raw(j, ",\"model\":");
    zps_json_str(j, o->model ? o->model : "");
    zps_json_raw(j, ",\"batch\":%d,\"trainers\":%d,\"total_steps\":%lld,\"seed\":%llu",
                 o->batch, o->n_trainers, (long long)o->total_steps, (unsigned long long)o->seed);
    zps_json_run_info(j);
    zps_json_raw(j, o->score_map ? ",\"target_map\":" : ",\"target_accuracy\":");
    zps_json_num(j, o->target_accuracy > 0 ? o->target_accuracy : NAN, 6);
    zps_json_raw(j, ",\"config\":%s}", o->config_json ? o->config_json : "null");
}

/* Sizes the line buffer for the longest record, the start record with its configuration,
 * and writes the start record into it (not to the file yet). */
static void s_start_record(tr_metrics *m, const tr_metrics_opts *o)
{
    zps_json j = zps_json_over(NULL, 0);
    s_start_json(&j, o);
    m->cap = S_LINE + j.len; /* S_LINE: room for a step, and for the clock to move on */
    m->line = zps_xmalloc(m->cap);
    j = zps_json_over(m->line, m->cap);
    s_start_json(&j, o);
    assert(zps_json_fits(&j));
    m->len = j.len;
}

zps_status tr_metrics_new(const tr_metrics_opts *opts, tr_metrics **out)
{
    *out = NULL;
    tr_metrics *m = zps_xcalloc(1, sizeof *m);
    m->o = *opts;
    if (m->o.progress_every_s <= 0)
        m->o.progress_every_s = 10;
    m->out = opts->progress ? opts->progress : stderr;
    m->tty = m->o.mode == TR_PROGRESS_TTY ||
             (m->o.mode == TR_PROGRESS_AUTO && isatty(fileno(m->out)));
    m->fake_now = -1;
    m->end = "done";
    m->tot.last_loss = NAN;
    m->tot.last_accuracy = -1;
    m->tot.best_accuracy = -1;
    m->tot.time_to_target = -1;
    m->tot.staleness_mean = -1;
    m->tot.staleness_max = -1;
    m->o.jsonl_path = m->o.mode_name = m->o.model = m->o.config_json = NULL; // not kept
    if (opts->jsonl_path) {
        snprintf(m->path, sizeof m->path, "%s", opts->jsonl_path);
        m->f = fopen(opts->jsonl_path, "w");
        if (!m->f) {
            int e = errno;
            zps_log(ZPS_ERROR, "metrics", "cannot create %s: %s", opts->jsonl_path,
                    strerror(e));
            free(m);
            return e == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
        }
    }
    m->t0_ns = zps_now_ns();
    s_start_record(m, opts);
    zps_status st = s_write_line(m);
    if (st != ZPS_OK) {
        m->finished = 1; // no summary after a failed start
        tr_metrics_destroy(&m);
        return st;
    }
    *out = m;
    return ZPS_OK;
}

zps_status tr_metrics_step(tr_metrics *m, const tr_step_record *r)
{
    if (m->finished) {
        zps_log(ZPS_ERROR, "metrics", "step %lld after finish", (long long)r->step);
        return ZPS_ERR_INVALID;
    }
    double now = s_now(m), dt = now - m->last_t, ev = r->eval_s > 0 ? r->eval_s : 0;
    /* training's rate: an evaluation's time is its own field, not a dip in img_s */
    double img_s = dt - ev > 0 ? (double)r->images / (dt - ev) : NAN;
    tr_metrics_totals *t = &m->tot;
    /* a step number not past the last one is a redo after a sync rollback (docs/ps.md
     * "Recovery"): work done (images, time), but not a new step */
    if (t->steps > 0 && r->step <= m->max_step) {
        t->redone_steps++;
    } else {
        t->steps++;
        m->max_step = r->step;
    }
    t->images += r->images;
    t->time_s = now;
    t->img_per_s = now > 0 ? (double)t->images / now : 0;
    t->last_loss = r->loss;
    t->bytes_pushed += r->bytes_pushed;
    t->bytes_pulled += r->bytes_pulled;
    t->net_wait_s += r->net_wait_s > 0 ? r->net_wait_s : 0;
    if (r->staleness >= 0) {
        m->staleness_sum += r->staleness;
        m->staleness_n++;
        t->staleness_mean = m->staleness_sum / (double)m->staleness_n;
        if (r->staleness > t->staleness_max)
            t->staleness_max = r->staleness;
    }
    double score = m->o.score_map ? r->test_map : r->test_accuracy;
    int evaluated = score >= 0;
    if (evaluated) {
        t->evals++;
        t->last_accuracy = score;
        if (score > t->best_accuracy)
            t->best_accuracy = score;
        if (t->time_to_target < 0 && m->o.target_accuracy > 0 &&
            score >= m->o.target_accuracy)
            t->time_to_target = now;
    }
    m->last_t = now;
    m->last_step = r->step;
    m->print_images += r->images;
    m->print_net_wait += r->net_wait_s > 0 ? r->net_wait_s : 0;
    m->print_eval_s += ev;
    t->eval_s += ev;

    s_reset(m);
    s_append(m, "{\"type\":\"step\",\"trainer\":%d,\"step\":%lld", m->o.trainer_id,
             (long long)r->step);
    s_num(m, "time", now, 7);
    s_num(m, "loss", r->loss, 6);
    s_num(m, "img_s", img_s, 6);
    s_append(m, ",\"images\":%lld,\"bytes_pushed\":%llu,\"bytes_pulled\":%llu",
             (long long)r->images, (unsigned long long)r->bytes_pushed,
             (unsigned long long)r->bytes_pulled);
    s_num(m, "net_wait", r->net_wait_s, 6);
    s_opt(m, "staleness", r->staleness, 6);
    if (r->lr >= 0)
        s_num(m, "lr", r->lr, 6);
    if (r->train_accuracy >= 0)
        s_num(m, "train_accuracy", r->train_accuracy, 6);
    if (r->matched >= 0) {
        s_num(m, "loss_conf", r->loss_conf, 6);
        s_num(m, "loss_loc", r->loss_loc, 6);
        s_append(m, ",\"matched\":%lld", (long long)r->matched);
    }
    if (evaluated) {
        s_num(m, m->o.score_map ? "map" : "accuracy", score, 6);
        s_opt(m, "test_loss", r->test_loss, 6);
    }
    if (r->eval_s >= 0)
        s_num(m, "eval_s", r->eval_s, 6);
    s_append(m, "}");
    zps_status st = s_write_line(m);
    int last = m->o.total_steps > 0 && r->step >= m->o.total_steps;
    s_progress(m, now, evaluated || t->steps == 1 || last);
    return st;
}

zps_status tr_metrics_finish(tr_metrics *m)
{
    if (m->finished)
        return ZPS_OK;
    m->finished = 1;
    tr_metrics_totals *t = &m->tot;
    s_reset(m);
    s_append(m, "{\"type\":\"summary\",\"trainer\":%d,\"steps\":%lld", m->o.trainer_id,
             (long long)t->steps);
    s_num(m, "time", t->time_s, 7);
    s_append(m, ",\"images\":%lld", (long long)t->images);
    s_num(m, "img_s", t->img_per_s, 6);
    s_num(m, "final_loss", t->last_loss, 6);
    s_opt(m, m->o.score_map ? "final_map" : "final_accuracy", t->last_accuracy, 6);
    s_opt(m, m->o.score_map ? "best_map" : "best_accuracy", t->best_accuracy, 6);
    s_opt(m, "time_to_target", t->time_to_target, 6);
    s_append(m, ",\"bytes_pushed\":%llu,\"bytes_pulled\":%llu",
             (unsigned long long)t->bytes_pushed, (unsigned long long)t->bytes_pulled);
    s_num(m, "net_wait", t->net_wait_s, 6);
    s_num(m, "net_wait_frac", t->time_s > 0 ? t->net_wait_s / t->time_s : 0, 4);
    s_opt(m, "staleness_mean", t->staleness_mean, 6);
    s_opt(m, "staleness_max", t->staleness_max, 6);
    s_num(m, "eval_time", t->eval_s, 6);
    s_append(m, ",\"evals\":%d,\"skipped_records\":%lld,\"redone_steps\":%lld,\"end\":\"%s\"}",
             t->evals, (long long)m->skipped, (long long)t->redone_steps, m->end);
    zps_status st = s_write_line(m);
    if (m->o.mode != TR_PROGRESS_OFF) {
        if (m->dirty_tty)
            fputs("\n", m->out);
        m->dirty_tty = 0;
        s_reset(m);
        if (m->o.trainer_id >= 0)
            s_append(m, "trainer %d | ", m->o.trainer_id);
        char d[32];
        s_duration(d, sizeof d, t->time_s);
        s_append(m, "done: %lld steps in %s, %.1f img/s", (long long)t->steps, d,
                 t->img_per_s);
        if (isfinite(t->last_loss))
            s_append(m, ", final loss %.4f", t->last_loss);
        if (t->last_accuracy >= 0)
            s_append(m, m->o.score_map ? ", test mAP@0.5 %.2f%% (best %.2f%%)"
                                       : ", test accuracy %.2f%% (best %.2f%%)",
                     100 * t->last_accuracy, 100 * t->best_accuracy);
        if (t->time_to_target >= 0) {
            s_duration(d, sizeof d, t->time_to_target);
            s_append(m, ", %.0f%% reached at %s", 100 * m->o.target_accuracy, d);
        }
        if (m->skipped)
            s_append(m, ", %lld corrupt records skipped", (long long)m->skipped);
        if (strcmp(m->end, "done") != 0)
            s_append(m, " (stopped by %s)", strcmp(m->end, "signal") == 0 ? "a signal" : "an error");
        s_append(m, "\n");
        fwrite(m->line, 1, m->len, m->out);
        fflush(m->out);
    }
    return st;
}

void tr_metrics_get_totals(const tr_metrics *m, tr_metrics_totals *out) { *out = m->tot; }

void tr_metrics_set_end(tr_metrics *m, tr_metrics_end end, int64_t skipped)
{
    static const char *const names[] = {"done", "signal", "error"};
    assert((unsigned)end < sizeof names / sizeof names[0]);
    m->end = names[end];
    m->skipped = skipped;
}

void tr_metrics_set_fake_time(tr_metrics *m, double now_s) { m->fake_now = now_s; }

void tr_metrics_destroy(tr_metrics **pm)
{
    if (!pm || !*pm)
        return;
    tr_metrics *m = *pm;
    tr_metrics_finish(m);
    if (m->f && fclose(m->f) != 0)
        zps_log(ZPS_ERROR, "metrics", "closing the metrics file: %s", strerror(errno));
    free(m->line);
    free(m);
    *pm = NULL;
}
