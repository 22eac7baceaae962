# peers_tf.py — the TensorFlow side of scripts/bench.d/tf-peers: zps's convnet and
# Inception-v3 rebuilt on raw TF ops, trained under ParameterServerStrategy or
# MultiWorkerMirroredStrategy. One process per role, started by peers.py with TF_CONFIG set:
#
#   python peers_tf.py pss-server            # a PS or a worker task: a gRPC server, forever
#   python peers_tf.py pss-coordinator ARGS  # the chief: builds, schedules, measures, prints
#   python peers_tf.py mwms-worker ARGS      # one MultiWorkerMirroredStrategy worker
#   python peers_tf.py train-step ARGS       # one process, `zps-bench train-step`'s TF side
#
# The measuring process prints one line "PEERS {json}" with img_s (the whole fleet's images
# per second over the steady steps), params and variables. The models are written with
# tf.Variable and tf.nn ops (no Keras) so the variables are exactly zps's (trainer/models/
# models.c): convolutions without bias, each followed by batchnorm (trainable gamma and beta,
# eps 0.001) and ReLU; the parameter count and variable count are those zps prints. TF keeps
# its own best layout, NHWC. Running statistics of batchnorm are not kept (zps's are not
# sent to the servers either), which can only make TF's step cheaper.
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from peers_data import load_fashion  # noqa: E402

BATCH = 32
BN_EPS = 1e-3


def threads_one(strategy):
    """One compute thread per process (intra-op 1), like zps's trainers. The inter-op pool
    (threads that start independent ops) is 1 too, except under ParameterServerStrategy:
    there a worker's function blocks in its receives from the PS and with one inter-op
    thread the fleet deadlocks, so PSS gets 2 (PEERS_TF_PSS_INTER, PEERS_TF_MWMS_INTER)."""
    inter = int(os.environ.get(f"PEERS_TF_{strategy}_INTER", "2" if strategy == "PSS" else "1"))
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    return inter


