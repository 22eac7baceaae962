"""fleet_trainer.py — one trainer process of test_fleet.py: an ordinary PyTorch loop on a
small MLP, changed by the zps.torch lines only. Trainer r of N takes rows [r*B/N, (r+1)*B/N)
of every batch of B; the data and the initial model come from fixed seeds, so every process
(and --local, plain torch.optim.SGD with the whole batch) sees the same. Writes the final
parameters to --out (.npz, state_dict names) and its losses on stdout."""
import argparse

import numpy as np
import torch
import torch.nn.functional as F

import zps.torch

ap = argparse.ArgumentParser()
ap.add_argument("--servers", default="")
ap.add_argument("--trainer", type=int, default=0)
ap.add_argument("--trainers", type=int, default=1)
ap.add_argument("--mode", default="sync")
ap.add_argument("--staleness", type=int, default=0)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--local", action="store_true", help="torch.optim.SGD, no servers")
ap.add_argument("--out", required=True)
a = ap.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
gen = torch.Generator().manual_seed(1)
X = torch.randn(a.steps, a.batch, 8, generator=gen)
Y = torch.randint(0, 3, (a.steps, a.batch), generator=gen)
rows = slice(a.trainer * a.batch // a.trainers, (a.trainer + 1) * a.batch // a.trainers)

if a.local:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
else:
    ps = zps.torch.ParameterServer(model, a.servers.split(","), trainer_id=a.trainer,
                                   num_trainers=a.trainers, mode=a.mode, staleness=a.staleness,
                                   optimizer="momentum", lr=0.05, momentum=0.9,
                                   chunk_bytes=256)
for s in range(a.steps):
    loss = F.cross_entropy(model(X[s, rows]), Y[s, rows])
    if a.local:
        opt.zero_grad()
    loss.backward()
    if a.local:
        opt.step()
    else:
        ps.step()
    print("step %d loss %.6f" % (s, loss.item()), flush=True)
if not a.local:
    ps.close()  # waits for the last pull: the servers' final values
np.savez(a.out, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
