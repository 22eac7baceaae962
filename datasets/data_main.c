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
 * 2 usage. The flags are one table (common/opts.h), shared by every command; options and
 * arguments may come in any order after the program name.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/opts.h"
#include "datasets/convert.h"
#include "datasets/pipeline.h"
#include "datasets/shard.h"
#include "datasets/tools.h"

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
    int npos;                // arguments after the command
    char *const *pos;
} args;

static void s_defaults(void *p)
{
    const char *fm = getenv("ZPS_FASHION_MNIST_DIR");
    *(args *)p = (args){.src = fm && *fm ? fm : DS_FMNIST_DIR, .name = "train", .shards = 4,
                        .quality = 95, .seed = 1, .dump = -1, .dump_out = "record.png", .trainer_n = 1, .batch = 32,
                        .out_h = 28, .out_w = 28, .out_c = 1, .threads = 1,
                        .det = {.canvas = 128, .min_items = 1, .max_items = 6, .n_train = 10000,
                                .n_test = 2000, .min_scale = 0.2f, .max_scale = 0.5f,
                                .max_iou = 0.3f}};
}

static zps_status s_encoding(void *cfg, const char *v, char *why, size_t cap)
{
    args *a = cfg;
    if (ds_encoding_parse(v, &a->enc) == ZPS_OK) {
        a->enc_set = true;
        return ZPS_OK;
    }
    snprintf(why, cap, "wants raw, png or jpeg, got '%s'", v);
    return ZPS_ERR_INVALID;
}

static zps_status s_resize(void *cfg, const char *v, char *why, size_t cap)
{
    args *a = cfg;
    int h, w;
    if (sscanf(v, "%dx%d", &h, &w) == 2 && h > 0 && w > 0 && h <= 16384 && w <= 16384) {
        a->resize_h = h;
        a->resize_w = w;
        return ZPS_OK;
    }
    snprintf(why, cap, "wants HxW (1..16384 each), got '%s'", v);
    return ZPS_ERR_INVALID;
}

static zps_status s_trainer(void *cfg, const char *v, char *why, size_t cap)
{
    args *a = cfg;
    int i, n;
    if (sscanf(v, "%d/%d", &i, &n) == 2 && n >= 1 && i >= 0 && i < n) {
        a->trainer_i = i;
        a->trainer_n = n;
        return ZPS_OK;
    }
    snprintf(why, cap, "wants I/N with 0 <= I < N, got '%s'", v);
    return ZPS_ERR_INVALID;
}

static zps_status s_size(void *cfg, const char *v, char *why, size_t cap)
{
    args *a = cfg;
    int h, w, c;
    if (sscanf(v, "%dx%dx%d", &h, &w, &c) == 3 && h > 0 && w > 0 && h <= 4096 && w <= 4096 &&
        (c == 1 || c == 3)) {
        a->out_h = h;
        a->out_w = w;
        a->out_c = c;
        return ZPS_OK;
    }
    snprintf(why, cap, "wants HxWxC (H, W 1..4096, C 1 or 3), got '%s'", v);
    return ZPS_ERR_INVALID;
}

#define F(field) ZPS_OPT_FIELD(args, field)