class Model:
    """zps's models on tf.Variable: the first call creates the variables (in the order zps
    declares them), later calls reuse them."""

    def __init__(self, name, width, size, classes=10, seed=1, channels=1):
        self.name, self.width, self.size, self.classes = name, width, size, classes
        self.channels = channels
        self.vars = []
        self._by_name = {}
        self._rng = np.random.default_rng(seed)

    def _var(self, name, shape, std=None, value=None):
        if name in self._by_name:
            return self._by_name[name]
        if value is None:
            value = (self._rng.standard_normal(shape) * std).astype(np.float32)
        v = tf.Variable(np.full(shape, value, np.float32) if np.isscalar(value) else value,
                        name=name.replace(".", "_"), trainable=True)
        self._by_name[name] = v
        self.vars.append(v)
        return v

    def ch(self, c):
        return max(1, int(np.floor(c * self.width + 0.5)))

    def conv_bn_relu(self, name, x, k, r, s, stride, pad, std=0.1):
        cin = x.shape[-1]
        w = self._var(name + ".conv.weight", (r, s, cin, k), std)
        g = self._var(name + ".bn.weight", (k,), value=1.0)
        b = self._var(name + ".bn.bias", (k,), value=0.0)
        y = tf.nn.conv2d(x, w, stride, "VALID" if pad == (0, 0) else "SAME")
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, g, b, epsilon=BN_EPS, is_training=True)
        return tf.nn.relu(y)

    def dense(self, name, x, n, relu, std):
        w = self._var(name + ".weight", (x.shape[-1], n), std)
        b = self._var(name + ".bias", (n,), value=0.0)
        y = tf.matmul(x, w) + b
        return tf.nn.relu(y) if relu else y

    def __call__(self, x, training=True):
        if self.name == "convnet":
            return self._convnet(x, training)
        return self._inception(x, training)

    def _convnet(self, x, training):
        x = self.conv_bn_relu("conv1", x, 32, 3, 3, 1, (1, 1), np.sqrt(2 / 9))
        x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        x = self.conv_bn_relu("conv2", x, 64, 3, 3, 1, (1, 1), np.sqrt(2 / (9 * 32)))
        x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        x = tf.reshape(x, (-1, x.shape[1] * x.shape[2] * x.shape[3]))
        x = self.dense("fc1", x, 128, True, np.sqrt(2 / x.shape[-1]))
        if training:
            x = tf.nn.dropout(x, 0.25)
        return self.dense("fc2", x, self.classes, False, np.sqrt(1 / 128))

    # ---- Inception-v3 (torchvision's blocks, as trainer/models/models.c builds them) ----
    def _bc(self, blk, br, x, k, r, s=None, stride=1, pad=None):
        s = r if s is None else s
        pad = ((r - 1) // 2, (s - 1) // 2) if pad is None else pad
        return self.conv_bn_relu(f"{blk}.{br}" if blk else br, x, self.ch(k), r, s, stride, pad)

    def _avg_branch(self, blk, x, f):
        return self._bc(blk, "branch_pool", tf.nn.avg_pool2d(x, 3, 1, "SAME"), f, 1)

    def _inc_a(self, n, x, pf):
        b1 = self._bc(n, "branch1x1", x, 64, 1)
        b5 = self._bc(n, "branch5x5_2", self._bc(n, "branch5x5_1", x, 48, 1), 64, 5)
        b3 = self._bc(n, "branch3x3dbl_1", x, 64, 1)
        b3 = self._bc(n, "branch3x3dbl_3", self._bc(n, "branch3x3dbl_2", b3, 96, 3), 96, 3)
        return tf.concat([b1, b5, b3, self._avg_branch(n, x, pf)], -1)

    def _inc_b(self, n, x):
        b3 = self._bc(n, "branch3x3", x, 384, 3, stride=2, pad=(0, 0))
        bd = self._bc(n, "branch3x3dbl_2", self._bc(n, "branch3x3dbl_1", x, 64, 1), 96, 3)
        bd = self._bc(n, "branch3x3dbl_3", bd, 96, 3, stride=2, pad=(0, 0))
        return tf.concat([b3, bd, tf.nn.max_pool2d(x, 3, 2, "VALID")], -1)

    def _inc_c(self, n, x, c7):
        b1 = self._bc(n, "branch1x1", x, 192, 1)
        b7 = self._bc(n, "branch7x7_1", x, c7, 1)
        b7 = self._bc(n, "branch7x7_2", b7, c7, 1, 7)
        b7 = self._bc(n, "branch7x7_3", b7, 192, 7, 1)
        bd = self._bc(n, "branch7x7dbl_1", x, c7, 1)
        bd = self._bc(n, "branch7x7dbl_2", bd, c7, 7, 1)
        bd = self._bc(n, "branch7x7dbl_3", bd, c7, 1, 7)
        bd = self._bc(n, "branch7x7dbl_4", bd, c7, 7, 1)
        bd = self._bc(n, "branch7x7dbl_5", bd, 192, 1, 7)
        return tf.concat([b1, b7, bd, self._avg_branch(n, x, 192)], -1)

    def _inc_d(self, n, x):
        b3 = self._bc(n, "branch3x3_1", x, 192, 1)
        b3 = self._bc(n, "branch3x3_2", b3, 320, 3, stride=2, pad=(0, 0))
        b7 = self._bc(n, "branch7x7x3_1", x, 192, 1)
        b7 = self._bc(n, "branch7x7x3_2", b7, 192, 1, 7)
        b7 = self._bc(n, "branch7x7x3_3", b7, 192, 7, 1)
        b7 = self._bc(n, "branch7x7x3_4", b7, 192, 3, stride=2, pad=(0, 0))
        return tf.concat([b3, b7, tf.nn.max_pool2d(x, 3, 2, "VALID")], -1)

    def _inc_e(self, n, x):
        b1 = self._bc(n, "branch1x1", x, 320, 1)
        b3 = self._bc(n, "branch3x3_1", x, 384, 1)
        b3a = self._bc(n, "branch3x3_2a", b3, 384, 1, 3)
        b3b = self._bc(n, "branch3x3_2b", b3, 384, 3, 1)
        bd = self._bc(n, "branch3x3dbl_2", self._bc(n, "branch3x3dbl_1", x, 448, 1), 384, 3)
        bda = self._bc(n, "branch3x3dbl_3a", bd, 384, 1, 3)
        bdb = self._bc(n, "branch3x3dbl_3b", bd, 384, 3, 1)
        return tf.concat([b1, b3a, b3b, bda, bdb, self._avg_branch(n, x, 192)], -1)

    def _inception(self, x, training):
        v = (0, 0)
        x = self._bc("", "Conv2d_1a_3x3", x, 32, 3, stride=2, pad=v)
        x = self._bc("", "Conv2d_2a_3x3", x, 32, 3, pad=v)
        x = self._bc("", "Conv2d_2b_3x3", x, 64, 3)
        x = tf.nn.max_pool2d(x, 3, 2, "VALID")
        x = self._bc("", "Conv2d_3b_1x1", x, 80, 1)
        x = self._bc("", "Conv2d_4a_3x3", x, 192, 3, pad=v)
        x = tf.nn.max_pool2d(x, 3, 2, "VALID")
        x = self._inc_a("Mixed_5b", x, 32)
        x = self._inc_a("Mixed_5c", x, 64)
        x = self._inc_a("Mixed_5d", x, 64)
        x = self._inc_b("Mixed_6a", x)
        for n, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
            x = self._inc_c(n, x, c7)
        x = self._inc_d("Mixed_7a", x)
        x = self._inc_e("Mixed_7b", x)
        x = self._inc_e("Mixed_7c", x)
        x = tf.reduce_mean(x, axis=(1, 2))
        if training:
            x = tf.nn.dropout(x, 0.5)
        return self.dense("fc", x, self.classes, False, 0.1)

    def build(self):
        """Creates the variables with one eager forward pass on one image."""
        self(tf.zeros((1, self.size, self.size, self.channels)), training=False)
        return sum(int(np.prod(v.shape)) for v in self.vars), len(self.vars)


def dataset(size, seed):
    """This worker's training stream: shuffled Fashion-MNIST, batches of 32, resized to the
    model's input on the fly (zps's trainers resize each record as they decode it). One
    private thread for tf.data, like zps's one decode thread."""
    x, y = load_fashion()
    ds = tf.data.Dataset.from_tensor_slices((x, y.astype(np.int32))).shuffle(8192, seed=seed)
    ds = ds.repeat().batch(BATCH, drop_remainder=True)

    def prep(img, lab):
        img = tf.cast(img, tf.float32)[..., None] / 255.0
        if size != 28:
            img = tf.image.resize(img, (size, size))
        return img, lab

    ds = ds.map(prep).prefetch(2)
    opt = tf.data.Options()
    opt.threading.private_threadpool_size = 1
    return ds.with_options(opt)


def loss_of(model, img, lab):
    logits = model(img, training=True)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(lab, logits))


