/* metrics.h — per-step training metrics: JSON Lines for scripts, one progress line for people.
 *
 * A trainer creates one tr_metrics, calls tr_metrics_step once per step (with the test
 * accuracy filled in on the steps where it evaluated) and tr_metrics_finish at the end. The
 * JSONL file (docs/training.md, "Metrics files") holds one object per line:
 *
 *   {"type":"start","trainer":0,"mode":"async","model":"lenet","batch":64,"trainers":2,
 *    "total_steps":500,"seed":1,"host":"n1","pid":4242,"wall_ms":1795000000000,
 *    "start_time":"2026-11-19T08:53:20Z","version":"0.3.0","git_hash":"0123456789ab",
 *    "target_accuracy":0.85,"config":{"model":"lenet","batch-size":64,...}}
 *   {"type":"step","trainer":0,"step":1,"time":0.0421,"loss":2.3026,"img_s":1520.3,
 *    "images":64,"bytes_pushed":431080,"bytes_pulled":431080,"net_wait":0.0031,
 *    "staleness":0,"lr":0.01}
 *   ... steps that evaluated also carry "accuracy" (test accuracy, 0..1) and "test_loss";
 *       "train_accuracy" when the trainer measured it; "staleness" is null when unknown
 *   A detector run (score_map) evaluates VOC mAP@0.5 instead: its steps carry "map" where a
 *   classifier's carry "accuracy", and "loss_conf", "loss_loc", "matched" (the loss's parts,
 *   task_detect.c) on every step; its start record says "target_map" and its summary
 *   "final_map", "best_map" where a classifier's say "target_accuracy", "final_accuracy",
 *   "best_accuracy". The totals' accuracy fields then hold the mAP.
 *   {"type":"summary","trainer":0,"steps":500,"time":61.2,"images":32000,"img_s":522.9,
 *    "final_loss":0.31,"final_accuracy":0.874,"best_accuracy":0.874,"time_to_target":48.9,
 *    "bytes_pushed":...,"bytes_pulled":...,"net_wait":4.1,"net_wait_frac":0.067,
 *    "staleness_mean":0.8,"staleness_max":3,"evals":10,"skipped_records":0,
 *    "redone_steps":0,"end":"done"}
 *
 * "config" is every zps-trainer flag's effective value, keyed by the flag's name
 * (tr_config_json); "seed" the seed the run used; "host", "pid", "wall_ms" (Unix ms) and
 * "start_time" (UTC) say which process wrote the file and when; "version" and "git_hash"
 * the build (common/version.h).
 * "end" says how the run ended: "done" (its steps, target or time limit), "signal" (SIGTERM
 * or SIGINT) or "error"; every way out of a started run writes the summary.
 * "skipped_records" counts the corrupt training records skipped (zps-trainer --skip-corrupt).
 * "steps" counts distinct steps; "redone_steps" the step records a sync rollback made the
 * trainer run again (their step records appear twice in the file; images and img_s count
 * the work of both).
 *
 * Units: time and net_wait in seconds since the trainer's first tr_metrics_step call starts
 * its clock (tr_metrics_new), img_s in images per second (this step: images / step time),
 * bytes as counted by the sync back-end for this step. Non-finite numbers are written as null.
 * Values not measured are null ("final_accuracy" with no evaluation, "time_to_target" when
 * never reached or no target).
 *
 * The progress line goes to a stream (default stderr). On a terminal it is rewritten in place
 * (\r ... erase to end of line) at most every 0.2 s and ends with a newline at finish; on a
 * file or pipe it is a plain line every `progress_every_s` seconds and on every evaluation.
 *
 * Invariants: after tr_metrics_new nothing allocates (one line buffer, sized there,
 * reused); every line is written whole with one fwrite and flushed, so a crash loses at most
 * the current step and a script can follow the file while training runs. Not thread-safe: call from the training
 * loop's thread.
 */
#ifndef ZPS_TRAINER_METRICS_H
#define ZPS_TRAINER_METRICS_H

#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

typedef enum tr_progress_mode {
    TR_PROGRESS_AUTO = 0, // in place on a terminal (isatty), plain lines otherwise
    TR_PROGRESS_TTY,      // always in place
    TR_PROGRESS_PLAIN,    // always plain lines
    TR_PROGRESS_OFF,      // no progress output
} tr_progress_mode;