static const zps_opt s_opt[] = {
    {.type = ZPS_OPT_TEXT, .help = "convert, make-detection:"},
    {"out", ZPS_OPT_ARG, F(out), .meta = "DIR", .help = "the dataset written"},
    {"shards", ZPS_OPT_INT, F(shards), 1, 99999, .meta = "N", .help = "shards per split"},
    {"encoding", ZPS_OPT_FUNC, .fn = s_encoding, .meta = "E",
     .help = "raw|png|jpeg (default: raw for fashion-mnist, png for detection,\n"
             "the files' own bytes for folder)"},
    {"quality", ZPS_OPT_INT, F(quality), 1, 100, .meta = "Q", .help = "JPEG quality"},
    {"limit", ZPS_OPT_UINT, F(limit), 0, 1e15, .meta = "N", .dflt = "",
     .help = "at most N records per split"},
    {"seed", ZPS_OPT_UINT, F(seed), 0, 18446744073709551615.0, .meta = "S",
     .help = "shuffle (folder) / composition (detection) / augmentation (read) seed"},
    {"force", ZPS_OPT_SET, F(force), .help = "replace existing shards"},
    {"src", ZPS_OPT_ARG, F(src), .meta = "DIR", .dflt = "$ZPS_FASHION_MNIST_DIR, else " DS_FMNIST_DIR,
     .help = "Fashion-MNIST directory"},
    {.type = ZPS_OPT_TEXT, .help = "convert folder:"},
    {"name", ZPS_OPT_ARG, F(name), .meta = "NAME", .help = "the shards' name prefix"},
    {"resize", ZPS_OPT_FUNC, .fn = s_resize, .meta = "HxW",
     .help = "resize (and re-encode, default JPEG) every image"},
    {.type = ZPS_OPT_TEXT, .help = "make-detection:"},
    {"canvas", ZPS_OPT_INT, F(det.canvas), 16, 16384, .meta = "PX", .help = "canvas side"},
    {"train", ZPS_OPT_UINT, F(det.n_train), 0, 1e12, .meta = "N", .help = "training canvases"},
    {"test", ZPS_OPT_UINT, F(det.n_test), 0, 1e12, .meta = "N", .help = "test canvases"},
    {"min-items", ZPS_OPT_INT, F(det.min_items), 1, 256, .meta = "N", .help = "items per canvas"},
    {"max-items", ZPS_OPT_INT, F(det.max_items), 1, 256, .meta = "N", .help = "items per canvas"},
    {"min-scale", ZPS_OPT_DOUBLE, F(det.min_scale), 0.01, 1, .meta = "F",
     .help = "item side / canvas side"},
    {"max-scale", ZPS_OPT_DOUBLE, F(det.max_scale), 0.01, 1, .meta = "F",
     .help = "item side / canvas side"},
    {"max-iou", ZPS_OPT_DOUBLE, F(det.max_iou), 0, 1, .meta = "F",
     .help = "overlap of two items"},
    {.type = ZPS_OPT_TEXT, .help = "inspect, verify, read:"},
    {"split", ZPS_OPT_ARG, F(split), .meta = "S", .help = "use PATH/S"},
    {"dump", ZPS_OPT_INT, F(dump), 0, 1e15, .meta = "N", .dflt = "",
     .help = "inspect: write record N as a PNG"},
    {"dump-out", ZPS_OPT_ARG, F(dump_out), .meta = "FILE.png",
     .help = "inspect: where --dump writes"},
    {.type = ZPS_OPT_TEXT, .help = "read (the training input pipeline: counts and img/s):"},
    {"trainer", ZPS_OPT_FUNC, .fn = s_trainer, .meta = "I/N", .dflt = "0/1",
     .help = "read trainer I's share of N"},
    {"batch", ZPS_OPT_INT, F(batch), 1, 65536, .meta = "B", .help = "images per batch"},
    {"size", ZPS_OPT_FUNC, .fn = s_size, .meta = "HxWxC", .dflt = "28x28x1",
     .help = "images are resized to this"},
    {"threads", ZPS_OPT_INT, F(threads), 0, 64, .meta = "T", .help = "decode threads"},
    {"epochs", ZPS_OPT_INT, F(epochs), 0, 1e6, .meta = "E", .dflt = "0, one in-order evaluation pass",
     .help = "shuffled epochs"},
    {"augment", ZPS_OPT_SET, F(augment), .help = "random crop + horizontal flip"},
    {"skip-corrupt", ZPS_OPT_SET, F(skip_corrupt),
     .help = "skip and count corrupt records instead of failing"},
    {.type = ZPS_OPT_TEXT, .help = "any command:"},
    ZPS_OPT_LOG_LEVEL,
    {.type = ZPS_OPT_END},
};

#undef F

static const zps_opts s_spec = {
    .prog = "zps-data",
    .usage = "usage: zps-data COMMAND [options]\n\n"
             "  convert fashion-mnist --out DIR   Fashion-MNIST IDX files -> DIR/train, DIR/test\n"
             "  convert folder SRC --out DIR      SRC/CLASS/*.{jpg,jpeg,png} -> DIR/NAME-*, DIR/classes.txt\n"
             "  make-detection --out DIR          detection canvases of Fashion-MNIST items -> DIR/train, DIR/test\n"
             "  inspect PATH                      counts, class histogram, sizes, box statistics\n"
             "  verify PATH                       decode every record, name each corrupt one\n"
             "  read PATH                         run the input pipeline over PATH (counts, img/s)\n\n",
    .opt = s_opt,
    .cfg_size = sizeof(args),
    .defaults = s_defaults,
    .max_args = 5, /* the command and its arguments */
};

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
        zps_log_failure("zps-data", st, "inspect %s", path);
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
        const char *out = a->dump_out;
        if ((st = ds_dump_png(path, a->split, (uint64_t)a->dump, out)) != ZPS_OK) {
            zps_log_failure("zps-data", st, "inspect %s: cannot dump record %" PRId64, path,
                            a->dump);
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
        zps_log_failure("zps-data", st, "verify %s", path);
        return 1;
    }
    uint64_t n = 0, bad = 0;
    int failed = 0;
    fflush(stdout);
    fflush(stderr);
    for (int s = 0; s < d->n_shards; s++) {
        int fd[2];
        if (pipe(fd) != 0) {
            fprintf(stderr, "zps-data: verify: pipe: %s\n", strerror(errno));
            ds_dataset_close(&d);
            return 1;
        }
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "zps-data: verify: fork: %s\n", strerror(errno));
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
        zps_log_failure("zps-data", st, "read %s", path);
        return 1;
    }
    size_t per = (size_t)o.batch * o.channels * o.height * o.width;
    float *img = malloc(per * sizeof(float));
    int32_t *lab = malloc((size_t)o.batch * sizeof *lab);
    if (!img || !lab) {
        fprintf(stderr, "zps-data: read: out of memory\n");
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
        zps_log_failure("zps-data", st, "read %s", path);
        return 1;
    }
    return 0;
}