def report(img_s, params, nvars, extra=None):
    rec = {"img_s": img_s, "params": params, "variables": nvars, "tf": tf.__version__}
    rec.update(extra or {})
    print("PEERS " + json.dumps(rec), flush=True)


# ---------------------------------------------------------------- ParameterServerStrategy

def pss_server():
    """A PS or worker task: serves until killed."""
    inter = threads_one("PSS")
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cfg = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                   inter_op_parallelism_threads=inter)
    srv = tf.distribute.Server(r.cluster_spec(), job_name=r.task_type, task_index=r.task_id,
                               protocol="grpc", config=cfg, start=True)
    srv.join()


def pss_coordinator(a):
    threads_one("PSS")
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    # Variables of 256 KiB or more are cut in two, one half per PS; smaller ones go whole to
    # one PS, round-robin. zps cuts its flat parameter vector into ~64 chunks spread evenly;
    # for TF that many pieces would only add RPCs, so two halves give the same balance.
    part = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=2)
    strat = tf.distribute.experimental.ParameterServerStrategy(r, variable_partitioner=part)
    coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strat)
    with strat.scope():
        model = Model(a["model"], a["width"], a["size"])
        params, nvars = model.build()
        shards = []
        for v in model.vars:
            shards.extend(v.variables if hasattr(v, "variables") else [v])
        slots = []
        for s in shards:
            with strat.extended.colocate_vars_with(s):
                slots.append(tf.Variable(tf.zeros(s.shape), trainable=False))
    per_ps = {}
    for s in shards:
        per_ps[s.device] = per_ps.get(s.device, 0) + int(np.prod(s.shape))
    lr, mom, k = a["lr"], a["momentum"], a["steps_per_call"]

    def ds_fn(ctx=None):  # traced once, run on each worker: the order does not matter here
        return dataset(a["size"], seed=None)

    it = iter(coord.create_per_worker_dataset(ds_fn))

    @tf.function
    def train(iterator):
        loss = tf.constant(0.0)
        for _ in tf.range(k):
            img, lab = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_of(model, img, lab)
            grads = tape.gradient(loss, shards)
            for g, s, m in zip(grads, shards, slots):
                m.assign(mom * m + g)
                s.assign_sub(lr * m)
        return loss

    def run(calls):
        last = [coord.schedule(train, args=(it,)) for _ in range(calls)][-1]
        coord.join()
        return float(last.fetch())

    run(max(1, a["warmup"] * a["workers"] // k))
    t0 = time.perf_counter()
    calls = max(1, a["steps"] * a["workers"] // k)
    loss = run(calls)
    dt = time.perf_counter() - t0
    report(calls * k * BATCH / dt, params, nvars,
           {"loss": loss, "shards": len(shards), "elements_per_ps": sorted(per_ps.values())})


# ---------------------------------------------------------------- MultiWorkerMirroredStrategy

def mwms_worker(a):
    threads_one("MWMS")
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strat = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    with strat.scope():
        model = Model(a["model"], a["width"], a["size"])
        params, nvars = model.build()
        slots = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in model.vars]
    lr, mom, k = a["lr"], a["momentum"], a["steps_per_call"]
    task = strat.cluster_resolver.task_id
    dist = strat.distribute_datasets_from_function(lambda ctx: dataset(a["size"], seed=task + 1))
    it = iter(dist)

    def apply(strategy, grads):
        def upd(v, g, m):
            m.assign(mom * m + g)
            return v.assign_sub(lr * m)
        for v, g, m in zip(model.vars, grads, slots):
            strategy.extended.update(v, upd, args=(g, m), group=False)

    def step(img, lab):
        with tf.GradientTape() as tape:
            loss = loss_of(model, img, lab)
        grads = tape.gradient(loss, model.vars)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        ctx.merge_call(apply, args=(grads,))
        return loss

    @tf.function
    def train(iterator):
        loss = tf.constant(0.0)
        for _ in tf.range(k):
            img, lab = next(iterator)
            loss = strat.run(step, args=(img, lab))
        return loss

    for _ in range(max(1, a["warmup"] // k)):
        train(it)
    t0 = time.perf_counter()
    calls = max(1, a["steps"] // k)
    for _ in range(calls):
        loss = train(it)
    dt = time.perf_counter() - t0
    if task == 0:
        report(calls * k * BATCH * a["workers"] / dt, params, nvars,
               {"loss": float(strat.experimental_local_results(loss)[0])})


# ---------------------------------------------------------------- one process, one step

def train_step(a):
    """`zps-bench train-step`'s TF side: forward + backward + momentum SGD on random input,
    one tf.function step per call, THREADS intra-op threads (inter-op 1 when THREADS is 1).
    Reports img_s = batch / the median step time over the timed steps, cpu_ips the same over
    the process's CPU time of a step (all its threads), and step_s."""
    th = a.get("threads", 1)
    tf.config.threading.set_intra_op_parallelism_threads(th)
    tf.config.threading.set_inter_op_parallelism_threads(1 if th == 1 else 0)
    model = Model(a["model"], a.get("width", 1.0), a["size"], a.get("classes", 10),
                  channels=a.get("channels", 1))
    params, nvars = model.build()
    slots = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in model.vars]
    lr, mom, b = 0.001, 0.9, a["batch"]
    rng = np.random.default_rng(0)
    img = tf.constant(rng.standard_normal((b, a["size"], a["size"], model.channels), np.float32))
    lab = tf.constant(rng.integers(0, model.classes, b, dtype=np.int32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_of(model, img, lab)
        grads = tape.gradient(loss, model.vars)
        for v, g, m in zip(model.vars, grads, slots):
            m.assign(mom * m + g)
            v.assign_sub(lr * m)
        return loss

    times, cpu = [], []
    for s in range(a["warmup"] + a["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        step().numpy()
        if s >= a["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    report(b / float(np.median(times)), params, nvars,
           {"cpu_ips": b / float(np.median(cpu)), "step_s": times})


def main():
    role = sys.argv[1]
    if role == "pss-server":
        return pss_server()
    a = json.loads(sys.argv[2])
    if role == "pss-coordinator":
        return pss_coordinator(a)
    if role == "mwms-worker":
        return mwms_worker(a)
    if role == "train-step":
        return train_step(a)
    if role == "count":
        m = Model(a["model"], a["width"], a["size"])
        params, nvars = m.build()
        return report(None, params, nvars)
    raise SystemExit(f"peers_tf.py: unknown role {role}")


if __name__ == "__main__":
    main()
