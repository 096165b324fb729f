"""observe: stream a data set through the activation-filtered observables (docs/activations.md).

Per sample x: log10 ‖Φ(θ) ⊙ a(θ, x)‖_q for each q, log10 of the number of active
paths, the fraction of active ReLU neurons; with ``compare`` (a pruned or quantized
θ' of the same architecture) also the active path-metric brackets, whether θ' keeps
θ's pattern at x, the local bound, the global bound (path-metric upper ·
max(‖x‖∞, 1)) and the real change ‖R_θ(x) − R_θ'(x)‖₁.

Under an initialised torch.distributed process group each rank walks only its
share of the samples and every rank returns the whole table, in data set order
(docs/activations.md, "Across processes").
"""

from __future__ import annotations

import csv
import io
import math
import numbers
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from pathir.errors import ArgumentError, InputShapeError
from pathir.ir import Graph
from pathir.lifting.active import log_active_path_sum, parts, walk_size
from pathir.lifting.active_metric import active_path_metric
from pathir.lifting.path_metric import backend_of, graph_of, path_metric
from pathir.lifting.path_norm import check_q, log_max_path, log_path_sum
from pathir.lifting.pattern import activation_pattern, as_input_dict
from pathir.lifting.walk import forward
from pathir.support.distributed import Group, gather_or_raise, group, shard
from pathir.support.progress import quiet_tqdm

__all__ = ["Observations", "observe", "QUANTILES"]

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


