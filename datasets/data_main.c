/* data_main.c — zps-data: build and check LMDB shard datasets (docs/datasets.md).
 *
 *   zps-data convert fashion-mnist --out DIR [--shards N] [--src DIR] [--encoding E] ...
 *   zps-data convert folder SRC --out DIR [--name NAME] [--resize HxW] ...
 *   zps-data make-detection --out DIR [--canvas 128] [--train N] [--test N] ...
 *   zps-data inspect PATH [--split S] [--dump N --dump-out FILE.png]
 *   zps-data verify PATH [--split S]
 *   zps-data read PATH [--split S] [--trainer I/N] [--skip-corrupt] ...
 *
 * Exit status: 0 success, 1 failure (including corrupt records found by inspect or verify),
 * 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "datasets/convert.h"
#include "datasets/pipeline.h"
#include "datasets/shard.h"
#include "datasets/tools.h"

static void s_usage(FILE *f)
{
    fprintf(f,
            "usage: zps-data [--log-level L] COMMAND [options]\n\n"
            "  convert fashion-mnist --out DIR   Fashion-MNIST IDX files -> DIR/train, DIR/test\n"
            "  convert folder SRC --out DIR      SRC/CLASS/*.{jpg,jpeg,png} -> DIR/NAME-*, DIR/classes.txt\n"
            "  make-detection --out DIR          detection canvases of Fashion-MNIST items -> DIR/train, DIR/test\n"
            "  inspect PATH                      counts, class histogram, sizes, box statistics\n"
            "  verify PATH                       decode every record, name each corrupt one\n"
            "  read PATH                         run the input pipeline over PATH (counts, img/s)\n\n"
            "common options:\n"
            "  --shards N        shards per split (default 4)\n"
            "  --encoding E      raw|png|jpeg (default: raw for fashion-mnist, png for detection,\n"
            "                    the files' own bytes for folder)\n"
            "  --quality Q       JPEG quality (default 95)\n"
            "  --limit N         at most N records per split\n"
            "  --seed S          shuffle (folder) / composition (detection) seed (default 1)\n"
            "  --force           replace existing shards\n"
            "  --src DIR         Fashion-MNIST directory (default $ZPS_FASHION_MNIST_DIR, else\n"
            "                    " DS_FMNIST_DIR ")\n"
            "folder:     --name NAME (default train), --resize HxW\n"
            "detection:  --canvas PX (128), --train N (10000), --test N (2000), --min-items N (1),\n"
            "            --max-items N (6), --min-scale F (0.2), --max-scale F (0.5), --max-iou F (0.3)\n"
            "inspect/verify: --split S (use PATH/S), --dump N --dump-out FILE.png (inspect)\n"
            "read PATH: runs the training input pipeline and reports counts and img/s:\n"
            "            --split S, --trainer I/N (0/1), --batch B (32), --size HxWxC (28x28x1),\n"
            "            --threads T (1), --epochs E (0: one in-order evaluation pass), --augment,\n"
            "            --skip-corrupt (skip and count corrupt records instead of failing)\n");
}

enum {
    O_OUT = 1000, O_SHARDS, O_ENC, O_QUALITY, O_LIMIT, O_SEED, O_FORCE, O_SRC, O_NAME, O_RESIZE,
    O_CANVAS, O_TRAIN, O_TEST, O_MIN_ITEMS, O_MAX_ITEMS, O_MIN_SCALE, O_MAX_SCALE, O_MAX_IOU,
    O_SPLIT, O_DUMP, O_DUMP_OUT, O_HELP, O_LOG, O_TRAINER, O_BATCH, O_SIZE, O_THREADS, O_SKIP,
    O_EPOCHS, O_AUGMENT
};

static const struct option s_opts[] = {
    {"out", required_argument, 0, O_OUT},          {"shards", required_argument, 0, O_SHARDS},
    {"encoding", required_argument, 0, O_ENC},     {"quality", required_argument, 0, O_QUALITY},
    {"limit", required_argument, 0, O_LIMIT},      {"seed", required_argument, 0, O_SEED},
    {"force", no_argument, 0, O_FORCE},            {"src", required_argument, 0, O_SRC},
    {"name", required_argument, 0, O_NAME},        {"resize", required_argument, 0, O_RESIZE},
    {"canvas", required_argument, 0, O_CANVAS},    {"train", required_argument, 0, O_TRAIN},
    {"test", required_argument, 0, O_TEST},        {"min-items", required_argument, 0, O_MIN_ITEMS},
    {"max-items", required_argument, 0, O_MAX_ITEMS}, {"min-scale", required_argument, 0, O_MIN_SCALE},
    {"max-scale", required_argument, 0, O_MAX_SCALE}, {"max-iou", required_argument, 0, O_MAX_IOU},
    {"split", required_argument, 0, O_SPLIT},      {"dump", required_argument, 0, O_DUMP},
    {"dump-out", required_argument, 0, O_DUMP_OUT}, {"help", no_argument, 0, O_HELP},
    {"log-level", required_argument, 0, O_LOG},    {"trainer", required_argument, 0, O_TRAINER},
    {"batch", required_argument, 0, O_BATCH},      {"size", required_argument, 0, O_SIZE},
    {"threads", required_argument, 0, O_THREADS},  {"skip-corrupt", no_argument, 0, O_SKIP},
    {"epochs", required_argument, 0, O_EPOCHS},    {"augment", no_argument, 0, O_AUGMENT},
    {0, 0, 0, 0}};

typedef struct args {
    const char *out, *src, *name, *split, *dump_out;
    int shards, quality, resize_h, resize_w;
    bool enc_set, force;
    ds_encoding enc;
    uint64_t limit, seed;
    ds_detection_opts det;
    int64_t dump;
    int trainer_i, trainer_n, batch, out_h, out_w, out_c, threads, epochs;
    bool skip_corrupt, augment;
    int npos;
    const char *pos[4];
} args;

static bool s_num(const char *s, double lo, double hi, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

/* Returns 0 on success, 2 on a usage error (reported). */
static int s_parse(int argc, char **argv, args *a)
{
    const char *fm = getenv("ZPS_FASHION_MNIST_DIR");
    *a = (args){.src = fm && *fm ? fm : DS_FMNIST_DIR, .name = "train", .shards = 4, .quality = 95, .seed = 1,
                .dump = -1, .trainer_n = 1, .batch = 32, .out_h = 28, .out_w = 28, .out_c = 1,
                .threads = 1,
                .det = {.canvas = 128, .min_items = 1, .max_items = 6, .n_train = 10000,
                        .n_test = 2000, .min_scale = 0.2f, .max_scale = 0.5f, .max_iou = 0.3f}};
    optind = 1;
    int c;
    double v;
    while ((c = getopt_long(argc, argv, "", s_opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case O_OUT: a->out = optarg; break;
        case O_SRC: a->src = optarg; break;
        case O_NAME: a->name = optarg; break;
        case O_SPLIT: a->split = optarg; break;
        case O_DUMP_OUT: a->dump_out = optarg; break;
        case O_FORCE: a->force = true; break;
        case O_SHARDS: ok = s_num(optarg, 1, 99999, &v); a->shards = (int)v; break;
        case O_QUALITY: ok = s_num(optarg, 1, 100, &v); a->quality = (int)v; break;
        case O_LIMIT: ok = s_num(optarg, 0, 1e15, &v); a->limit = (uint64_t)v; break;
        case O_SEED: ok = s_num(optarg, 0, 1.8e19, &v); a->seed = strtoull(optarg, NULL, 10); break;
        case O_DUMP: ok = s_num(optarg, 0, 1e15, &v); a->dump = (int64_t)v; break;
        case O_CANVAS: ok = s_num(optarg, 16, 16384, &v); a->det.canvas = (int)v; break;
        case O_TRAIN: ok = s_num(optarg, 0, 1e12, &v); a->det.n_train = (uint64_t)v; break;
        case O_TEST: ok = s_num(optarg, 0, 1e12, &v); a->det.n_test = (uint64_t)v; break;
        case O_MIN_ITEMS: ok = s_num(optarg, 1, 256, &v); a->det.min_items = (int)v; break;
        case O_MAX_ITEMS: ok = s_num(optarg, 1, 256, &v); a->det.max_items = (int)v; break;
        case O_MIN_SCALE: ok = s_num(optarg, 0.01, 1, &v); a->det.min_scale = (float)v; break;
        case O_MAX_SCALE: ok = s_num(optarg, 0.01, 1, &v); a->det.max_scale = (float)v; break;
        case O_MAX_IOU: ok = s_num(optarg, 0, 1, &v); a->det.max_iou = (float)v; break;
        case O_ENC:
            ok = ds_encoding_parse(optarg, &a->enc) == ZPS_OK;
            a->enc_set = true;
            break;
        case O_RESIZE:
            ok = sscanf(optarg, "%dx%d", &a->resize_h, &a->resize_w) == 2 && a->resize_h > 0 &&
                 a->resize_w > 0 && a->resize_h <= 16384 && a->resize_w <= 16384;
            break;
        case O_LOG: ok = zps_log_set_level_str(optarg) == ZPS_OK; break;
        case O_TRAINER:
            ok = sscanf(optarg, "%d/%d", &a->trainer_i, &a->trainer_n) == 2 && a->trainer_n >= 1 &&
                 a->trainer_i >= 0 && a->trainer_i < a->trainer_n;
            break;
        case O_BATCH: ok = s_num(optarg, 1, 65536, &v); a->batch = (int)v; break;
        case O_SIZE:
            ok = sscanf(optarg, "%dx%dx%d", &a->out_h, &a->out_w, &a->out_c) == 3 && a->out_h > 0 &&
                 a->out_w > 0 && a->out_h <= 4096 && a->out_w <= 4096 && (a->out_c == 1 || a->out_c == 3);
            break;
        case O_THREADS: ok = s_num(optarg, 0, 64, &v); a->threads = (int)v; break;
        case O_SKIP: a->skip_corrupt = true; break;
        case O_EPOCHS: ok = s_num(optarg, 0, 1e6, &v); a->epochs = (int)v; break;
        case O_AUGMENT: a->augment = true; break;
        case O_HELP: s_usage(stdout); exit(0);
        default: s_usage(stderr); return 2;
        }
        if (!ok) {
            fprintf(stderr, "zps-data: bad value for --%s: %s\n", s_opts[c - O_OUT].name, optarg);
            return 2;
        }
    }
    for (; optind < argc; optind++) {
        if (a->npos == 4) {
            fprintf(stderr, "zps-data: too many arguments\n");
            return 2;
        }
        a->pos[a->npos++] = argv[optind];
    }
    return 0;
}

static ds_convert_opts s_convert_opts(const args *a, ds_encoding dflt)
{
    return (ds_convert_opts){.out = a->out, .shards = a->shards, .overwrite = a->force,
                             .encoding = a->enc_set ? a->enc : dflt, .quality = a->quality,
                             .limit = a->limit, .seed = a->seed};
}

static int s_print_stats(const char *path, const args *a)
{
    ds_stats s;
    zps_status st = ds_inspect(path, a->split, &s);
    if (st != ZPS_OK && st != ZPS_ERR_CORRUPT) {
        fprintf(stderr, "zps-data: inspect %s: %s\n", path, zps_strerror(st));
        return 1;
    }
    printf("records      %" PRIu64 " in %d shards (%" PRIu64 " corrupt), %.1f MB\n", s.records,
           s.n_shards, s.corrupt, (double)s.bytes / 1e6);
    printf("image size   h %u..%u, w %u..%u; gray %" PRIu64 ", rgb %" PRIu64 "\n", s.min_h, s.max_h,
           s.min_w, s.max_w, s.by_channels[1], s.by_channels[3]);
    printf("encoding     raw %" PRIu64 ", jpeg %" PRIu64 ", png %" PRIu64 "\n", s.by_encoding[0],
           s.by_encoding[1], s.by_encoding[2]);
    printf("classes      %d in classes.txt; records without a label: %" PRIu64 "\n", s.num_classes,
           s.no_label);
    for (int c = 0; c < s.hist_len; c++)
        if (s.class_hist[c] || s.box_hist[c] || c < s.num_classes)
            printf("  %3d %-16s images %8" PRIu64 "  boxes %8" PRIu64 "\n", c,
                   c < s.num_classes ? s.classes[c] : "", s.class_hist[c],
                   s.box_hist[c]);
    if (s.boxes)
        printf("boxes        %" PRIu64 " (%d..%d per record, mean %.2f), mean size %.3f x %.3f\n",
               s.boxes, s.min_boxes, s.max_boxes, (double)s.boxes / (double)s.records,
               s.box_w_sum / (double)s.boxes, s.box_h_sum / (double)s.boxes);
    uint64_t corrupt = s.corrupt;
    ds_stats_free(&s);
    if (a->dump >= 0) {
        const char *out = a->dump_out ? a->dump_out : "record.png";
        if (ds_dump_png(path, a->split, (uint64_t)a->dump, out) != ZPS_OK) {
            fprintf(stderr, "zps-data: cannot dump record %" PRId64 "\n", a->dump);
            return 1;
        }
        printf("record %" PRId64 " written to %s\n", a->dump, out);
    }
    return st == ZPS_OK && corrupt == 0 ? 0 : 1;
}

/* verify, one child process per shard (see ds_verify_shard): a shard whose LMDB structure
 * crashes the reader is reported by name and the others are still checked. */
static int s_verify_all(const char *path, const char *split)
{
    ds_dataset *d;
    zps_status st = ds_dataset_open_flags(path, split, DS_OPEN_ALLOW_DAMAGED, &d);
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-data verify %s: %s\n", path, zps_strerror(st));
        return 1;
    }
    uint64_t n = 0, bad = 0;
    int failed = 0;
    fflush(stdout);
    fflush(stderr);
    for (int s = 0; s < d->n_shards; s++) {
        int fd[2];
        if (pipe(fd) != 0) {
            perror("pipe");
            ds_dataset_close(&d);
            return 1;
        }
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            ds_dataset_close(&d);
            return 1;
        }
        if (pid == 0) {
            close(fd[0]);
            uint64_t cn[2] = {0, 0};
            zps_status cs = ds_verify_shard(path, split, s, &cn[0], &cn[1]);
            int ok = write(fd[1], cn, sizeof cn) == (ssize_t)sizeof cn;
            _exit(ok && (cs == ZPS_OK || cs == ZPS_ERR_CORRUPT) ? 0 : 3);
        }
        close(fd[1]);
        uint64_t cn[2] = {0, 0};
        ssize_t got = read(fd[0], cn, sizeof cn);
        close(fd[0]);
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (WIFSIGNALED(status)) {
            zps_log(ZPS_ERROR, "ds", "corrupt shard: shard %s: reading its LMDB B-tree crashed "
                    "(signal %d): the file's page structure is damaged", ds_shard_name(d->shards[s]),
                    WTERMSIG(status));
            failed++;
        } else if (got != (ssize_t)sizeof cn || WEXITSTATUS(status) != 0) {
            zps_log(ZPS_ERROR, "ds", "shard %s could not be verified", ds_shard_name(d->shards[s]));
            failed++;
        } else {
            n += cn[0];
            bad += cn[1];
        }
    }
    printf("verify %s: %" PRIu64 " records, %" PRIu64 " corrupt", path, n, bad);
    if (failed)
        printf(", %d of %d shards unreadable", failed, d->n_shards);
    printf("\n");
    ds_dataset_close(&d);
    return bad || failed ? 1 : 0;
}

