"""pathir side by side with the path-norm toolkit's algorithm (A. Gonon et al., ``pathnorm_toolkit``), in float64.

    python benchmarks/bench_toolkit.py [resnet18,resnet50,vgg16] [--repeat 5]
    python benchmarks/bench_toolkit.py --toolkit /path/to/pathnorm_toolkit [models]

The toolkit's algorithm: one forward of the model on the all-ones input, every weight and bias
w made |w|^q, batch-norms as the affine maps they are in eval mode, max-pools as sums over their
windows (an average over n entries weighs each |1/n|^q), the outputs summed: Σ_p |Φ_p|^q.
Without ``--toolkit`` the script runs that algorithm as written here, from its definition
(:func:`reference_path_norm`, float64: a float64 twin of the model, made untimed, whose tensors
are overwritten from the model's in each timed call). With ``--toolkit`` it imports the
published toolkit from a checkout (its root: ``src/pathnorm/`` and ``ok_models.json``, read
from the working directory; never part of this repository) and hands it a float64 copy of the
model; given a path where there is none, the script says so and exits 0.

Workloads per model, each timed end to end in this process, interleaved with its baseline
(pathir, then the toolkit, then pathir, ...), median of ``--repeat``:

(a) one l1 path-norm: ``pathir.compile(self_check=False)`` + ``cm.path_norm(1)`` against one
    call of the toolkit's algorithm (goal: pathir / toolkit <= 1.2);
(b) q = 1, 2, 4 at once: compile + ``cm.path_norms((1, 2, 4))`` against three calls (goal <= 1);
(c) tracking: 10 SGD steps, one l1 path-norm after each. pathir compiles once and queries
    the live Compiled (it re-reads the moved values, docs/live.md); the toolkit recomputes.
    Only the path-norm work is timed, pathir's compile included (goal <= 1);
(s) the self-check's cost: compile with it minus compile without, in float32 forwards of the
    model at batch 1 (its own dtype; measured interleaved).

ratio = pathir time / toolkit time (below 1: pathir faster): the median of the per-repeat
ratios, and in parentheses that of the fastest runs (min / min, the least disturbed by other
jobs). The log10 gap of the two values is printed too (pathir's path-norm is exact; the reference's float64 sums agree to ~1e-13 unless
they overflow float64, shown as inf).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time

import torch
from rows_out import measured, save_json  # run as a script: benchmarks/ is on sys.path

import pathir
from pathir.app import zoo

QS = (1, 2, 4)


def load_toolkit(root: str | None):
    """The toolkit's ``compute_path_norm`` module from its checkout ``root``, or None."""
    if not root or not os.path.isdir(os.path.join(root, "src", "pathnorm")):
        return None
    sys.path.insert(0, os.path.join(root, "src"))
    from pathnorm.path_norm import compute_path_norm as toolkit

    return toolkit


@contextlib.contextmanager
def inside(directory: str | None):
    """The toolkit reads ok_models.json from the working directory."""
    old = os.getcwd()
    if directory:
        os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(old)


# ------------------------------------------------------------------ the toolkit's algorithm, from its definition


class SumPool2d(torch.nn.Module):
    """A max-pool's window summed (its path-norm network: every entry of the window is a path)."""

    def __init__(self, pool: torch.nn.MaxPool2d):
        super().__init__()
        if pool.dilation not in (1, (1, 1)):
            raise NotImplementedError("a dilated max-pool")
        self.pool = pool

    def forward(self, x):
        p = self.pool
        return torch.nn.functional.avg_pool2d(x, p.kernel_size, p.stride, p.padding, p.ceil_mode,
                                              count_include_pad=True, divisor_override=1)