@dataclass
class Observations:
    """One row per sample (``columns``: name -> array (N,)), and the model's global values."""

    columns: dict[str, np.ndarray]
    global_values: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def quantiles(self, qs=QUANTILES) -> dict[str, dict[float, float]]:
        """{column: {q: quantile}} over the samples (nan entries left out; numpy's linear interpolation, with
        ±inf entries kept: the quantiles among -inf values are -inf, not nan). ``qs``: numbers, or one number."""
        qs = _several(qs)
        bad = [q for q in qs if not (isinstance(q, numbers.Real) and 0 <= q <= 1)]
        if bad:
            raise ArgumentError(f"quantiles must be numbers in [0, 1], got {bad}")
        out = {}
        for name, v in self.columns.items():
            v = np.asarray(v, dtype=np.float64)
            v = v[~np.isnan(v)]
            v = np.sort(v)
            out[name] = {q: _quantile(v, q) for q in qs}
        return out

    def to_dict(self) -> dict:
        return {
            "samples": len(self),
            "global": dict(self.global_values),
            "quantiles": {k: {f"{q:g}": v for q, v in d.items()} for k, d in self.quantiles().items()},
            "columns": {k: np.asarray(v, dtype=np.float64).tolist() for k, v in self.columns.items()},
        }

    def to_csv(self, path=None) -> str:
        """The per-sample table as CSV (written to ``path`` too when given)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        names = list(self.columns)
        w.writerow(["sample", *names])
        for i in range(len(self)):
            w.writerow([i, *(repr(float(self.columns[n][i])) for n in names)])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def __str__(self) -> str:
        qs = self.quantiles()
        head = ["column", *(f"q{q:g}" for q in QUANTILES)]
        rows = [[name, *(f"{v:.4g}" for v in d.values())] for name, d in qs.items()]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [f"{len(self)} samples"] + [f"{k}: {v:.6g}" for k, v in self.global_values.items()]
        lines += ["  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in [head, *rows]]
        return "\n".join(lines)


def _several(qs) -> tuple:
    """``qs`` as a tuple: one number (``qs=2``, as ``active_path_norm(q=2)`` reads it) is a tuple of one."""
    return (qs,) if isinstance(qs, numbers.Real) or not hasattr(qs, "__iter__") else tuple(qs)


def _batches(inputs, batch_size: int):
    """Arrays/tensors (B, *shape) from a DataLoader (batches or (x, y, ...) tuples), an array or a tensor, or a list
    of batches (arrays, or nested lists); dicts {input: batch} from a dict of arrays (several inputs), cut alike."""
    if isinstance(inputs, Mapping):
        n = _dict_length(inputs)
        for start in range(0, n, batch_size):
            yield {k: v[start:start + batch_size] for k, v in inputs.items()}
        return
    if hasattr(inputs, "shape"):
        for start in range(0, int(inputs.shape[0]), batch_size):
            yield inputs[start:start + batch_size]
        return
    for batch in inputs:
        # (x, y, ...) as a DataLoader yields it: its first entry an array, a tensor or a dict; a list of numbers or of
        # lists is itself the batch (or a sample, which the shape check names)
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        if len(getattr(first, "shape", ())) or isinstance(first, Mapping):  # (a numpy number is a row's entry)
            batch = batch[0]
        yield batch


def _numpy(x) -> np.ndarray:
    x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    return np.asarray(x, dtype=np.float64)


def _dict_length(inputs: Mapping) -> int:
    """The number of samples of a dict {input: array (N, *shape)}; InputShapeError unless they all have N."""
    sizes = {k: int(v.shape[0]) if hasattr(v, "shape") else -1 for k, v in inputs.items()}
    if not sizes or -1 in sizes.values() or len(set(sizes.values())) != 1:
        raise InputShapeError(f"inputs: a dict of inputs needs one array or tensor (N, *shape) per input, all of the "
                              f"same N; got {sizes} samples (-1: not an array)")
    return next(iter(sizes.values()))


def _total(inputs) -> int | None:
    if isinstance(inputs, Mapping):
        return _dict_length(inputs)
    if hasattr(inputs, "shape"):
        return int(inputs.shape[0])
    dataset = getattr(inputs, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def observe(cm, inputs, qs=(1.0,), counts: bool = True, compare=None, batch_size: int | None = None,
            progress: bool | None = None, backend=None, distributed: bool | None = None) -> Observations:
    """Activation-filtered observables of ``cm`` on every sample of ``inputs``.

    Parameters
    ----------
    cm : Compiled (or Graph)
    inputs : numpy array or tensor (N, *input shape), a dict {input name: such an array} (several
        inputs), or an iterable of batches (a DataLoader; a batch may be an (x, y) pair or a dict)
    qs : the q of each active path-norm column ``log10_active_l{q}`` (one number, or several)
    counts : add ``log10_active_paths``
    compare : a Compiled (or Graph) θ' of the same architecture: adds the active path-metric
        columns ``lower``, ``upper``, ``shared``, ``flipped`` (neurons whose state differs),
        ``local_estimate`` (upper · max(‖x‖∞, 1)), ``local_bound`` (the estimate where the
        pattern is shared, a bound there; nan elsewhere), ``global_bound`` and ``output_change``
    batch_size : samples per walk (arrays, tensors and a loader's larger batches are cut into such parts);
        None (default): as many as keep the walk's feature maps within ``pathir.lifting.active.WALK_BYTES`` (128 MB) in
        float64, at most 32 (densenet121 at 64×64: 7, resnet18 at 224×224: 5; a small MLP: 32)
    progress : a tqdm bar on stderr; None shows it only on a terminal (and on rank 0)
    distributed : None (default): shard across the ranks of an initialised torch.distributed
        process group, if any; False: walk every sample in this process (a call from some ranks
        only, ``if rank == 0:``: with sharding, the others never join its collectives and it waits)

    Under an initialised torch.distributed process group, each rank walks only its share:
    an array, a tensor or a DataLoader over a map-style data set in order is cut into
    contiguous shards; a DataLoader with a (stock) DistributedSampler walks the sampler's samples
    (its padding duplicates are dropped). Every rank returns the same table, in data set order.
    Every rank must call it, with the same inputs.

    Returns
    -------
    Observations: per-sample columns, quantiles, ``to_dict`` and ``to_csv``.

    >>> import numpy as np, torch, pathir
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> cm = pathir.compile(net, input_shape=(3,))
    >>> obs = pathir.observe(cm, np.random.default_rng(0).normal(size=(5, 3)))
    >>> len(obs), sorted(obs.columns)
    (5, ['active_fraction', 'log10_active_l1', 'log10_active_paths'])
    >>> bool(np.all(obs.columns["log10_active_l1"] <= obs.global_values["log10_path_norm_l1"] + 1e-12))
    True
    """
    qs = _several(qs)
    if distributed not in (None, False):
        raise ArgumentError(f"observe: distributed must be None (shard across an initialised process group) or False "
                            f"(walk every sample in this process), got {distributed!r}")
    grp = group() if distributed is None else None
    if grp is None:
        _check_batch_size(batch_size)
        _check_inputs(graph_of(cm), inputs)
        _check_order(inputs)
        return _walk(cm, inputs, qs, counts, compare, batch_size, _enabled(progress), backend, _total(inputs))
    return _observe_shards(cm, inputs, qs, counts, compare, batch_size, progress, backend, grp)


def _check_inputs(graph, inputs) -> None:
    """ArgumentError for inputs that hold no samples at all (None, a number, a string); InputShapeError for an array,
    a tensor or a dict of them whose samples do not have the inputs' shapes (checked even with no sample)."""
    if inputs is None or isinstance(inputs, (numbers.Number, str, bytes)):
        raise ArgumentError(f"observe: inputs must be an array or tensor (N, *input shape), a dict of them, or an "
                            f"iterable of batches (a DataLoader); got {type(inputs).__name__}")
    arrays = inputs if isinstance(inputs, Mapping) else {graph.inputs[0]: inputs} if len(graph.inputs) == 1 else {}
    for name, v in arrays.items():
        if name in graph.inputs and hasattr(v, "shape") and tuple(v.shape)[1:] != graph.node(name).shape:
            raise InputShapeError(f"observe: input '{name}' expects samples of shape {graph.node(name).shape}, "
                                  f"(N, {', '.join(map(str, graph.node(name).shape))}) in all; got {tuple(v.shape)}")


def _check_order(inputs) -> None:
    """ArgumentError for a DataLoader over a map-style data set that does not read it in order, all of it (a
    shuffled, weighted, distributed or custom sampler or batch sampler): the table's rows are numbered in the
    order they are read, which would then name no sample of the data set."""
    tud = sys.modules.get("torch.utils.data")
    if tud is None or not isinstance(inputs, tud.DataLoader) or isinstance(inputs.dataset, tud.IterableDataset):
        return
    bs = inputs.batch_sampler
    sampler = inputs.sampler if bs is None else getattr(bs, "sampler", None)
    if (bs is None or type(bs) is tud.BatchSampler) and type(sampler) is tud.SequentialSampler:
        return
    what = type(sampler if sampler is not None and (bs is None or type(bs) is tud.BatchSampler) else bs).__name__
    why = ("a DistributedSampler outside a torch.distributed process group reads its own shard of the data set "
           "(shuffled by default)" if isinstance(sampler, tud.DistributedSampler) else
           f"this DataLoader's {what} may reorder the samples or leave some out")
    raise ArgumentError(
        f"pathir.observe numbers the table's samples in the order it reads them, as sample 0, 1, ...; {why}, so row "
        "k would not be sample k of the data set. Pass a loader with shuffle=False and no sampler (or the data "
        "set's samples in order); a DistributedSampler is read as such under an initialised process group")


def _enabled(progress, rank: int = 0) -> bool:
    return (rank == 0 and sys.stderr.isatty()) if progress is None else bool(progress)


def _distinct(qs: list) -> list:
    """The qs once each, in order; ArgumentError where two differ but name one column (``log10_active_l{q:g}``)."""
    qs = list(dict.fromkeys(qs))
    labels = {}
    for q in qs:
        other = labels.setdefault(f"{q:g}", q)
        if other != q:
            raise ArgumentError(f"observe: qs {other!r} and {q!r} would both be the column 'log10_active_l{q:g}': "
                                "give q values that differ in their first 6 significant digits")
    return qs


def _walk(cm, inputs, qs, counts, compare, batch_size, show, backend, total) -> Observations:

    graph, be = graph_of(cm), backend_of(cm, backend)
    qs = _distinct([check_q(q, "observe") for q in qs])
    ln10 = math.log(10)
    glob = {f"log10_path_norm_l{q:g}": (log_max_path(graph) if q == math.inf else log_path_sum(graph, q, be) / q) / ln10
            for q in qs}
    if counts:
        glob["log10_paths"] = log_path_sum(graph, 0, be) / ln10
    metric = None
    if compare is not None:
        metric = path_metric(cm if not isinstance(cm, Graph) else graph, compare, be)
        glob["path_metric_upper"] = metric.upper
    names = [f"log10_active_l{q:g}" for q in qs] + (["log10_active_paths"] if counts else []) + ["active_fraction"]
    cols: dict[str, list] = {name: [] for name in names + (list(_COMPARED) if compare is not None else [])}
    size = walk_size(graph, batch_size)
    with quiet_tqdm()(total=total, desc="pathir observe", unit="sample", disable=not show, file=sys.stderr) as bar:
        for x in (part for batch in _batches(inputs, size) for part in parts(_input_dict(graph, batch, inputs), size)):
            pat = activation_pattern(graph, be, x)
            for q in qs:
                root = 1.0 if q == math.inf else q
                cols.setdefault(f"log10_active_l{q:g}", []).append(log_active_path_sum(graph, be, pat, q) / root / ln10)
            if counts:
                cols.setdefault("log10_active_paths", []).append(log_active_path_sum(graph, be, pat, 0) / ln10)
            cols.setdefault("active_fraction", []).append(pat.active_fraction(be))
            if compare is not None:
                m = active_path_metric(graph, graph_of(compare), x, be, chunk=size)
                other = forward(graph_of(compare), be, x)
                change = sum(np.abs(_numpy(pat.outputs[o]) - _numpy(other[o])).reshape(m.upper.shape[0], -1).sum(axis=1)
                             for o in graph.outputs)
                for name, v in zip(_COMPARED, (m.lower, m.upper, m.shared * 1.0, m.flipped, m.upper * m.x_scale, m.bound,
                                               m.x_scale * (metric.upper if metric.same_signs else math.nan), change)):
                    cols[name].append(np.asarray(v, dtype=np.float64))
            bar.update(pat.batch)
    # (no sample: every column, empty)
    return Observations({k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}, glob)


def _input_dict(graph, batch, inputs) -> dict:
    """``as_input_dict`` of one batch; a list or tuple of single samples (each of an input's shape, no batch
    axis) is refused with the hint to stack them, as observe reads a list as batches."""
    try:
        return as_input_dict(graph, batch)
    except InputShapeError as err:
        if isinstance(inputs, (list, tuple)) and len(graph.inputs) == 1:
            if tuple(np.shape(batch)) == tuple(graph.node(graph.inputs[0]).shape):
                raise InputShapeError(f"{err}; observe reads a list as a sequence of batches, and this one holds "
                                      f"single samples: stack them into one array (np.stack(rows))") from None
        raise


#: the columns of ``observe(compare=...)``, in their order
_COMPARED = ("lower", "upper", "shared", "flipped", "local_estimate", "local_bound", "global_bound", "output_change")


def _observe_shards(cm, inputs, qs, counts, compare, batch_size, progress, backend, grp: Group) -> Observations:
    """Each rank walks its shard; the all-gathered rows are put back in data set order on every rank."""

    def run():
        _check_batch_size(batch_size)  # inside: an argument error reaches every rank, none waits for this one
        _check_inputs(graph_of(cm), inputs)
        local, rows, n = _local_shard(inputs, grp)
        obs = _walk(cm, local, qs, counts, compare, batch_size, _enabled(progress, grp.rank), backend, len(rows))
        if len(obs) != len(rows):
            raise ArgumentError(f"rank {grp.rank} walked {len(obs)} samples of its shard of {len(rows)}")
        return rows, n, obs.columns, obs.global_values, _fingerprint(inputs, n), _model_fingerprint(cm)

    parts = gather_or_raise(run, "pathir.observe")
    _check_agree(parts)
    rows = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in parts])
    first, keep = np.unique(rows, return_index=True)  # a DistributedSampler pads with repeated samples
    n = parts[0][1]
    if not np.array_equal(first, np.arange(n)):
        missing = np.setdiff1d(np.arange(n), first)
        raise ArgumentError(f"pathir.observe: the ranks' samples leave out {len(missing)} of the {n} samples "
                            f"(first {missing[:5].tolist()}; a DistributedSampler with drop_last=True?)")
    names = next((list(p[2]) for p in parts if p[2]), [])
    columns = {c: np.concatenate([np.asarray(p[2].get(c, ()), dtype=np.float64) for p in parts])[keep] for c in names}
    return Observations(columns, dict(parts[0][3]))