/* `read`: the pipeline as a trainer would run it; once (evaluation) unless --epochs. */
static int s_read(const char *path, const args *a)
{
    ds_pipeline_opts o;
    ds_pipeline_opts_default(&o);
    o.path = path;
    o.split = a->split;
    o.trainer_index = a->trainer_i;
    o.n_trainers = a->trainer_n;
    o.batch = a->batch;
    o.height = a->out_h;
    o.width = a->out_w;
    o.channels = a->out_c;
    o.threads = a->threads;
    o.seed = a->seed;
    o.skip_corrupt = a->skip_corrupt;
    o.augment = a->augment;
    o.once = a->epochs == 0;
    ds_pipeline *p;
    zps_status st = ds_pipeline_new(&o, &p);
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-data read %s: %s\n", path, zps_strerror(st));
        return 1;
    }
    size_t per = (size_t)o.batch * o.channels * o.height * o.width;
    float *img = malloc(per * sizeof(float));
    int32_t *lab = malloc((size_t)o.batch * sizeof *lab);
    if (!img || !lab) {
        fprintf(stderr, "zps-data read: out of memory\n");
        return 1;
    }
    int64_t total_batches = o.once ? INT64_MAX : (int64_t)a->epochs * ds_pipeline_batches_per_epoch(p);
    uint64_t images = 0, batches = 0;
    ds_batch_info info;
    double t0 = zps_now_s();
    for (int64_t b = 0; b < total_batches; b++) {
        st = ds_pipeline_next(p, img, lab, &info);
        if (st != ZPS_OK)
            break;
        images += (uint64_t)info.count;
        batches++;
    }
    double dt = zps_now_s() - t0;
    if (st == ZPS_ERR_EOF)
        st = ZPS_OK;
    printf("read %s: trainer %d/%d, %" PRIu64 " records in its share, %" PRIu64 " images in %" PRIu64
           " batches, %" PRId64 " corrupt skipped, %.1f img/s\n", path, o.trainer_index, o.n_trainers,
           ds_pipeline_records(p), images, batches, ds_pipeline_skipped(p), images / (dt > 0 ? dt : 1));
    ds_pipeline_destroy(&p);
    free(img);
    free(lab);
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-data read: %s\n", zps_strerror(st));
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    zps_log_init("data", -1);
    int first = 1;
    while (first < argc && strncmp(argv[first], "--", 2) == 0) {
        if (strcmp(argv[first], "--log-level") == 0 && first + 1 < argc) {
            if (zps_log_set_level_str(argv[first + 1]) != ZPS_OK) {
                fprintf(stderr, "zps-data: bad --log-level %s\n", argv[first + 1]);
                return 2;
            }
            first += 2;
        } else if (strcmp(argv[first], "--help") == 0) {
            s_usage(stdout);
            return 0;
        } else {
            s_usage(stderr);
            return 2;
        }
    }
    if (first >= argc) {
        s_usage(stderr);
        return 2;
    }
    const char *cmd = argv[first];
    args a;
    int rc = s_parse(argc - first, argv + first, &a);
    if (rc)
        return rc;
    double t0 = zps_now_s();
    zps_status st;
    if (strcmp(cmd, "convert") == 0) {
        if (a.npos < 1 || !a.out) {
            fprintf(stderr, "zps-data convert: need a source (fashion-mnist | folder SRC) and --out DIR\n");
            return 2;
        }
        if (strcmp(a.pos[0], "fashion-mnist") == 0) {
            ds_convert_opts o = s_convert_opts(&a, DS_ENC_RAW);
            uint64_t ntr = 0, nte = 0;
            st = ds_convert_fmnist(a.src, &o, &ntr, &nte);
            if (st == ZPS_OK)
                printf("fashion-mnist: %" PRIu64 " train + %" PRIu64 " test records in %s/{train,test} "
                       "(%d shards each, %.2f s)\n", ntr, nte, a.out, a.shards, zps_now_s() - t0);
        } else if (strcmp(a.pos[0], "folder") == 0 && a.npos == 2) {
            /* folder: without --resize the files' own bytes are kept unless --encoding raw;
             * with --resize images are re-encoded (default JPEG) */
            ds_convert_opts o = s_convert_opts(&a, DS_ENC_JPEG);
            uint64_t n = 0, skipped = 0;
            st = ds_convert_folder(a.pos[1], a.name, &o, a.resize_h, a.resize_w, &n, &skipped);
            if (st == ZPS_OK)
                printf("folder %s: %" PRIu64 " records (%" PRIu64 " files skipped) in %s (%.2f s)\n",
                       a.pos[1], n, skipped, a.out, zps_now_s() - t0);
        } else {
            fprintf(stderr, "zps-data convert: unknown source '%s' (fashion-mnist | folder SRC)\n",
                    a.pos[0]);
            return 2;
        }
    } else if (strcmp(cmd, "make-detection") == 0) {
        if (!a.out) {
            fprintf(stderr, "zps-data make-detection: --out DIR is required\n");
            return 2;
        }
        ds_convert_opts o = s_convert_opts(&a, DS_ENC_PNG);
        st = ds_make_detection(a.src, &o, &a.det);
        if (st == ZPS_OK)
            printf("detection: %" PRIu64 " train + %" PRIu64 " test canvases of %dx%d in %s (%.2f s)\n",
                   a.det.n_train, a.det.n_test, a.det.canvas, a.det.canvas, a.out, zps_now_s() - t0);
    } else if (strcmp(cmd, "inspect") == 0) {
        if (a.npos != 1) {
            fprintf(stderr, "zps-data inspect: need one dataset PATH\n");
            return 2;
        }
        return s_print_stats(a.pos[0], &a);
    } else if (strcmp(cmd, "read") == 0) {
        if (a.npos != 1) {
            fprintf(stderr, "zps-data read: need one dataset PATH\n");
            return 2;
        }
        return s_read(a.pos[0], &a);
    } else if (strcmp(cmd, "verify") == 0) {
        if (a.npos != 1) {
            fprintf(stderr, "zps-data verify: need one dataset PATH\n");
            return 2;
        }
        return s_verify_all(a.pos[0], a.split);
    } else {
        fprintf(stderr, "zps-data: unknown command '%s'\n", cmd);
        s_usage(stderr);
        return 2;
    }
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-data %s: %s\n", cmd, zps_strerror(st));
        return 1;
    }
    return 0;
}
