/* test_trainer_config.c — zps-trainer's flag parser: good command lines give the settings,
 * bad ones are refused with exit code 2 and a message naming the flag. Suite it_cli runs the
 * binary: a bad model is named before any data is opened, a CPU-only start says nothing about
 * CUDA at the default level, and each failure is told once. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/device.h"
#include "testutil.h"
#include "trainer/config.h"

/* Parses args (NULL-terminated, without argv[0]); returns the exit code (-1: go on). */
static int s_parse(tr_config *c, const char *const *args, zps_status *st)
{
    char *argv[64];
    int argc = zt_argv("zps-trainer", args, argv, 64);
    tr_config_default(c);
    int code;
    *st = tr_config_parse(c, argc, argv, &code);
    return code;
}

Test(tr_config, a_full_ps_command_line)
{
    tr_config c;
    zps_status st;
    const char *a[] = {"--data", "/d", "--mode", "ssp", "--servers", "tcp://127.0.0.1:1,tcp://127.0.0.1:2",
                       "--trainer-id", "1", "--num-trainers", "3", "--staleness", "2",
                       "--optimizer", "momentum", "--lr", "0.01", "--batch-size", "16",
                       "--accumulate", "4", "--lr-schedule", "cosine", "--total-steps", "100",
                       "--model", "inception_v3", "--width", "0.25", "--input-size", "75", NULL};
    cr_assert_eq(s_parse(&c, a, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_eq(c.mode, TR_MODE_SSP);
    cr_assert_eq(c.trainer_id, 1);
    cr_assert_eq(c.num_trainers, 3);
    cr_assert_eq(c.staleness, 2);
    cr_assert_eq(c.opt.kind, PS_OPT_MOMENTUM);
    cr_assert_float_eq(c.opt.momentum, 0.9, 1e-12, "momentum defaults to 0.9");
    cr_assert_float_eq(c.opt.lr, 0.01, 1e-12);
    cr_assert_eq(c.opt.sched, PS_SCHED_COSINE);
    cr_assert_eq(c.accumulate, 4);
    cr_assert_str_eq(c.model, "inception_v3");
    cr_assert_eq(c.input_size, 75);
}

/* The trainers that share this machine's cores (OpenMP's threads are divided among them):
 * counted in a cluster file by host, whatever the launcher wrote (zps-launch's local fleets
 * pass --cluster, not --servers: counting 1 there gave every trainer all the cores). */
static int s_local(const char *mode, const char *cluster_text, const char *servers, int n)
{
    char dir[128], path[160];
    zt_mktmp(dir, sizeof dir, "zps-local");
    snprintf(path, sizeof path, "%s/cluster.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(cluster_text ? cluster_text : "", f);
    fclose(f);
    tr_config c;
    tr_config_default(&c);
    cr_assert_eq(tr_mode_parse(mode, &c.mode), ZPS_OK);
    if (cluster_text)
        snprintf(c.cluster, sizeof c.cluster, "%s", path);
    if (servers)
        snprintf(c.servers, sizeof c.servers, "%s", servers);
    c.num_trainers = n;
    int got = tr_config_local_trainers(&c);
    zt_rmtmp(dir);
    return got;
}

Test(tr_config, local_trainers_from_the_cluster_file_or_the_servers)
{
    char me[256] = "", text[1024];
    cr_assert_eq(gethostname(me, sizeof me - 1), 0);
    const char *launcher = "server = 127.0.0.1:7000\nserver = 127.0.0.1:7001\n"
                           "trainer = 127.0.0.1\ntrainer = 127.0.0.1\ntrainer = 127.0.0.1\n";
    cr_assert_eq(s_local("sync", launcher, NULL, 0), 3);
    cr_assert_eq(s_local("async", launcher, NULL, 0), 3);
    snprintf(text, sizeof text, "server = %s:7000\ntrainer = localhost\ntrainer = %s\n"
             "trainer = elsewhere.invalid\ntrainer = [::1]\n", me, me);
    cr_assert_eq(s_local("ssp", text, NULL, 0), 3, "localhost, %s and ::1 are here", me);
    cr_assert_eq(s_local("sync", "server = a.invalid:1\ntrainer = a.invalid\ntrainer = b.invalid\n",
                         NULL, 0), 1, "no trainer here: this one alone");
    cr_assert_eq(s_local("allreduce", "trainer = 127.0.0.1\ntrainer = 127.0.0.1\n", NULL, 0), 2);
    cr_assert_eq(s_local("allreduce", NULL, NULL, 4), 4);
    cr_assert_eq(s_local("sync", NULL, "tcp://127.0.0.1:1,tcp://localhost:2", 2), 2);
    cr_assert_eq(s_local("sync", NULL, "tcp://127.0.0.1:1,tcp://other.invalid:2", 2), 1);
    cr_assert_eq(s_local("local", NULL, NULL, 0), 1);
    cr_assert_eq(s_local("sync", "not a cluster file\n", NULL, 0), 1, "unreadable: 1");
}

Test(tr_config, curve_and_push_dtype_flags)
{
    tr_config c;
    zps_status st;
    const char *a[] = {"--data", "/d", "--mode", "async", "--servers", "tcp://127.0.0.1:1",
                       "--curve-server-key", "keys/server.pub", "--curve-key",
                       "keys/trainer-0.key", NULL};
    cr_assert_eq(s_parse(&c, a, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_str_eq(c.curve_server_key, "keys/server.pub");
    cr_assert_str_eq(c.curve_key, "keys/trainer-0.key");
    const char *plain[] = {"--data", "/d", NULL};
    cr_assert_eq(s_parse(&c, plain, &st), -1);
    cr_assert_str_eq(c.curve_server_key, "", "no keys by default: plaintext");
    cr_assert_str_eq(c.curve_key, "");
    cr_assert_eq(c.push_dtype, PS_DTYPE_F32, "f32 gradients by default");
    const char *bf[] = {"--data", "/d", "--push-dtype", "bf16", NULL};
    cr_assert_eq(s_parse(&c, bf, &st), -1);
    cr_assert_eq(c.push_dtype, PS_DTYPE_BF16);
}

Test(tr_config, help_exits_zero_and_lists_the_flags_with_real_defaults, .init = cr_redirect_stdout)
{
    tr_config c;
    zps_status st;
    const char *a[] = {"--help", NULL};
    cr_assert_eq(s_parse(&c, a, &st), 0);
    static char out[32768];
    zt_read_redirected(cr_get_redirected_stdout(), out, sizeof out);
    static const char *const flags[] = {
        "--model NAME", "--width F", "--input-size N", "--in-channels N", "--classes N",
        "--aux auto|on|off", "--dropout P", "--init-weights FILE", "--data DIR", "--threads N",
        "--augment", "--shard records|batch", "--device auto|cpu|cuda", "--mode M",
        "--cluster FILE", "--servers URI", "--trainer-id I", "--num-trainers N",
        "--replicas-to-aggregate R", "--staleness S", "--chunk-bytes B", "--job NAME",
        "--timeout-ms MS", "--curve-server-key FILE", "--curve-key FILE", "--push-dtype f32|bf16",
        "--batch-size N", "--steps N", "--epochs F", "--accumulate K", "--time-limit SEC",
        "--stop-accuracy A", "--optimizer NAME", "--lr F", "--momentum F", "--nesterov",
        "--rho F", "--epsilon F", "--beta1 F", "--beta2 F", "--weight-decay F",
        "--initial-accumulator F", "--lr-schedule constant|exponential|cosine", "--decay-rate F",
        "--decay-steps N", "--staircase", "--total-steps N", "--min-lr F", "--warmup-steps N",
        "--eval-every N", "--eval-batches N", "--eval-all", "--eval-only", "--metrics FILE",
        "--export FILE", "--resume", "--shutdown-servers", "--no-progress", "--seed N",
        "--log-level L", "--help"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        cr_assert_not_null(strstr(out, flags[i]), "'%s' not in:\n%s", flags[i], out);
    cr_assert_null(strstr(out, "batchnorm"), "no flag switches batchnorm off:\n%s", out);
    /* defaults read from tr_config_default, not written twice */
    static const char *const dflt[] = {"(default convnet)", "(default 0.05)", "(default 64)",
                                       "(default 30000)", "(default 4194304)"};
    for (size_t i = 0; i < sizeof dflt / sizeof dflt[0]; i++)
        cr_assert_not_null(strstr(out, dflt[i]), "'%s' not in:\n%s", dflt[i], out);
    const char *inch = strstr(out, "--in-channels");
    cr_assert_not_null(inch);
    cr_assert_not_null(strstr(inch, "(default: 1 for every model"), "%s", inch);
}

Test(tr_config, mode_names_round_trip)
{
    static const struct {
        const char *name;
        tr_mode mode;
    } m[] = {{"local", TR_MODE_LOCAL}, {"sync", TR_MODE_SYNC}, {"async", TR_MODE_ASYNC},
             {"ssp", TR_MODE_SSP}, {"allreduce", TR_MODE_ALLREDUCE}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
        tr_mode got;
        cr_assert_eq(tr_mode_parse(m[i].name, &got), ZPS_OK, "%s", m[i].name);
        cr_assert_eq(got, m[i].mode, "%s", m[i].name);
        cr_assert_str_eq(tr_mode_name(m[i].mode), m[i].name);
    }
    tr_mode got;
    cr_assert_eq(tr_mode_parse("unset", &got), ZPS_ERR_INVALID);
    cr_assert_eq(tr_mode_parse("", &got), ZPS_ERR_INVALID);
}

Test(tr_config, value_flags_land_in_their_fields)
{
    tr_config c;
    zps_status st;
    const char *a[] = {"--data", "/d", "--aux", "off", "--shard", "batch", "--device", "cpu",
                       "--no-progress", "--seed", "4611686018427387904", "--dropout", "0.3",
                       "--lr-schedule", "exponential", "--decay-steps", "10", "--staircase",
                       "--steps", "1e3", "--in-channels", "3", NULL};
    cr_assert_eq(s_parse(&c, a, &st), -1);
    cr_assert_eq(st, ZPS_OK);
    cr_assert_eq(c.aux, 0);
    cr_assert_eq(c.shard, TR_SHARD_BATCH);
    cr_assert_str_eq(c.device, "cpu");
    cr_assert_eq(c.progress, 0);
    cr_assert_eq(c.seed, 1ull << 62);
    cr_assert_float_eq(c.dropout, 0.3f, 1e-7);
    cr_assert_eq(c.opt.sched, PS_SCHED_EXPONENTIAL);
    cr_assert_eq(c.opt.decay_steps, 10);
    cr_assert_eq(c.opt.staircase, 1);
    cr_assert_eq(c.steps, 1000);
    cr_assert_eq(c.in_channels, 3);
    const char *g[] = {"--data", "/d", "--device", "staged", "--gpu", "3", "--recompute",
                       "--mode", "async", "--servers", "tcp://127.0.0.1:1", "--node-trainers",
                       "4", NULL};
    cr_assert_eq(s_parse(&c, g, &st), -1);
    cr_assert_str_eq(c.device, "staged");
    cr_assert_eq(c.gpu, 3);
    cr_assert_eq(c.recompute, 1);
    cr_assert_eq(c.node_trainers, 4);
    const char *d[] = {"--data", "/d", NULL};
    cr_assert_eq(s_parse(&c, d, &st), -1);
    cr_assert_eq(c.aux, -1, "auto");
    cr_assert_eq(c.in_channels, 0, "0: train.c's default, 1 channel for every model");
    cr_assert_eq(c.progress, 1);
}

static const struct {
    const char *args[10];
    const char *msg; /* in stderr */
} s_bad[] = {
    {{"--mode", "local", NULL}, "--data DIR is required"},
    {{"--data", "/d", "--mode", "gossip", NULL}, "--mode wants"},
    {{"--data", "/d", "--mode", "sync", NULL}, "needs --cluster FILE or --servers"},
    {{"--data", "/d", "--batch-size", "0", NULL}, "--batch-size wants an integer"},
    {{"--data", "/d", "--lr", "fast", NULL}, "--lr wants a number"},
    {{"--data", "/d", "--device", "tpu", NULL}, "--device wants"},
    {{"--data", "/d", "--eval-only", NULL}, "--eval-only needs --init-weights"},
    {{"--data", "/d", "--dump-detections", "3", NULL}, "--dump-detections draws a detector's boxes"},
    {{"--data", "/d", "--optimizer", "lion", NULL}, "--optimizer wants"},
    {{"--data", "/d", "extra", NULL}, "unexpected argument 'extra'"},
    {{"--data", "/d", "--curve-key", "t.key", NULL}, "--curve-server-key and --curve-key go together"},
    {{"--data", "/d", "--curve-server-key", "s.pub", NULL}, "--curve-server-key and --curve-key go together"},
    {{"--data", "/d", "--push-dtype", "f16", NULL}, "--push-dtype wants f32 or bf16, got 'f16'"},
    {{"--data", "/d", "--no-batchnorm", NULL}, "zps-trainer: unknown option '--no-batchnorm' (see --help)"},
    {{"--data", "/d", "--aux", "maybe", NULL}, "--aux wants auto, on or off, got 'maybe'"},
    {{"--data", "/d", "--steps", "2.5", NULL}, "--steps wants an integer"},
    {{"--data", "/d", "--seed", "-1", NULL}, "--seed wants an integer"},
    {{"--data", "/d", "--model", "m0123456789012345678901234567890", NULL}, "--model wants mlp, convnet, inception_v3 or ssd, got 'm01"},
    {{"--data", "/d", "--lr-schedule", "step", NULL}, "--lr-schedule wants constant, exponential or cosine"},
    {{"--data", "/d", "--log-level", "loud", NULL}, "--log-level wants"},
    {{"--data", "/d", "--in-channels", "4", NULL}, "--in-channels wants an integer in [1, 3], got '4'"},
    {{"--data", "/d", "--node-trainers", "2", NULL}, "--node-trainers groups the trainers of a PS job"},
    {{"--data", "/d", "--node-trainers", "3", "--num-trainers", "4", NULL}, "--node-trainers 3 does not divide the job's 4 trainers"},
    {{"--data", "/d", "--node-trainers", "2", "--num-trainers", "4", "--replicas-to-aggregate", "3", NULL}, "--replicas-to-aggregate 3: with --node-trainers 2 the servers see one trainer per node, 2 in all"},
    {{"--data", "/d", "--gpu", "-1", NULL}, "--gpu wants an integer in [0, 1023]"},
    {{"--data", "/d", "--device", "staged", "--recompute", "--node-trainers", "0", NULL}, "--node-trainers wants an integer in [1, 4096]"},
};

Test(tr_config, bad_command_lines_exit_2_and_name_the_flag, .init = cr_redirect_stderr)
{
    char err[8192];
    size_t seen = 0;
    for (size_t i = 0; i < sizeof s_bad / sizeof s_bad[0]; i++) {
        tr_config c;
        zps_status st;
        cr_assert_eq(s_parse(&c, s_bad[i].args, &st), 2, "case %zu accepted", i);
        cr_assert_eq(st, ZPS_ERR_INVALID, "case %zu", i);
        zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
        cr_assert_not_null(strstr(err + 0, s_bad[i].msg), "case %zu: '%s' not in:\n%s", i,
                           s_bad[i].msg, err);
        seen += strlen(err);
    }
    cr_assert(seen > 0);
}

Test(tr_config, an_unknown_model_is_refused_with_the_known_ones, .init = cr_redirect_stderr)
{
    tr_config c;
    zps_status st;
    const char *a[] = {"--data", "/nonexistent", "--model", "resnet", NULL};
    cr_assert_eq(s_parse(&c, a, &st), 2);
    char err[1024];
    zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
    cr_assert_str_eq(err, "zps-trainer: --model wants mlp, convnet, inception_v3 or ssd, got 'resnet' "
                          "(see --help)\n");
    static const char *const known[] = {"mlp", "convnet", "inception_v3"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        const char *ok[] = {"--data", "/d", "--model", known[i], NULL};
        cr_assert_eq(s_parse(&c, ok, &st), -1, "%s", known[i]);
        cr_assert_str_eq(c.model, known[i]);
    }
}

Test(it_cli, trainer_names_a_bad_model_before_opening_the_data, .timeout = 30)
{
    char *out;
    const char *a[] = {"--data", "/nonexistent/zps-data", "--model", "resnet", NULL};
    cr_assert_eq(zt_run_tmp("zps-trainer", a, NULL, 20, &out), 2);
    cr_assert_str_eq(out, "zps-trainer: --model wants mlp, convnet, inception_v3 or ssd, got 'resnet' "
                          "(see --help)\n");
    free(out);
}

Test(it_cli, trainer_on_a_cpu_only_machine_says_nothing_of_cuda_by_default, .timeout = 30)
{
    k_device_info info;
    cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    const char *env[] = {"ZPS_LOG=info", NULL};
    const char *a[] = {"--data", "/nonexistent/zps-data", "--steps", "1", NULL};
    char *out;
    cr_assert_eq(zt_run_tmp("zps-trainer", a, env, 20, &out), 1);
    if (info.kind == K_DEVICE_CPU)
        cr_assert_null(strstr(out, "CUDA"), "no CUDA line at info:\n%s", out);
    free(out);
    /* the line is still there for whoever asks, and before the data is opened */
    const char *dbg[] = {"--data", "/nonexistent/zps-data", "--log-level", "debug", NULL};
    cr_assert_eq(zt_run_tmp("zps-trainer", dbg, env, 20, &out), 1);
    cr_assert_not_null(strstr(out, info.kind == K_DEVICE_CPU ? "; using the CPU" : "using CUDA"),
                       "%s", out);
    free(out);
}

Test(it_cli, trainer_tells_each_failure_once, .timeout = 30)
{
    char *out;
    const char *data[] = {"--data", "/nonexistent/zps-data", NULL};
    cr_assert_eq(zt_run_tmp("zps-trainer", data, NULL, 20, &out), 1);
    cr_assert_eq(zt_count(out, "not found"), 1, "%s", out);
    cr_assert_null(strstr(out, "failed after 0 steps"), "%s", out);
    free(out);
    const char *cl[] = {"--data", "/nonexistent/zps-data", "--mode", "sync", "--cluster",
                        "/nonexistent/cluster.txt", NULL};
    cr_assert_eq(zt_run_tmp("zps-trainer", cl, NULL, 20, &out), 1);
    cr_assert_eq(zt_count(out, "No such file or directory"), 1, "%s", out);
    cr_assert_eq(zt_count(out, "\n"), 1, "one line:\n%s", out);
    free(out);
}

/* The device and node flags' run-time refusals, each with its reason: --device cuda where no
 * GPU answers (before the data is opened), and --node-trainers that does not divide a cluster
 * file's trainers (an explicit --num-trainers is refused at parse time, above). */
Test(it_cli, trainer_device_and_node_refusals_say_why, .timeout = 60)
{
    k_device_info info;
    cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    char *out;
    if (info.kind == K_DEVICE_CPU) {
        const char *a[] = {"--data", "/nonexistent/zps-data", "--device", "cuda", "--gpu", "1",
                           NULL};
        cr_assert_eq(zt_run_tmp("zps-trainer", a, NULL, 20, &out), 1);
        cr_assert_not_null(strstr(out, "--device cuda, but "), "%s", out);
        cr_assert_null(strstr(out, "/nonexistent"), "the data was opened first:\n%s", out);
        free(out);
    }
    /* a cluster file's trainer count is known only at run time */
    char dir[256], data[300], log[300], cluster[300];
    zt_mktmp(dir, sizeof dir, "zps-cli-node");
    snprintf(data, sizeof data, "%s/fm", dir);
    snprintf(log, sizeof log, "%s/data.log", dir);
    snprintf(cluster, sizeof cluster, "%s/cluster.txt", dir);
    zt_make_fashion(data, 64, 1, log);
    const char text[] = "server = 127.0.0.1:1\ntrainer = 127.0.0.1\ntrainer = 127.0.0.1\n"
                        "trainer = 127.0.0.1\ntrainer = 127.0.0.1\n";
    zt_write_file(cluster, text, sizeof text - 1);
    const char *n[] = {"--data", data, "--mode", "sync", "--cluster", cluster,
                       "--node-trainers", "3", "--batch-size", "4", "--steps", "1", NULL};
    cr_assert_eq(zt_run_tmp("zps-trainer", n, NULL, 30, &out), 1);
    cr_assert_not_null(strstr(out, "--node-trainers 3 does not divide the job's 4 trainers"),
                       "%s", out);
    free(out);
    zt_rmtmp(dir);
}
