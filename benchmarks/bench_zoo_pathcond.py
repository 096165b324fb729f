"""``cm.pathcond()`` end to end on the torchvision zoo, against the model's own float64 forward+backward.

For each model (randomly initialised, ``pathir.app.zoo.build``; googlenet and
inception_v3 without their train-only aux heads):

1. one forward+backward of the model in float64 at batch 1, the baseline,
   measured in this process right before each run of 2. (interleaved, so that a
   load change on a shared machine moves both);
2. ``cm.pathcond()`` on a model freshly compiled with the defaults (compile and its self-check not
   timed; the self-check's forward is the write-back check's "before"; units, B,
   diag G, solve and write-back are), ``--repeat`` times, with its solver
   steps (block sweeps + Newton iterations) and the split diag G / group / solve / write of its
   fastest run; the ratio columns: best pathcond / best baseline, and the median
   over the runs of pathcond / the baseline measured just before it;
3. with ``--reference``, the coordinate solver (the published algorithm) on
   the same g, row keys and bound, run to convergence (``--reference-sweeps``
   at most), and F(default) - F(coordinate) relative to |F|: <= 0 means the
   default ends at least as low.

Prints one markdown table row per model (the table in docs/pathcond.md).
Timings are noisy on a shared machine: compare the ratio column, measured in
one process, not absolute seconds across runs.

timm's ReLU models are measured the same way: ``--models timm`` (the list ``TIMM_MODELS``) or
``--models timm:resnet50d ...`` (random init, batch-norm statistics drawn as for torchvision's).

Run:  python benchmarks/bench_zoo_pathcond.py [--models resnet18 googlenet ...|all|timm] [--repeat 2] [--reference]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pathir
from pathir.app import zoo

DEFAULT_MODELS = ["resnet18", "googlenet", "densenet121", "squeezenet1_0", "shufflenet_v2_x1_0", "mnasnet1_0"]


TIMM = "timm:"
#: timm's ReLU models measured for the 10x goal (``--models timm``), each compiled by tests/test_timm_zoo.py
TIMM_MODELS = ["resnet50d", "regnetx_002", "dla34", "resnet26d", "xception41", "densenet121", "vgg11", "dpn68",
               "repvgg_a0", "hrnet_w18_small"]


def build(name):
    """A torchvision model (``zoo.build``), or ``timm:NAME``: timm's, random init, batch-norm statistics
    drawn as ``zoo.build`` draws them and every γ in [0.5, 1.5] (timm zero-initialises the last γ of
    each residual block, a choice for training from scratch that no trained model keeps: it would
    leave every residual branch dead), eval mode."""
    if name.startswith(TIMM):
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name[len(TIMM):], pretrained=False)
        gen = torch.Generator().manual_seed(0)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                if m.affine:
                    m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
        return model.eval()
    extra = {"aux_logits": False} if name in ("googlenet", "inception_v3") else {}
    return zoo.build(name, **extra)


def input_shape(name):
    """224x224 for timm's models (299x299 for xception), ``zoo.input_shape`` for torchvision's."""
    if name.startswith(TIMM):
        return (3, 299, 299) if "xception" in name else (3, 224, 224)
    return zoo.input_shape(name)


def forward_backward(name):
    """A function timing one float64 forward+backward of the model at batch 1 (warmed up once)."""
    model = build(name).double()
    x = torch.randn(1, *input_shape(name), dtype=torch.float64)

    def step():
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return time.perf_counter() - t

    step()  # warm-up
    return step


def forward_backward_seconds(name, repeat):
    step = forward_backward(name)
    return min(step() for _ in range(repeat))


def pathcond_runs(name, repeat, solver):
    """(best baseline, (seconds, report, cm) of the fastest run, median of run / the baseline just before it)."""
    step, runs, bases = forward_backward(name), [], []
    for _ in range(repeat):  # each on a fresh model: pathcond() rescales it in place
        # compiled as users compile: the self-check (untimed) records the forward the write-back's check reads
        cm = pathir.compile(build(name), input_shape=input_shape(name))
        bases.append(step())
        t = time.perf_counter()
        report = cm.pathcond(solver=solver)
        runs.append((time.perf_counter() - t, report, cm))
    median = statistics.median(r[0] / b for r, b in zip(runs, bases))
    return min(bases), min(runs, key=lambda r: r[0]), median


def coordinate_gap(name, report, max_sweeps):
    """F(report) - F(coordinate to convergence), relative, on the same g, B and bound."""
    from pathir.lifting.diag_g import diag_g_flat
    from pathir.pathcond.solvers import solve

    cm = pathir.compile(build(name), input_shape=input_shape(name), self_check=False)
    g, log_top = diag_g_flat(cm.graph, cm.get_backend())
    B, _ = cm.incidence()
    ref = solve(g, B, method="coordinate", tol=1e-13, max_sweeps=max_sweeps, row_key=cm.row_keys(),
                max_log_scale=report.max_log_scale)
    f_ref = ref.f_final + g.size * log_top
    return (report.objective_after - f_ref) / abs(f_ref), ref


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help="zoo names, 'all' (zoo.SUPPORTED), timm:NAME, or 'timm' (TIMM_MODELS)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--solver", default="newton")
    ap.add_argument("--reference", action="store_true", help="also run the coordinate solver to convergence")
    ap.add_argument("--reference-sweeps", type=int, default=3000)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = zoo.SUPPORTED if args.models == ["all"] else \
        [TIMM + n for n in TIMM_MODELS] if args.models == ["timm"] else args.models
    print(f"torch threads: {torch.get_num_threads()}, solver {args.solver}")
    print("| model | fwd+bwd f64 (s) | pathcond (s) | ratio (best) | ratio (median) | diag G / group / solve / write (s) | "
          "sweeps + Newton its | max\\|z\\| (bound, at bound) | F vs coordinate |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in names:
        base, (seconds, report, cm), median = pathcond_runs(name, args.repeat, args.solver)
        steps = f"{report.sweeps}" + ("" if report.converged else " (NOT converged)")
        gap = "—"
        if args.reference:
            rel, ref = coordinate_gap(name, report, args.reference_sweeps)
            gap = f"{rel:+.1e} (coord. {ref.sweeps} sweeps{'' if ref.converged else ', not converged'})"
        row = (f"| {name} | {base:.3f} | {seconds:.2f} | {seconds / base:.1f}x | {median:.1f}x | "
               f"{' / '.join(f'{report.timings.get(k, 0):.2f}' for k in ('diag G', 'group', 'solve', 'write'))} | {steps} | "
               f"{report.max_abs_log_scale:.3g} ({report.max_log_scale:.3g}, {len(report.units_at_bound)}) | {gap} |")
        print(row, flush=True)
        rows.append((name, seconds / base, report))
    return rows


if __name__ == "__main__":
    main()
