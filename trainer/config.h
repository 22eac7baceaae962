/* config.h — zps-trainer's settings and their command-line parser.
 *
 * Every flag of zps-trainer lands in one tr_config; tr_config_parse() validates them all and
 * says which flag is wrong, so a fleet with a typo stops at launch. The flags are one table in
 * config.c (common/opts.h), which also makes --help; docs/training.md lists the main ones.
 */
#ifndef ZPS_TRAINER_CONFIG_H
#define ZPS_TRAINER_CONFIG_H

#include <stdint.h>

#include "common/json.h"
#include "common/status.h"
#include "ps/dtype.h"
#include "ps/optim.h"

typedef enum tr_mode {
    TR_MODE_LOCAL = 0, // one process, optimizer applied locally
    TR_MODE_SYNC,      // PS, synchronous (SyncReplicas)
    TR_MODE_ASYNC,     // PS, each push applied on arrival
    TR_MODE_SSP,       // PS, bounded staleness
    TR_MODE_ALLREDUCE, // in-node all-reduce over shared memory, optimizer applied locally
} tr_mode;

/* How the trainers of a job divide the data. */
typedef enum tr_shard_mode {
    TR_SHARD_RECORDS = 0, // trainer i reads its own share of the records (datasets.md)
    TR_SHARD_BATCH,       // every trainer reads the global batch stream of batch * n records
                          // and trains on slice i: bit-for-bit the batches of one trainer
                          // with batch * n (for equivalence checks; costs n times the I/O)
} tr_shard_mode;

typedef struct tr_config {
    /* model */
    char model[32];           // mlp | convnet | inception_v3 | ssd
    float width;              // inception_v3 width multiplier
    int input_size;           // model input height = width (0: the model's default)
    int in_channels;          // 0: 1 (gray), for every model, inception_v3 included
    int classes;              // 0: from the dataset's classes.txt, else 10
    int aux;                  // inception aux head: -1 auto, 0 off, 1 on
    float dropout;            // < 0: the model's default
    char init_weights[512];   // weights file to start from ("" = seeded init)
    /* data */
    char data[512];           // dataset directory with train/ and test/
    int threads;              // decode threads
    int augment;              // random crop + flip
    tr_shard_mode shard;
    int64_t skip_corrupt;     // skip up to this many corrupt training records (0: none)
    /* where and how */
    char device[16];          // auto | cpu | cuda | staged
    int gpu;                  // --gpu: the visible CUDA device (0..)
    tr_mode mode;
    char cluster[512];        // cluster file ("" = --servers)
    char servers[2048];       // comma-separated tcp:// URIs
    int trainer_id;
    int num_trainers;         // 0: from the cluster file, else 1
    int node_trainers;        // --node-trainers G: PS through one trainer per G (sync_node.c;
                              // 1: every trainer talks to the servers)
    uint32_t replicas_to_aggregate; // sync; 0: num_trainers
    uint32_t staleness;       // ssp
    uint64_t chunk_bytes;     // PS chunk size (default PS_DEFAULT_CHUNK_BYTES)
    char job[64];             // job name (all-reduce shared-memory segment, metrics)
    int timeout_ms;           // PS request timeout before a resend
    double register_wait_s;   // REGISTER refused because an earlier process of this trainer id
                              // still holds it: retry this long (it times out on the servers)
    char curve_server_key[512]; // PS: the servers' CURVE public key file ("" = plaintext)
    char curve_key[512];      // PS: this trainer's CURVE key pair file (with the above)
    ps_dtype push_dtype;      // PS: gradients on the wire as f32 (default) or bf16
    int shm;                  // PS: take a same-host server's shared memory (default 1)
    /* schedule of work */
    int batch;                // images per step per trainer
    int64_t steps;            // steps to run (0: use epochs)
    double epochs;            // epochs of this trainer's share (when steps == 0)
    int accumulate;           // micro-batches per step (gradient accumulation)
    int recompute;            // --recompute: gradient checkpointing (nn_model_set_recompute)
    int bf16;                 // --precision bf16: convolutions in bf16 (nn_model_set_bf16)
    double time_limit_s;      // stop after this many seconds (0: none)
    double stop_accuracy;     // stop once test accuracy (ssd: mAP@0.5) reaches this (0: never)
    /* optimizer (PS: sent to the servers at INIT; local/allreduce: applied here) */
    ps_optim_config opt;
    /* evaluation and output */
    int64_t eval_every;       // steps between evaluations on the test split (0: only at end)
    int eval_batches;         // batches per evaluation (0: the whole test split)
    int eval_all;             // every trainer evaluates (default: trainer 0 only)
    char metrics[512];        // JSON Lines file ("" = none)
    char export_path[512];    // weights file written at the end by trainer 0 ("" = none)
    int export_format;        // nn_weights_format of export_path (--export-format)
    char trace[512];          // --trace FILE: timeline of a window of steps ("" = none)
    int64_t trace_from;       // --trace-from STEP: the window's first step (1-based)
    int64_t trace_steps;      // --trace-steps N: its length
    int resume;               // local/allreduce: start from export_path when it exists
    int progress;             // 1 progress line on stderr, 0 off
    uint64_t seed;
    int shutdown_servers;     // trainer 0 sends SHUTDOWN at the end
    int eval_only;            // evaluate --init-weights on the test split, then exit
    int64_t dump_detections;  // detector: test record drawn with its boxes at the end (-1: none)
    char dump_out[512];       // where that PNG goes
} tr_config;

/* Defaults: convnet, batch 64, 1 epoch, sgd lr 0.05, mode local, device auto, seed 1. */
void tr_config_default(tr_config *c);
/* Parses argv into c (start from tr_config_default). *exit_code >= 0 means main should exit
 * with that code (--help printed: 0; a bad flag: 2, with the reason on stderr). */
zps_status tr_config_parse(tr_config *c, int argc, char **argv, int *exit_code);
/* Every flag's value in c as one JSON object keyed by flag name (common/opts.h
 * zps_opts_json), for the metrics start record. */
void tr_config_json(const tr_config *c, zps_json *j);
/* How many trainers of this job share this machine's cores (common/omp_env divides them
 * among those): all of them in allreduce mode (in-node by definition); in the PS modes the
 * trainers whose host is this one (common/net.h zps_net_host_here) in --cluster's file, or
 * all of --num-trainers when every --servers URI is on this host; else 1. A
 * cluster file that cannot be read counts 1 (the run reports it). */
int tr_config_local_trainers(const tr_config *c);
/* The --mode names: local and allreduce, and the PS modes of ps_mode_names (ps/server_config.h). */
const char *tr_mode_name(tr_mode m);
zps_status tr_mode_parse(const char *s, tr_mode *out);

#endif
