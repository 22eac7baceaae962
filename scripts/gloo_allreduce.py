#!/usr/bin/python3
"""gloo_allreduce.py - the peer of `zps-bench allreduce`: torch.distributed's gloo all-reduce.

Runs under Debian's /usr/bin/python3 (python3-torch 1.13). Starts --ranks processes on this
machine (rendezvous on a free 127.0.0.1 port), and for each size in --sizes (bytes) times
--reps all-reduces (sum) of a float32 tensor after --warmup untimed ones. Each repetition is
timed on every rank between a barrier and the end of the all-reduce; the time of a repetition
is the slowest rank's. Prints one JSON list on stdout:
    [{"bytes": B, "median_s": T, "gbps": B / T / 1e9, "times_s": [...]}, ...]
GB/s is algorithm bandwidth: the bytes of one rank's buffer divided by the time of the
collective, 1 GB = 1e9 bytes - the same definition zps-bench uses for zps.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.ranks)
    results = []
    gen = torch.Generator().manual_seed(1234 + rank)
    for nbytes in args.sizes:
        n = nbytes // 4
        t = torch.rand(n, generator=gen, dtype=torch.float32) - 0.5
        for _ in range(args.warmup):
            dist.all_reduce(t)
        times = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        # slowest rank per repetition
        tt = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        times = tt.tolist()
        med = statistics.median(times)
        results.append({"bytes": nbytes, "median_s": med, "gbps": nbytes / med / 1e9,
                        "times_s": times})
        del t
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1000000, 10000000, 100000000], help="bytes, comma separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    port = free_port()
    out_path = f"/tmp/zps-gloo-{os.getpid()}.json"
    try:
        mp.spawn(worker, args=(args, port, out_path), nprocs=args.ranks, join=True)
        with open(out_path) as f:
            json.dump(json.load(f), sys.stdout)
        sys.stdout.write("\n")
    finally:
        if os.path.exists(out_path):
            os.unlink(out_path)


if __name__ == "__main__":
    main()