/* The end of convert and make-detection: their status as the exit code. */
static int s_exit(const char *cmd, zps_status st)
{
    if (st == ZPS_OK)
        return 0;
    zps_log_failure("zps-data", st, "%s", cmd);
    return 1;
}

/* A command's usage error: one line (zps_opts_fail); returns its exit code, 2. */
__attribute__((format(printf, 1, 2))) static int s_usage_error(const char *fmt, ...)
{
    int code;
    va_list ap;
    va_start(ap, fmt);
    zps_opts_vfail(&s_spec, &code, fmt, ap);
    va_end(ap);
    return code;
}

static int s_cmd_convert(const args *a)
{
    if (a->npos < 1 || !a->out)
        return s_usage_error("convert needs a source (fashion-mnist | folder SRC) and --out DIR");
    double t0 = zps_now_s();
    zps_status st;
    if (strcmp(a->pos[0], "fashion-mnist") == 0) {
        ds_convert_opts o = s_convert_opts(a, DS_ENC_RAW);
        uint64_t ntr = 0, nte = 0;
        st = ds_convert_fmnist(a->src, &o, &ntr, &nte);
        if (st == ZPS_OK)
            printf("fashion-mnist: %" PRIu64 " train + %" PRIu64 " test records in %s/{train,test} "
                   "(%d shards each, %.2f s)\n", ntr, nte, a->out, a->shards, zps_now_s() - t0);
    } else if (strcmp(a->pos[0], "folder") == 0 && a->npos == 2) {
        /* folder: without --resize the files' own bytes are kept unless --encoding raw;
         * with --resize images are re-encoded (default JPEG) */
        ds_convert_opts o = s_convert_opts(a, DS_ENC_JPEG);
        uint64_t n = 0, skipped = 0;
        st = ds_convert_folder(a->pos[1], a->name, &o, a->resize_h, a->resize_w, &n, &skipped);
        if (st == ZPS_OK)
            printf("folder %s: %" PRIu64 " records (%" PRIu64 " files skipped) in %s (%.2f s)\n",
                   a->pos[1], n, skipped, a->out, zps_now_s() - t0);
    } else {
        return s_usage_error("convert: unknown source '%s' (fashion-mnist | folder SRC)",
                             a->pos[0]);
    }
    return s_exit("convert", st);
}

static int s_cmd_detection(const args *a)
{
    if (!a->out)
        return s_usage_error("%s needs --out DIR", "make-detection");
    double t0 = zps_now_s();
    ds_convert_opts o = s_convert_opts(a, DS_ENC_PNG);
    zps_status st = ds_make_detection(a->src, &o, &a->det);
    if (st == ZPS_OK)
        printf("detection: %" PRIu64 " train + %" PRIu64 " test canvases of %dx%d in %s (%.2f s)\n",
               a->det.n_train, a->det.n_test, a->det.canvas, a->det.canvas, a->out,
               zps_now_s() - t0);
    return s_exit("make-detection", st);
}

static int s_cmd_inspect(const args *a) { return s_print_stats(a->pos[0], a); }
static int s_cmd_verify(const args *a) { return s_verify_all(a->pos[0], a->split); }
static int s_cmd_read(const args *a) { return s_read(a->pos[0], a); }

static const struct {
    const char *name;
    int one_path; // takes exactly one dataset PATH
    int (*run)(const args *a);
} s_commands[] = {
    {"convert", 0, s_cmd_convert}, {"make-detection", 0, s_cmd_detection},
    {"inspect", 1, s_cmd_inspect}, {"read", 1, s_cmd_read}, {"verify", 1, s_cmd_verify},
};

int main(int argc, char **argv)
{
    zps_log_init("data", -1);
    args a;
    s_defaults(&a);
    int first, code;
    if (zps_opts_parse(&s_spec, &a, argc, argv, &first, &code) != ZPS_OK || code >= 0)
        return code;
    if (first >= argc) {
        zps_opts_usage(&s_spec, stderr);
        return 2;
    }
    const char *cmd = argv[first];
    a.pos = argv + first + 1;
    a.npos = argc - first - 1;
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++) {
        if (strcmp(cmd, s_commands[i].name) != 0)
            continue;
        if (s_commands[i].one_path && a.npos != 1)
            return s_usage_error("%s needs one dataset PATH", cmd);
        return s_commands[i].run(&a);
    }
    return s_usage_error("unknown command '%s'; commands: convert, make-detection, inspect, verify, read",
                         cmd);
}
