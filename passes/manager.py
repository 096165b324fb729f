"""The pass manager: run Graph -> Graph functions in order, verifying between them."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Callable, Iterable

import numpy as np

from pathir.analyses.facts import GraphFacts
from pathir.enorm.normalize import normalize
from pathir.errors import ArgumentError, ArgumentKeyError, ArgumentTypeError, GraphVerificationError, PassWroteInput, PathirError
from pathir.ir import Graph, Param, verify

from .fold_batchnorm import fold_batchnorm
from .maxpool_to_sum import maxpool_to_sum
from .path_view import path_view
from .remove_dead import remove_dead

__all__ = ["Pass", "PASSES", "run_passes", "run_recording", "DEFAULT_PIPELINE", "register", "pass_name",
           "param_fingerprint", "structure_fingerprint"]

Pass = Callable[[Graph], Graph]

#: Every built-in pass, by name (the registry users extend with their own).
PASSES: dict[str, Pass] = {
    "fold_batchnorm": fold_batchnorm,
    "maxpool_to_sum": maxpool_to_sum,
    "normalize": normalize,
    "path_view": path_view,
    "remove_dead": remove_dead,
}

#: What pathir.compile runs after lowering:
#:   fold_batchnorm  - inference batch-norms into the conv/linear before them (units = conv channels)
DEFAULT_PIPELINE: tuple[Pass, ...] = (fold_batchnorm,)


def _name(p: Pass) -> str:
    return getattr(p, "__name__", repr(p))


def register(name: str, fn: Pass, replace: bool = False) -> Pass:
    """Add a pass to ``PASSES`` so that it can be named wherever a pass is
    accepted (``run_passes``, ``pathir.compile(passes=...)``, ``cm.apply``).
    Returns ``fn``. A taken name is refused unless ``replace``."""
    if not callable(fn):
        raise ArgumentTypeError(f"pass '{name}' must be a function Graph -> Graph, got {type(fn).__name__}")
    if name in PASSES and PASSES[name] is not fn and not replace:
        raise ArgumentError(f"a pass named '{name}' is already registered ({_name(PASSES[name])}); pass replace=True")
    PASSES[name] = fn
    return fn


def _resolve(p) -> tuple[str, Pass]:
    """(name, function) of a pass given as a function or a registered name."""
    if isinstance(p, str):
        if p not in PASSES:
            raise ArgumentKeyError(f"no pass named '{p}'; registered: {sorted(PASSES)}")
        return p, PASSES[p]
    if not callable(p):
        raise ArgumentTypeError(f"a pass is a function Graph -> Graph or a registered name, got {type(p).__name__}")
    return _name(p), p


def pass_name(p) -> str:
    """The name of a pass given as a function or a registered name."""
    return _resolve(p)[0]


def param_fingerprint(graph: Graph) -> tuple:
    """Each param's name, shape and a digest of its bytes: equal for two graphs (or one graph before and
    after a pass that wrote it in place) exactly when their params are."""
    return _digests(graph)[0]


def _digests(graph: Graph, known: dict[int, bytes] | None = None) -> tuple[tuple, dict[int, bytes]]:
    """(``param_fingerprint(graph)``, each param's digest by ``id``); a param in ``known`` takes its digest from
    there, unread (the same object digested a moment before, with nothing run since)."""
    out, by_id = [], {}
    for p in sorted(graph.params(), key=lambda p: p.name):
        value = np.asarray(p.value)
        digest = (known or {}).get(id(p))
        if digest is None:
            flat = np.ascontiguousarray(value).view(np.uint8).reshape(-1)
            digest = hashlib.blake2b(flat, digest_size=16).digest()
        by_id[id(p)] = digest
        out.append((p.name, value.shape, digest))
    return tuple(out), by_id


def structure_fingerprint(graph: Graph) -> bytes:
    """A digest of what the graph computes apart from its param values: every node's kind, shape and k, its
    edges (sources, map types and every map attribute, fixed arrays included), its bias, each param's name
    and the model tensors it stands for (``Param.sources``), and the outputs. Node names are replaced by
    positions (a renaming keeps it); ``origin`` and a param's ``how`` (descriptions) are left out."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    h = hashlib.blake2b(digest_size=16)

    def feed(obj) -> None:
        if isinstance(obj, Param):
            h.update(repr(("param", obj.name, obj.sources)).encode())
        elif isinstance(obj, np.ndarray):
            h.update(repr(("array", obj.shape, obj.dtype.str)).encode())
            h.update(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).tobytes())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            h.update(type(obj).__qualname__.encode())
            for f in dataclasses.fields(obj):
                feed(f.name)
                feed(getattr(obj, f.name))
        elif isinstance(obj, (tuple, list)):
            h.update(b"(")
            for item in obj:
                feed(item)
            h.update(b")")
        elif isinstance(obj, (str, int, float, bool, enum.Enum)) or obj is None:
            h.update(repr(obj).encode())
        else:  # an attribute of a map of the user's own: its repr stands for it
            h.update(f"{type(obj).__qualname__}:{obj!r}".encode())

    for n in graph.nodes:
        feed((n.kind, n.shape, n.k, n.bias))
        for e in n.edges:
            feed(("edge", index.get(e.source, e.source), e.map))
    feed(("outputs", tuple(index.get(o, o) for o in graph.outputs)))
    return h.digest()


