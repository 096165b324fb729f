"""A training step with the path-norm penalty against one without it (issue 27: <= 1.5x).

    python benchmarks/bench_penalty.py [--model resnet18] [--batch 32] [--size 224] [--threads 1] [--repeat 3]

One SGD step on random data (cross-entropy, the model in train mode, float32, CPU): forward,
backward, step. The penalised step adds ``lam * penalty()`` to the loss, ``penalty =
pathir.PathNormPenalty(model, q)``: the exact gradient of the l_q path-norm (log-scaled walk,
chained to the model's parameters), the Compiled following the model the optimizer moves. Both
steps are timed in the same process, alternately, and the median of each is reported, with the
ratio of each pair and the penalty alone (its forward and backward after the model moved). On a
shared machine the pairs show how much of a spread is load from elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import pathir
from pathir.app import zoo


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(model_name: str = "resnet18", batch: int = 32, size: int = 224, threads: int = 1, repeat: int = 3,
        q: float = 2.0, lam: float = 1e-4) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = zoo.build(model_name)
    model.train()
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # train mode: pathir analyses the batch-norms with running statistics
        start = time.perf_counter()
        penalty = pathir.PathNormPenalty(model, q=q, input_shape=(3, size, size))
        compile_s = time.perf_counter() - start

        def step(penalised: bool):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if penalised:
                loss = loss + lam * penalty()
            loss.backward()
            opt.step()

        def penalty_only():
            opt.zero_grad()
            (lam * penalty()).backward()

        step(False), step(True)  # warm up: allocator, the Compiled's coordinates
        plain, penalised, alone = [], [], []
        for _ in range(repeat):
            plain.append(timed(lambda: step(False)))
            penalised.append(timed(lambda: step(True)))
            with torch.no_grad():
                model(x[:2])  # moves the running statistics, as a training step does
            alone.append(timed(penalty_only))
    out = {"model": model_name, "batch": batch, "size": size, "threads": threads, "q": q, "compile_s": compile_s,
           "step_s": statistics.median(plain), "penalised_step_s": statistics.median(penalised),
           "penalty_s": statistics.median(alone)}
    out["ratio"] = out["penalised_step_s"] / out["step_s"]
    out["pair_ratios"] = [b / a for a, b in zip(plain, penalised)]  # each penalised step over the plain one before it
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--q", type=float, default=2.0)
    a = ap.parse_args(argv)
    r = run(a.model, a.batch, a.size, a.threads, a.repeat, a.q)
    print(f"{r['model']}, batch {r['batch']}, {r['size']}x{r['size']}, {r['threads']} thread(s), q = {r['q']:g}, "
          f"CPU float32, train mode")
    print(f"  compile (once)          {r['compile_s']:.2f} s")
    print(f"  training step           {r['step_s']:.3f} s")
    print(f"  penalised training step {r['penalised_step_s']:.3f} s   ratio {r['ratio']:.2f}x (goal <= 1.5x)")
    print(f"  per pair: {', '.join(f'{x:.2f}x' for x in r['pair_ratios'])} (median {statistics.median(r['pair_ratios']):.2f}x)")
    print(f"  penalty alone (after the model moved: re-read, walk, backward) {r['penalty_s']:.3f} s")


if __name__ == "__main__":
    main()