class PoweredAdaptiveAvgPool2d(torch.nn.Module):
    """An adaptive average over windows of n entries, each weighing |1/n|^q: avg · n^{1-q}."""

    def __init__(self, pool: torch.nn.AdaptiveAvgPool2d, q: float):
        super().__init__()
        self.pool, self.q = pool, q

    def forward(self, x):
        out = self.pool(x)
        (h, w), (oh, ow) = x.shape[-2:], out.shape[-2:]
        if h % oh or w % ow:
            raise NotImplementedError("an adaptive average pool of unequal windows")
        return out * float((h // oh) * (w // ow)) ** (1.0 - self.q)


def path_norm_twin(model: torch.nn.Module, q: float) -> torch.nn.Module:
    """A float64 copy of ``model`` (eval mode) with its pools replaced; :func:`load_powered` fills it."""
    twin = copy.deepcopy(model).double().eval()
    for name, module in list(twin.named_modules()):
        parent, _, attr = name.rpartition(".")
        if isinstance(module, torch.nn.MaxPool2d):
            setattr(twin.get_submodule(parent), attr, SumPool2d(module))
        elif isinstance(module, torch.nn.AdaptiveAvgPool2d):
            setattr(twin.get_submodule(parent), attr, PoweredAdaptiveAvgPool2d(module, q))
        elif isinstance(module, torch.nn.BatchNorm2d):
            module.eps = 0.0
    return twin


@torch.no_grad()
def load_powered(twin: torch.nn.Module, model: torch.nn.Module, q: float) -> None:
    """The twin's tensors ← |w|^q of the model's, in float64; a batch-norm as its eval-mode affine map
    a·x + c (a = γ/√(var + eps), c = β − μ·a): weight |a|^q, bias |c|^q, statistics 0 and 1.
    (pathir folds a batch-norm into the layer before it, whose bias b then joins c as |a·b + c|^q:
    the same path-norm where that layer has no bias, as in every torchvision model.)"""
    ours = dict(twin.named_modules())
    for name, module in model.named_modules():
        theirs = ours[name]
        if isinstance(module, torch.nn.BatchNorm2d):
            a = module.weight.double() / (module.running_var.double() + module.eps).sqrt()
            c = module.bias.double() - module.running_mean.double() * a
            theirs.weight.copy_(a.abs_().pow_(q))
            theirs.bias.copy_(c.abs_().pow_(q))
            theirs.running_mean.zero_()
            theirs.running_var.fill_(1.0)
            continue
        for attr, t in module.named_parameters(recurse=False):
            getattr(theirs, attr).copy_(t).abs_().pow_(q)


def reference_path_norm(twin: torch.nn.Module, model: torch.nn.Module, shape, q: float) -> float:
    """log10 ||Φ||_q by the toolkit's algorithm in float64 (inf where Σ |Φ_p|^q overflows float64)."""
    for module in twin.modules():
        if isinstance(module, PoweredAdaptiveAvgPool2d):
            module.q = q
    load_powered(twin, model, q)
    with torch.no_grad():
        total = float(twin(torch.ones(1, *shape, dtype=torch.float64)).sum())
    return math.log10(total) / q if 0 < total < math.inf else math.inf


@contextlib.contextmanager
def full_walk(enabled: bool):
    """pathir's path-norms by the full-resolution walk (before the all-ones walk stored feature maps
    along their constant runs, pathir.lifting.ones_walk): the *before* of ``--full-walk``."""
    if not enabled:
        yield
        return
    from pathir.lifting import path_norm as pn
    from pathir.lifting import walk

    saved = pn.ones_forward, pn.ones_log_total, pn._log_path_sums
    pn.ones_forward = lambda graph, backend, linearize=False: walk.path_forward(graph, backend, linearize=linearize)
    pn.ones_log_total = walk.log_total
    pn._log_path_sums = lambda graph, qs, backend: {}  # no q walked in step with another
    try:
        yield
    finally:
        pn.ones_forward, pn.ones_log_total, pn._log_path_sums = saved


# ------------------------------------------------------------------ timing


def interleaved(ours, theirs, repeat: int):
    """(median of ours' seconds, median of theirs', median of the ratios ours/theirs, last values,
    ratio of the fastest runs min ours / min theirs), the two called in turn, each timed by itself
    (``theirs`` returns (seconds, value))."""
    times, values = [], (None, None)
    for _ in range(repeat):
        start = time.perf_counter()
        mine = ours()
        seconds = time.perf_counter() - start
        their_seconds, their_value = theirs()
        times.append((seconds, their_seconds))
        values = (mine, their_value)
    return (statistics.median(t for t, _ in times), statistics.median(t for _, t in times),
            statistics.median(a / b for a, b in times), values,
            min(t for t, _ in times) / min(t for _, t in times))


def sgd_steps(model, shape, steps: int, seed: int = 0):
    """Yield after each of ``steps`` SGD steps (eval mode: batch-norm statistics stay)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(2, *shape, generator=gen)
        target = torch.randint(0, 1000, (2,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # random-init resnet50 diverges to NaN without
        opt.step()
        yield


def _log10_gap(ours_log10: float, theirs_log10: float) -> float:
    """|log10 of pathir's norm - log10 of the toolkit's| (inf where the toolkit's overflowed)."""
    if theirs_log10 is None or math.isnan(theirs_log10):
        return math.nan
    return abs(ours_log10 - theirs_log10)


class Toolkit:
    """One call of the toolkit (or of its algorithm here) on a float64 copy of the model, timed
    without the copy: ``(seconds, log10 of each q's path-norm)``."""

    def __init__(self, model, name: str, shape, toolkit=None):
        self.model, self.name, self.shape, self.toolkit = model, name, shape, toolkit
        self.twin = None if toolkit is not None else path_norm_twin(model, 1.0)

    def __call__(self, qs=(1,)):
        if self.toolkit is None:
            start = time.perf_counter()
            values = [reference_path_norm(self.twin, self.model, self.shape, q) for q in qs]
            return time.perf_counter() - start, values
        twin = copy.deepcopy(self.model).double()  # its in-place swaps do not always restore a layer
        cpu = torch.device("cpu")
        start = time.perf_counter()
        if len(qs) == 1:
            out = [self.toolkit.get_path_norm(twin, self.name, cpu, exponent=qs[0])]
        else:
            out = list(self.toolkit.compute_path_norms(twin, self.name, list(qs), cpu, False))
        seconds = time.perf_counter() - start
        return seconds, [math.log10(float(v)) if 0 < float(v) < math.inf else math.inf for v in out]


def bench(name: str, toolkit, repeat: int, steps: int, workloads: str = "abcs") -> dict:
    shape = zoo.input_shape(name)
    model = zoo.build(name).eval()
    theirs = Toolkit(model, name, shape, toolkit)
    row = {"model": name, "toolkit": "published" if toolkit is not None else "reference (float64)"}
    pathir.compile(model, input_shape=shape, self_check=False).path_norm(1)  # imports, allocator: untimed

    def ours_one():
        return pathir.compile(model, input_shape=shape, self_check=False).path_norm(1, log10=True)

    def ours_many():
        return pathir.compile(model, input_shape=shape, self_check=False).path_norms(QS, log10=True)

    if "a" in workloads:
        a = interleaved(ours_one, theirs, repeat)
        row.update(a_pathir_s=a[0], a_toolkit_s=a[1], a_ratio=a[2], a_ratio_min=a[4], a_log10_gap=_log10_gap(a[3][0], a[3][1][0]))
    if "b" in workloads:
        b = interleaved(ours_many, lambda: theirs(QS), repeat)
        gaps = [_log10_gap(b[3][0][q], v) for q, v in zip(QS, b[3][1])]
        row.update(b_pathir_s=b[0], b_toolkit_s=b[1], b_ratio=b[2], b_ratio_min=b[4], b_log10_gap=max(gaps))
    if "c" in workloads:
        _workload_c(row, model, shape, steps, theirs)
    if "s" in workloads:
        _self_check_cost(row, model, shape, repeat)
    return row


def _workload_c(row, model, shape, steps, theirs):
    """Compile once, then after each SGD step one l1 path-norm of the live Compiled (timed: the
    compile and the queries) against the toolkit's recomputation (timed: its calls)."""
    ours_c = theirs_c = 0.0
    start = time.perf_counter()
    cm = pathir.compile(model, input_shape=shape, self_check=False)
    ours_c += time.perf_counter() - start
    ours = value = math.nan
    for _ in sgd_steps(model, shape, steps):
        start = time.perf_counter()
        ours = cm.path_norm(1, log10=True)
        ours_c += time.perf_counter() - start
        seconds, (value,) = theirs()
        theirs_c += seconds
    row.update(c_pathir_s=ours_c, c_toolkit_s=theirs_c, c_ratio=ours_c / theirs_c, c_log10_gap=_log10_gap(ours, value))


def _self_check_cost(row, model, shape, repeat):
    """(compile with the self-check − compile without) / one forward of the model (its dtype, batch 1)."""
    x = torch.randn(1, *shape)
    costs, forwards = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        pathir.compile(model, input_shape=shape, self_check=False)
        without = time.perf_counter() - start
        start = time.perf_counter()
        pathir.compile(model, input_shape=shape)
        costs.append(time.perf_counter() - start - without)
        start = time.perf_counter()
        with torch.no_grad():
            model(x)
        forwards.append(time.perf_counter() - start)
    row.update(s_seconds=statistics.median(costs), s_forwards=statistics.median(c / f for c, f in zip(costs, forwards)))


def _cell(r, k) -> str:
    if f"{k}_ratio" not in r:
        return "not run | |"
    fastest = f" ({r[f'{k}_ratio_min']:.2f}×)" if f"{k}_ratio_min" in r else ""
    return f"{r[f'{k}_pathir_s']:.3f} s / {r[f'{k}_toolkit_s']:.3f} s | {r[f'{k}_ratio']:.2f}×{fastest} |"


def table(rows) -> str:
    out = ["| model | (a) one path-norm: pathir / toolkit | ratio | (b) q = 1, 2, 4 | ratio | "
           f"(c) {rows[0]['steps'] if rows else 10} SGD steps | ratio | self-check (forwards) | log10 gap |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = f"{r['s_seconds']:.3f} s ({r['s_forwards']:.1f})" if "s_seconds" in r else "not run"
        gap = max((r.get(f"{k}_log10_gap", 0.0) for k in "abc"), default=0.0)
        out.append(f"| {r['model']} | {_cell(r, 'a')} {_cell(r, 'b')} {_cell(r, 'c')} {check} | {gap:.1e} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default="resnet18,resnet50,vgg16")
    ap.add_argument("--toolkit", default=os.environ.get("PATHNORM_TOOLKIT"),
                    help="root of a pathnorm_toolkit checkout (or env PATHNORM_TOOLKIT); without: the algorithm here")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="abcs", help="which of a, b, c, s to run (e.g. c)")
    ap.add_argument("--full-walk", action="store_true",
                    help="pathir walks every feature map at full size (the walk before the stored runs)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    toolkit = load_toolkit(args.toolkit)
    if args.toolkit and toolkit is None:
        print("pathnorm_toolkit not found at --toolkit / PATHNORM_TOOLKIT: nothing to compare, skipped")
        return []
    with inside(os.path.abspath(args.toolkit) if toolkit is not None else None), full_walk(args.full_walk):
        rows = measured({**bench(name, toolkit, args.repeat, args.steps, args.workloads), "steps": args.steps}
                        for name in args.models.split(","))
    print(table(rows))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