def run_recording(graph: Graph, passes: Iterable[Pass], check: bool = True,
                  after: Iterable[str] = ()) -> tuple[Graph, tuple[str, ...]]:
    """``run_passes`` one pass at a time, and the names of those that changed the params (values or shapes, by
    ``param_fingerprint``) or the graph around them (``structure_fingerprint``: a dropped edge, a new node): a
    result computed on their graph does not apply to the model's tensors. A pass that wrote into the graph it
    was given (``torch.as_tensor(p.value)`` shares a param's memory; an owner's write flag can be set again) is
    refused by name, returned or raised: ``PassWroteInput``, whose ``graph`` is that input, changed."""
    done, changed, passes = list(after), [], list(passes)
    prints = (structure_fingerprint(graph), param_fingerprint(graph)) if passes else None  # (no pass: no cost)
    for p in passes:
        name = pass_name(p)
        try:
            out = run_passes(graph, (p,), check=check, after=done, guard_input=False)
        except Exception as err:
            _refuse_written_input(graph, prints, name, done, err)
            raise
        kept = _refuse_written_input(graph, prints, name, done)
        done.append(name)
        # the params the pass returned as they were (the same objects) are not read again
        now = prints if out is graph else (structure_fingerprint(out), _digests(out, kept)[0])
        if now != prints:
            changed.append(name)
        graph, prints = out, now
    return graph, tuple(changed)


def _refuse_written_input(graph: Graph, prints: tuple, name: str, done: list[str],
                          raised: Exception | None = None) -> dict[int, bytes]:
    """PassWroteInput where ``graph`` no longer has the fingerprints ``prints`` it had before pass ``name`` ran; else
    its params' digests by id, as read now."""
    structure, (params, by_id) = structure_fingerprint(graph), _digests(graph)
    if (structure, params) == prints:
        return by_id
    written = [a[0] for a, b in zip(params, prints[1]) if a != b] if len(params) == len(prints[1]) else []
    what = f"params {', '.join(repr(n) for n in written[:5])}" if written else "its structure (a fixed map's array)"
    raised_too = f" (then it raised {type(raised).__name__}: {raised})" if raised is not None else ""
    err = PassWroteInput(f"in pass '{name}' after {done}: it wrote into the graph it was given, {what}{raised_too}. A "
                         "pass leaves its input as it was and returns a new graph: p.with_value(new) for a param "
                         "(torch.as_tensor(p.value) shares the param's memory, torch.tensor(p.value) copies it)")
    err.graph = graph
    raise err from raised


def _finite(value: np.ndarray) -> bool:
    """No NaN or infinite entry (read with no temporary array of ``value``'s size)."""
    return not value.size or bool(np.isfinite(value.min()) and np.isfinite(value.max()))


def _check_written_finite(before: Graph, after: Graph) -> None:
    """GraphVerificationError naming the first param a pass wrote (one ``before`` does not hold) with a NaN or
    infinite entry, unless the param of that name was already so before it (the model's own values, which the
    graph's own check names): no path-norm or rescaling is a number there, and the pass is the place to fix it."""
    kept = {id(p) for p in before.params()}
    for p in after.params():
        value = np.asarray(p.value)
        if id(p) in kept or _finite(value):
            continue
        given = [q for q in before.params() if not _finite(np.asarray(q.value))]
        if any(q.name == p.name for q in given):
            continue
        out = {q.name: q for q in after.params()}
        if given and not any(q.name in out and _finite(np.asarray(out[q.name].value)) for q in given):
            # the pass cleaned none of the non-finite params it was given, but carried them on (a batch-norm of
            # var + eps = 0 folded into the layer before it): the model's own values are the cause, named as the
            # graph's own check names them, beside what the pass wrote
            try:
                GraphFacts(before).check_finite()
            except PathirError as err:
                err.add_note(f"the pass wrote {int((~np.isfinite(value)).sum())} NaN or infinite entries into param "
                             f"'{p.name}' (from {p.source_name}): from those values, or of its own")
                raise
        bad = ~np.isfinite(value)
        k = int(np.flatnonzero(bad.reshape(-1))[0])
        also = f"; the graph it was given held non-finite entries in {', '.join(repr(q.name) for q in given[:3])}" \
            if given else ""
        raise GraphVerificationError(f"it wrote {int(bad.sum())} NaN or infinite entries into param '{p.name}' "
                                     f"(from {p.source_name}; the first: {value.reshape(-1)[k]} at flat index {k}){also}")


def run_passes(graph: Graph, passes: Iterable[Pass], check: bool = True, after: Iterable[str] = (),
               guard_input: bool = True) -> Graph:
    """Apply each pass (a function, or a name registered in ``PASSES``) in
    order; with ``check``, verify after each one. Every failure names the pass
    and those before it: "in pass 'X' after ['fold_batchnorm']" (``after``: the
    names of passes already run on ``graph``, by an earlier call). With
    ``guard_input``, a pass that wrote into the graph it was given is refused
    (``PassWroteInput``: a digest of the graph before and after it, about a
    second per GB of params); pathir's own pipeline, whose in-place folds own
    their graph, runs without."""
    done: list[str] = list(after)
    for p in passes:
        name, fn = _resolve(p)
        prints = (structure_fingerprint(graph), param_fingerprint(graph)) if guard_input else None
        try:
            out = fn(graph)
        except Exception as err:
            if guard_input:
                _refuse_written_input(graph, prints, name, done, err)
            if hasattr(err, "add_note"):  # Python >= 3.11: keep the error's type, add where
                err.add_note(f"in pass '{name}' after {done}")
            raise
        if guard_input:
            _refuse_written_input(graph, prints, name, done)
        if not isinstance(out, Graph):
            raise ArgumentTypeError(f"in pass '{name}' after {done}: returned {type(out).__name__}, not a Graph")
        if check:
            try:
                verify(out)
                _check_written_finite(graph, out)
            except GraphVerificationError as err:
                raise GraphVerificationError(f"in pass '{name}' after {done}: {err}") from None
            except PathirError as err:  # the model's own non-finite values, met where the pass wrote non-finite ones
                err.add_note(f"in pass '{name}' after {done}")
                raise
        done.append(name)
        graph = out
    return graph
