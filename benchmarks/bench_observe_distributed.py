"""Throughput of pathir.observe (samples/s) with 1, 2, ... processes of a gloo process group.

    python benchmarks/bench_observe_distributed.py [resnet18] [--size 32] [--samples 256] [--batch 16]
        [--nprocs 1 2] [--threads T] [--device cuda]

For each process count P, P ranks are started as torchrun starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); each compiles the model, then, after a barrier, walks its shard of the
same random samples (torch backend, float64) and all-gathers the table. The time is rank 0's wall
time of the whole ``pathir.observe`` call (walk and gather), the best of ``--repeat``. Each rank uses
``--threads`` torch threads (default: the cores / P, so that every P gets the same cores). With
``--device cuda`` rank r walks on cuda:(r mod the GPUs). On a shared machine the figures move with
the load; compare the process counts of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def _rank_main(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import pathir
    from pathir.app import zoo
    from pathir.backends import get_backend

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = None
    if args.device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    cm = pathir.compile(zoo.build(args.model).eval(), input_shape=(3, args.size, args.size), backend="torch")
    backend = get_backend("torch", device=device)
    x = np.random.default_rng(0).normal(size=(args.samples, 3, args.size, args.size))
    pathir.observe(cm, x[: args.batch * dist.get_world_size()], batch_size=args.batch, backend=backend)  # warm-up
    times = []
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        obs = pathir.observe(cm, x, batch_size=args.batch, backend=backend, progress=False)
        times.append(time.perf_counter() - start)
    assert len(obs) == args.samples
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"seconds": min(times)}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, nprocs: int) -> dict:
    threads = args.threads or max(1, (os.cpu_count() or 1) // nprocs)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        env = {**os.environ, "WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        argv = [sys.executable, __file__, "--rank-main", "--out", out, "--threads", str(threads), args.model,
                "--size", str(args.size), "--samples", str(args.samples), "--batch", str(args.batch),
                "--repeat", str(args.repeat), "--device", args.device]
        procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nprocs)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        with open(out) as f:
            seconds = json.load(f)["seconds"]
    return {"model": args.model, "input": [3, args.size, args.size], "samples": args.samples, "batch": args.batch,
            "device": args.device, "processes": nprocs, "threads_per_process": threads, "seconds": seconds,
            "samples_per_s": args.samples / seconds}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="resnet18")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: the cores / P)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        _rank_main(args)
        return []
    rows = [run(args, p) for p in args.nprocs]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / rows[0]["samples_per_s"]
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
