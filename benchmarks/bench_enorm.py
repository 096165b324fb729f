"""cm.enorm() and cm.normalize() on the torchvision zoo, against the model's own float64 forward+backward.

Per model (``pathir.app.zoo.build``, eval mode): the reference is one forward +
backward pass of the model itself in float64 at batch 1 (best of ``--repeat``,
after a warm-up), measured in the same process with the same thread count.
Then, each on a freshly compiled model (units, B and row keys are built inside
the call, as a user's first call does): ``cm.enorm()`` (Newton-CG, the default;
``--solver block`` for the reference sweeps) and ``cm.normalize()``, each with
its write-back into the model. Printed: seconds, the ratio to the reference,
sweeps (Newton iterations), whether the stopping rule was met, and a Markdown
table (``--markdown``) for docs/normalize.md.

Timings on a shared machine are noisy: compare the ratios of one run.

Run:  python benchmarks/bench_enorm.py [resnet18 densenet121 ...] [--threads 2] [--repeat 3] [--solver newton]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import pathir
from pathir.app.zoo import build, input_shape

DEFAULT_MODELS = ["resnet18", "resnet50", "googlenet", "densenet121", "vgg11"]


def model_of(name: str):
    kwargs = {"aux_logits": False} if name in ("googlenet", "inception_v3") else {}
    return build(name, **kwargs).eval()


def forward_backward_f64(model, shape, repeat: int) -> float:
    """Best time of one float64 forward + backward at batch 1."""
    m = copy.deepcopy(model).double()
    x = torch.randn(1, *shape, dtype=torch.float64)

    def step():
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()

    step()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times)


def timed_call(name: str, call: str, **kwargs):
    """(seconds, report) of ``cm.<call>(**kwargs)`` on a fresh model and compile."""
    shape = input_shape(name)
    cm = pathir.compile(model_of(name), input_shape=shape)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t = time.perf_counter()
        report = getattr(cm, call)(**kwargs)
        seconds = time.perf_counter() - t
    return seconds, report


def row(name: str, repeat: int, solver: str, skip_normalize: bool) -> dict:
    shape = input_shape(name)
    reference = forward_backward_f64(model_of(name), shape, repeat)
    t_enorm, er = timed_call(name, "enorm", solver=solver)
    out = {"model": name, "reference_s": reference, "enorm_s": t_enorm, "enorm_ratio": t_enorm / reference,
           "sweeps": er.sweeps, "converged": er.converged, "step": er.step, "units": er.units}
    if not skip_normalize:
        try:
            t_norm, _ = timed_call(name, "normalize")
            out.update(normalize_s=t_norm, normalize_ratio=t_norm / reference, normalize="ok")
        except pathir.PathirError as err:  # no normalisation exists (a cycle of units with too much mass)
            out.update(normalize_s=float("nan"), normalize_ratio=float("nan"), normalize=type(err).__name__)
    print(f"{name}: fwd+bwd f64 {reference:.3f}s | enorm ({solver}) {t_enorm:.2f}s = {t_enorm / reference:.1f}x, "
          f"{er.sweeps} sweeps, converged {er.converged} (step {er.step:.1e}, {er.units:,} units)"
          + ("" if skip_normalize else f" | normalize {out['normalize_s']:.2f}s = {out['normalize_ratio']:.1f}x"),
          flush=True)
    return out


def markdown(rows) -> str:
    lines = ["| model | units | fwd+bwd f64 (s) | enorm (s) | ratio | sweeps | converged | normalize (s) | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['units']:,} | {r['reference_s']:.3f} | {r['enorm_s']:.2f} | "
                     f"{r['enorm_ratio']:.1f}× | {r['sweeps']} | {'yes' if r['converged'] else 'NO'} | "
                     f"{r.get('normalize_s', float('nan')):.2f} | {r.get('normalize_ratio', float('nan')):.1f}× |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--solver", default="newton", choices=["newton", "block", "coordinate"])
    ap.add_argument("--skip-normalize", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    rows = [row(name, args.repeat, args.solver, args.skip_normalize) for name in args.models]
    if args.markdown:
        print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