typedef struct tr_metrics_opts {
    const char *jsonl_path;   // JSON Lines file (truncated); NULL: no file
    FILE *progress;           // progress stream; NULL: stderr
    tr_progress_mode mode;    // see above
    double progress_every_s;  // plain-line period (0: 10 s)
    int trainer_id;           // written in every record; -1 for a local run
    const char *mode_name;    // "local", "sync", "async", "ssp", "allreduce" (NULL: "")
    const char *model;        // model name (NULL: "")
    int batch;                // images per step on this trainer
    int n_trainers;           // trainers in the job
    int64_t total_steps;      // for the percentage and ETA (0: unknown)
    double target_accuracy;   // summary's time_to_target (0: none); a target mAP with score_map
    int score_map;            // a detector run: its evaluations are mAP@0.5 ("map" fields)
    uint64_t seed;            // the seed the run uses
    const char *config_json;  // the whole configuration, one JSON object (NULL: null)
} tr_metrics_opts;

/* One training step. Fields that were not measured: negative (staleness, lr, accuracies). */
typedef struct tr_step_record {
    int64_t step;            // 1-based global step number of this trainer
    int64_t images;          // images processed in the step (with accumulation: all of them)
    double loss;             // mean training loss of the step
    uint64_t bytes_pushed;   // gradient bytes sent this step
    uint64_t bytes_pulled;   // parameter bytes received this step
    double net_wait_s;       // seconds blocked on the network (or all-reduce) this step
    double staleness;        // versions between the values used and the newest (< 0: unknown)
    double lr;               // learning rate in effect (< 0: unknown)
    double train_accuracy;   // on this batch, 0..1 (< 0: not measured)
    double test_accuracy;    // evaluation on the test split this step, 0..1 (< 0: none)
    double test_loss;        // its loss (< 0 or NaN: none)
    double test_map;         // detector: VOC mAP@0.5 on the test split this step (< 0: none)
    double loss_conf;        // detector: the loss's cross-entropy part (matched < 0: none)
    double loss_loc;         // detector: its smooth-L1 part
    int64_t matched;         // detector: priors matched to a box in the step (< 0: none)
    double eval_s;           // seconds of the step spent evaluating (< 0: it did not)
} tr_step_record;

typedef struct tr_metrics tr_metrics;

/* A record with every optional field marked "not measured". */
tr_step_record tr_step_record_empty(int64_t step);

/* Opens the JSONL file (ZPS_ERR_IO / NOT_FOUND on failure) and writes the start record. The
 * clock starts here. opts are copied (strings too). */
zps_status tr_metrics_new(const tr_metrics_opts *opts, tr_metrics **out);

/* Records one step: a JSON line, the running totals, the progress line. ZPS_ERR_IO when the
 * file cannot be written. */
zps_status tr_metrics_step(tr_metrics *m, const tr_step_record *r);

/* Writes the summary record and ends the progress line (a final plain line either way).
 * Idempotent; later steps are ZPS_ERR_INVALID. */
zps_status tr_metrics_finish(tr_metrics *m);

/* How a run ended, for the summary record. */
typedef enum tr_metrics_end {
    TR_END_DONE = 0, // its steps, its target or its time limit (the default)
    TR_END_SIGNAL,   // stopped by SIGTERM / SIGINT
    TR_END_ERROR,    // stopped by a failure
} tr_metrics_end;

/* Sets what the summary says about the end and the corrupt training records skipped; call
 * before tr_metrics_finish (later calls change nothing written). */
void tr_metrics_set_end(tr_metrics *m, tr_metrics_end end, int64_t skipped);

/* Totals so far (for the trainer's own end-of-run log). */
typedef struct tr_metrics_totals {
    int64_t steps;          // distinct steps (a redone step counts once)
    int64_t redone_steps;   // step records repeated after a sync rollback
    int64_t images;
    double time_s;          // since tr_metrics_new to the last step
    double img_per_s;       // images / time_s
    double last_loss;       // NaN before the first step
    double last_accuracy;   // < 0 before the first evaluation (the mAP with score_map)
    double best_accuracy;   // < 0 before the first evaluation (the mAP with score_map)
    double time_to_target;  // < 0 while not reached
    uint64_t bytes_pushed;
    uint64_t bytes_pulled;
    double net_wait_s;
    double staleness_mean;  // < 0 when never reported
    double staleness_max;   // < 0 when never reported
    int evals;
    double eval_s;          // seconds spent evaluating, all evaluations
} tr_metrics_totals;
void tr_metrics_get_totals(const tr_metrics *m, tr_metrics_totals *out);

/* Test hook: the clock reads `now_s` (seconds since new) instead of the monotonic clock
 * from here on; a negative value returns to the real clock. */
void tr_metrics_set_fake_time(tr_metrics *m, double now_s);

/* Finishes when not yet finished, closes the file; *pm becomes NULL. Safe on NULL. */
void tr_metrics_destroy(tr_metrics **pm);

#endif
