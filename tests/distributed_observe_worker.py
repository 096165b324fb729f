"""One rank of tests/test_observe_distributed.py, started as torchrun starts one (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment): ``python distributed_observe_worker.py OUT PORT2 MODEL_DIR``.

It runs ``pathir observe`` (which joins the launcher's group itself), then, in a group of its own on
PORT2, pathir.observe on every kind of input the test compares with one process, and pickles what
each call returned, or the error it raised, to OUT/rank{RANK}.pkl.
"""

import contextlib
import io
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist

import pathir
from pathir.app.cli import main
from pathir.support.distributed import gather_or_raise

N = 11  # not a multiple of the world size
BACKEND = "numpy"  # 10x faster than torch on a net this small; "array_torch" runs the torch backend


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))


def data():
    return np.random.default_rng(0).normal(size=(N, 1, 6, 6))


class Failing(torch.utils.data.Dataset):
    """The samples of data(), but reading sample ``bad`` raises."""

    def __init__(self, bad):
        self.x, self.bad = torch.tensor(data()), bad

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.bad:
            raise RuntimeError(f"sample {i} is unreadable")
        return self.x[i]


class Reshuffled(torch.utils.data.DistributedSampler):
    """A subclass that draws another order on every pass (the global generator, seeded alike on every rank)."""

    def __iter__(self):
        order = torch.randperm(len(self.dataset)).tolist()
        return iter(order[self.rank::self.num_replicas])

    def __len__(self):
        return len(range(self.rank, len(self.dataset), self.num_replicas))


def loaders(rank, world):
    dataset = torch.utils.data.TensorDataset(torch.tensor(data()), torch.zeros(N))
    loader = torch.utils.data.DataLoader
    sampler = torch.utils.data.DistributedSampler
    return {
        "array": data(),
        "loader": loader(dataset, batch_size=3),
        "sampler": loader(dataset, batch_size=2, sampler=sampler(dataset, world, rank, shuffle=False)),
        "sampler_shuffled": loader(dataset, batch_size=4, sampler=sampler(dataset, world, rank, shuffle=True, seed=3)),
        "sampler_drop_last": loader(dataset, batch_size=4, sampler=sampler(dataset, world, rank, shuffle=False,
                                                                            drop_last=True)),
        "shuffled_loader": loader(dataset, batch_size=4, shuffle=True),
        "sampler_subclass": loader(dataset, batch_size=2, sampler=Reshuffled(dataset, world, rank)),
        "loader_drop_last": loader(dataset, batch_size=4, drop_last=True, sampler=sampler(dataset, world, rank,
                                                                                          shuffle=False)),
        "failing": loader(Failing(bad=9), batch_size=2),
    }


def outcome(call):
    try:
        obs = call()
        return {"columns": obs.columns, "global": obs.global_values, "quantiles": obs.quantiles()}
    except Exception as err:  # noqa: BLE001 - the test reads it
        return {"error": type(err).__name__, "message": str(err)}


def run(out, port2, model_dir):
    rank = int(os.environ["RANK"])
    stdout = io.StringIO()
    sys.path.insert(0, model_dir)
    with contextlib.redirect_stdout(stdout):
        code = main(["observe", "tinynet:make", "--inputs", os.path.join(model_dir, "x.npy"), "--json",
                     "--backend", BACKEND])
    results = {"cli": {"code": code, "stdout": stdout.getvalue(), "group_left": not dist.is_initialized()}}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    cm = pathir.compile(net(), input_shape=(1, 6, 6))
    masked = cm.graph.map_params(lambda p: p.with_value(np.where(np.abs(p.value) < 0.2, 0.0, p.value)))
    for name, inputs in loaders(rank, dist.get_world_size()).items():
        results[name] = outcome(lambda: pathir.observe(cm, inputs, qs=(1, 2), batch_size=4, backend=BACKEND))
    results["compare"] = outcome(lambda: pathir.observe(cm.graph, data(), compare=masked, batch_size=4, backend=BACKEND))
    # misuse that differs by rank: every rank must raise alike, none may wait in a collective
    results["split_first"] = outcome(lambda: pathir.observe(cm, data()[rank::2][:5], batch_size=4, backend=BACKEND))
    results["qs_differ"] = outcome(lambda: pathir.observe(cm, data(), qs=(1,) if rank == 0 else (2,), backend=BACKEND))
    results["batch_size_one_rank"] = outcome(lambda: pathir.observe(cm, data(), batch_size=0 if rank else 4,
                                                                    backend=BACKEND))
    negated = net()  # rank 1's first layer negated: the same |θ|, path-norms and path count as rank 0's
    with torch.no_grad():
        negated[0].weight.mul_(-1.0 if rank else 1.0)
    results["weights_differ"] = outcome(lambda: pathir.observe(pathir.compile(negated, input_shape=(1, 6, 6)), data(),
                                                               backend=BACKEND))
    batches = [torch.tensor(data()[i:i + 3]) for i in range(0, N, 3)]  # a data set whose items are batches
    results["batch_size_none"] = outcome(lambda: pathir.observe(cm, torch.utils.data.DataLoader(batches, batch_size=None),
                                                                backend=BACKEND))

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("its message cannot be formatted")

    def unprintable():
        if rank == 1:
            raise Unprintable()
        return 0

    try:
        gather_or_raise(unprintable, "a job")
        results["unprintable"] = {"error": None}
    except Exception as err:  # noqa: BLE001 - the test reads it
        results["unprintable"] = {"error": type(err).__name__, "message": str(err)}

    class Interrupted(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            if i == N - 2:  # in rank 1's shard, and not one of the samples every rank reads to compare data
                raise KeyboardInterrupt
            return torch.tensor(data()[i])

    try:
        results["interrupt"] = outcome(lambda: pathir.observe(cm, torch.utils.data.DataLoader(Interrupted(), batch_size=2),
                                                              backend=BACKEND))
    except KeyboardInterrupt:  # the interrupted rank's own interrupt goes on as it is
        results["interrupt"] = {"error": "KeyboardInterrupt", "message": ""}
    # one rank alone, as `if rank == 0:` calls it: no collective (the other rank would never join it)
    results["one_rank"] = (outcome(lambda: pathir.observe(cm, data(), qs=(1, 2), batch_size=4, backend=BACKEND,
                                                          distributed=False)) if rank == 0 else None)
    dist.barrier()
    results["array_torch"] = outcome(lambda: pathir.observe(cm, data(), qs=(1, 2), batch_size=4, backend="torch"))
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