def _check_batch_size(batch_size) -> None:
    if batch_size is None:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ArgumentError(f"observe: batch_size must be a positive integer (or None: by the model's size), "
                            f"got {batch_size!r}")


def _fingerprint(inputs, n: int):
    """A few of the data set's samples summed (its first, middle and last), to tell two ranks that were given
    different data apart (already split per rank, the usual DDP habit, which pathir would split again);
    None where no sample can be read without walking a loader."""
    data = inputs if hasattr(inputs, "shape") else getattr(inputs, "dataset", None)
    if data is None or n == 0:
        return None
    picks = []
    for i in sorted({0, n // 2, n - 1}):
        try:
            x = data[i]
            x = x[0] if isinstance(x, (tuple, list)) else x
            x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
            picks.append(float(np.sum(np.asarray(x, dtype=np.float64))))
        except Exception:  # noqa: BLE001 - a data set that cannot be indexed or summed: no fingerprint
            return None
    return tuple(picks)


def _model_fingerprint(cm) -> tuple:
    """Per param, Σθ and Σθ_i·((i mod 13) − 6) in float64: equal on ranks that hold the same model (the same
    weights give the same sums, bit for bit), apart where one differs in signs or entries its path-norms and
    path count do not see (a layer negated)."""
    out = []
    for p in graph_of(cm).params():
        v = np.asarray(p.value, dtype=np.float64).reshape(-1)
        out += [float(v.sum()), float(v @ (np.arange(v.size) % 13 - 6.0))]
    return tuple(out)


def _check_agree(parts) -> None:
    """ArgumentError, on every rank alike, where the ranks were given different data or options: they must
    pass the same inputs (pathir splits them), q, counts, compare and the same model."""
    ref = parts[0]
    for rank, p in enumerate(parts[1:], start=1):
        checks = [("numbers of samples", ref[1], p[1]), ("samples (first, middle, last summed)", ref[4], p[4])]
        if ref[2] and p[2]:  # (a rank with no sample has no columns to compare)
            checks.append(("columns (q, counts or compare differ)", sorted(ref[2]), sorted(p[2])))
        for what, a, b in checks:
            if a != b:
                raise ArgumentError(f"pathir.observe: rank 0 and rank {rank} were given different {what}: {a} and {b}. "
                                    "Every rank passes the same inputs and options (pathir splits the samples "
                                    "itself; do not split them per rank first)")
        for k, v in ref[3].items():
            w = p[3].get(k)
            if w is None or not (v == w or abs(v - w) <= 1e-9 * max(abs(v), abs(w))):
                raise ArgumentError(f"pathir.observe: rank 0 and rank {rank} compiled different models ({k}: {v} and "
                                    f"{w}); every rank observes the same model")
        if ref[5] != p[5]:
            raise ArgumentError(f"pathir.observe: rank 0 and rank {rank} hold different weights (their params' sums "
                                "differ); every rank observes the same model")


def _local_shard(inputs, grp: Group):
    """(this rank's samples, their indices in the data set, the number of samples a single process walks)."""
    if isinstance(inputs, Mapping):
        n = _dict_length(inputs)
        part = shard(n, grp.rank, grp.size)
        return {k: v[part.start:part.stop] for k, v in inputs.items()}, np.arange(part.start, part.stop), n
    if hasattr(inputs, "shape"):
        part = shard(int(inputs.shape[0]), grp.rank, grp.size)
        return inputs[part.start:part.stop], np.arange(part.start, part.stop), int(inputs.shape[0])
    import torch.utils.data as tud  # lazy: torch is imported already when a process group exists

    if isinstance(inputs, tud.DataLoader) and not isinstance(inputs.dataset, tud.IterableDataset):
        sampler = getattr(inputs.batch_sampler, "sampler", None)
        if type(sampler) is tud.DistributedSampler and type(inputs.batch_sampler) is tud.BatchSampler:
            rows = np.fromiter(iter(sampler), dtype=np.int64)  # (its order is a function of seed and epoch: repeated)
            if inputs.drop_last and rows.size % inputs.batch_size:
                raise ArgumentError(
                    f"pathir.observe: the DataLoader's drop_last=True drops the last {rows.size % inputs.batch_size} "
                    f"samples of rank {grp.rank}'s share of its DistributedSampler (batches of {inputs.batch_size}), "
                    "samples from the middle of the data set that the table would leave out: use drop_last=False")
            return inputs, rows, len(sampler.dataset)
        if isinstance(sampler, tud.DistributedSampler) and type(inputs.batch_sampler) is tud.BatchSampler:
            raise ArgumentError(
                f"pathir.observe reads which samples a DistributedSampler gives each rank in a pass of its own, and "
                f"the loader then draws them again; a subclass ({type(sampler).__name__}) need not draw the same "
                "samples twice (a shuffle on the global generator does not), and rows would name other samples. Use "
                "torch.utils.data.DistributedSampler itself, or pass the data set in order (pathir shards it)")
        if isinstance(sampler, tud.SequentialSampler) and type(inputs.batch_sampler) is tud.BatchSampler:
            n = len(inputs.dataset)
            if inputs.drop_last:
                n -= n % inputs.batch_size
            part = shard(n, grp.rank, grp.size)
            loader = tud.DataLoader(tud.Subset(inputs.dataset, part), batch_size=inputs.batch_size,
                                    collate_fn=inputs.collate_fn, num_workers=inputs.num_workers,
                                    pin_memory=inputs.pin_memory, timeout=inputs.timeout,
                                    worker_init_fn=inputs.worker_init_fn)
            return loader, np.arange(part.start, part.stop), n
    if isinstance(inputs, tud.DataLoader) and inputs.batch_size is None:
        raise ArgumentError(
            f"pathir.observe under a process group of {grp.size} ranks splits a DataLoader by its samples; one with "
            "batch_size=None (its data set's items taken as they are) has none to split: give the samples with a "
            "batch_size, or the array")
    raise ArgumentError(
        f"pathir.observe under a process group of {grp.size} ranks splits an array, a tensor, or a DataLoader "
        f"over a map-style data set read in order (shuffle=False) or with a DistributedSampler; got "
        f"{type(inputs).__name__} (a shuffled loader, an iterable data set or a custom sampler has no order "
        "every rank agrees on)")


def _quantile(ordered: np.ndarray, q: float) -> float:
    """``np.quantile(ordered, q)`` (linear) of a sorted array without nan, where one infinite neighbour gives
    that infinity rather than nan (numpy forms -inf + t·(x − -inf)); nan between -inf and +inf and for an empty
    array."""
    if not ordered.size:
        return math.nan
    pos = q * (ordered.size - 1)
    lo, hi = float(ordered[int(math.floor(pos))]), float(ordered[int(math.ceil(pos))])
    if lo == hi:
        return lo
    if math.isinf(lo) and math.isinf(hi):  # (-inf, +inf): (1 − t)·lo + t·hi has no value
        return math.nan
    if math.isinf(lo) or math.isinf(hi):  # (1 − t)·lo + t·hi with 0 < t < 1 is that infinity
        return lo if math.isinf(lo) else hi
    return float(np.quantile(ordered, q))
