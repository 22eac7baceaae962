# peers_ddp.py — the PyTorch peer of scripts/bench.d/tf-peers: zps's convnet under
# DistributedDataParallel with gloo (Debian's /usr/bin/python3, python3-torch). One process
# per rank, started by peers.py:
#
#   /usr/bin/python3 peers_ddp.py RANK PORT ARGS_JSON
#
# Rank 0 prints one line "PEERS {json}": img_s (both ranks' images per second over the
# steady steps), params and variables. The convnet is trainer/models/models.c's: conv3x3
# without bias + batchnorm (eps 0.001) + ReLU, 2x2 max pool, twice; dense 128 ReLU, dropout
# 0.25, dense 10. Momentum 0.9 SGD, batch 32 per rank, one thread per process.
import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from peers_data import load_fashion

BATCH = 32


def convnet(classes=10):
    def cbr(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout, eps=1e-3),
                nn.ReLU()]
    return nn.Sequential(*cbr(1, 32), nn.MaxPool2d(2), *cbr(32, 64), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Dropout(0.25),
                         nn.Linear(128, classes))


def main():
    rank, port, a = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a["workers"])
    model = convnet()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params, n_vars = sum(p.numel() for p in params), len(params)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=a["lr"], momentum=a["momentum"])
    x, y = load_fashion()
    x = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(y.astype(np.int64))
    gen = torch.Generator().manual_seed(rank + 1)
    loss_fn = nn.CrossEntropyLoss()

    def steps(n):
        for _ in range(n):
            idx = torch.randint(0, x.shape[0], (BATCH,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x[idx]), y[idx])
            loss.backward()
            opt.step()
        return float(loss)

    steps(a["warmup"])
    dist.barrier()
    t0 = time.perf_counter()
    loss = steps(a["steps"])
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        print("PEERS " + json.dumps({"img_s": a["steps"] * BATCH * a["workers"] / dt,
                                     "params": n_params, "variables": n_vars,
                                     "loss": loss, "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
