"""pathir.compile: the one entry point from a model to a Compiled object."""

from __future__ import annotations

import functools
import os
from typing import Sequence

from pathir.compiled import Compiled
from pathir.errors import ArgumentError, InputShapeError, ModelChanged, PathirError
from pathir.frontends.core.write_rules import clip_threshold_names
from pathir.frontends.onnx import lower as lower_onnx
from pathir.frontends.onnx.writer import WriterWatch
from pathir.ir import Graph, verify
from pathir.ir.inputs import graph_inputs
from pathir.passes import DEFAULT_PIPELINE, run_passes
from pathir.passes.fold_batchnorm import pooled_folds
from pathir.passes.manager import pass_name, run_recording
from pathir.support.model_state import keeps_model, kept
from pathir.support.progress import Phases
from pathir.support.threads import on_one_blas_thread

__all__ = ["compile", "equalize"]


def _is_onnx(model) -> bool:
    if isinstance(model, (str, bytes, bytearray, os.PathLike)):
        return True
    return type(model).__name__ == "ModelProto"


@keeps_model
@on_one_blas_thread
def compile(model, input_shape: Sequence[int] | None = None, example_input=None, passes: Sequence = (),
            backend=None, check: bool = True, self_check: bool = True, progress: bool | None = None) -> Compiled:
    """Lower ``model`` to the pathir IR and run the compile pipeline.

    Parameters
    ----------
    model : torch.nn.Module, onnx.ModelProto, path or bytes of an .onnx file, or Graph
    input_shape : shape of one input without the batch dimension, e.g. ``(3, 224, 224)``
    example_input : a batched example tensor (alternative to ``input_shape``)
    passes : extra ``Graph -> Graph`` passes run after the default pipeline
    backend : default backend of the result ("torch", "numpy")
    check : verify the graph after every pass
    self_check : run the IR's forward and the model's own forward once each on a seeded
        random batch and raise ``SelfCheckFailed`` if they differ (beyond a tolerance fitted
        to the model's dtype); see docs/capture.md. ``False`` skips it.
    progress : a bar on stderr over the phases lower, passes, self-check (``pathir.support.progress``;
        None: only when stderr is a terminal).

    The model is never modified: a refused call puts back everything its forward wrote
    (pathir.support.model_state, docs/capture.md).

    >>> import torch, pathir
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    >>> cm = pathir.compile(net, input_shape=(4,))
    >>> round(cm.num_paths())   # 4*3*2 input paths + 3*2 bias paths from the hidden layer + 2
    32
    """

    bar = Phases(("lower", "passes", "self-check") if self_check else ("lower", "passes"), desc="compile",
                 progress=progress)
    bar.phase("lower")
    watch = relower = None

    def passes_again(graph: Graph, before) -> Graph:
        """The user's passes on the model's values read again; refused where one changes the graph and none did at
        compile (compile's ``transformed_by``, set below before any re-read): the results and write-backs would no
        longer be the model's."""
        if not passes:
            return graph
        graph, changed = run_recording(graph, passes, check=False, after=[pass_name(p) for p in before])
        if changed and not transformed_by:  # (a Compiled already transformed answers for its passes' graph)
            raise ModelChanged(f"{name}: pass {', '.join(repr(n) for n in changed)} changed the graph read from the model's "
                               "current values, where at compile it changed nothing: the Compiled's results and "
                               "write-backs would no longer be the model's; compile it again")
        return graph

    kind = "graph" if isinstance(model, Graph) else "onnx" if _is_onnx(model) else "torch"
    if kind == "graph":
        graph, writer, n_src, name = verify(model), None, None, model.name
    elif kind == "onnx":
        low = lower_onnx(model, input_shape=input_shape)
        graph, writer, n_src, name = low.graph, low.writer, low.source_num_params, low.name
        watch = WriterWatch(writer)

        def read_written() -> Graph:
            """The model the writer holds now (its tensors as written, in their dtype), lowered again."""
            raw = lower_onnx(writer.to_onnx(), input_shape=input_shape).graph
            return passes_again(run_passes(raw, DEFAULT_PIPELINE, check=False, guard_input=False), DEFAULT_PIPELINE)
    else:
        from pathir.frontends.torch.live import ModelWatch  # lazy: imports torch
        from pathir.frontends.torch.lower import lower  # lazy: imports torch

        low = lower(model, input_shape=input_shape, example_input=example_input)
        graph, writer, n_src, name = low.graph, low.writer, low.source_num_params, low.name
        watch = ModelWatch(model)

        reread = low.reread
        folds = pooled_folds(DEFAULT_PIPELINE, in_place=True)  # each raw graph is handed over

        def relower(moved: set[str] | None = None) -> Graph:
            """The model's current values in the same pipeline: re-read without tracing when only
            recipe inputs ``moved`` (docs/live.md), else lowered again (and later re-reads start from that
            lowering: its fixed maps hold the buffers as they are now, not as at compile)."""
            nonlocal reread
            raw = reread.graph(model) if reread is not None and reread.covers(moved) else None
            if raw is None:
                with kept(model):  # tracing runs the forward: a refusal leaves the model as it was
                    again = lower(model, input_shape=input_shape, example_input=example_input,
                                  heads=bool(writer.train_paths))  # the outputs it was compiled with
                raw, reread = again.graph, again.reread
            return passes_again(run_passes(raw, folds, check=False, guard_input=False), folds)

        relower.covers = lambda moved: reread is not None and reread.covers(moved)  # a re-read without tracing
        # cm.release(): the memory of earlier values the pool keeps for the next re-read
        relower.drop_free = lambda: reread is not None and reread.pool is not None and reread.pool.drop_free()

    bar.phase("passes")
    # the torch lowering's raw graph is read by nothing after the default passes: batch-norms fold into
    # its own memory (never in a user pass's graph, which the pass may keep)
    default = pooled_folds(DEFAULT_PIPELINE, in_place=kind == "torch")
    graph = run_passes(graph, default, check=check, guard_input=False)  # (the folds may write in place: their own)
    # one at a time: the write-back follows the model only through params a pass kept
    graph, transformed_by = run_recording(graph, passes, check=check, after=[pass_name(p) for p in default])
    cm = Compiled(graph, model=model, writer=writer, source_num_params=n_src, backend=backend, name=name,
                  watch=watch, relower=relower, read_written=read_written if kind == "onnx" else None)
    cm.transformed_by = transformed_by
    cm.passes_run = tuple(pass_name(p) for p in passes)
    # copy.copy / copy.deepcopy of cm compile the (copied) model again, as here (its function is this one's)
    cm._recompile = functools.partial(compile, input_shape=input_shape, example_input=example_input, passes=passes,
                                      backend=backend, check=check, self_check=False, progress=False)
    if self_check:
        from pathir.self_check import self_check as run_self_check  # lazy: imports torch

        bar.phase("self-check")
        with cm.looking_once():  # its queries read one graph: the model is compared with it once
            run_self_check(cm, model, kind)
    bar.close()
    return cm


def equalize(model, input_shape: Sequence[int] | None = None, example_input=None, bits: int = 8,
             objective: str = "noise", inputs=None, relu6: str = "clip", progress: bool | None = None, **kwargs):
    """Compile ``model`` and equalize it for quantization in place (``Compiled.equalize``): the one-call
    form. Returns the EqualizeReport; ``kwargs`` go to ``Compiled.equalize`` (``max_log_scale``,
    ``optimizer``, ...). ``relu6``: "clip" keeps clipped ReLUs exact (a moved one is written back as a
    per-channel ``pathir.nn.ClippedReLU``); "relu" replaces each clipped ReLU module by a ReLU first, as
    AIMET and Quark do, which changes the function (the report's notes say by how much). See docs/equalize.md.

    >>> import torch, pathir
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> with torch.no_grad():
    ...     _ = net[0].weight.mul_(torch.logspace(-2, 1, 8).reshape(8, 1))  # rows over three decades
    >>> x = torch.randn(16, 4)
    >>> before = net(x)
    >>> report = pathir.equalize(net, input_shape=(4,), bits=6)
    >>> report.tensors[0].spread_after < report.tensors[0].spread_before
    True
    >>> bool(torch.allclose(net(x), before, atol=1e-5))
    True
    """
    if relu6 not in ("clip", "relu"):
        raise ArgumentError(f"relu6 must be 'clip' (keep clipped ReLUs, write per-channel thresholds) or 'relu' "
                            f"(replace them by ReLU first), got {relu6!r}")
    if _is_onnx(model) and kwargs.get("write_back", True):
        raise ArgumentError("pathir.equalize rescales a torch model in place; an ONNX model is never changed in place: "
                            "cm = pathir.compile(model); cm.equalize(...); cm.save('equalized.onnx') (or the command "
                            "line: pathir equalize model.onnx -o equalized.onnx)")
    if relu6 == "relu" and not hasattr(model, "named_modules"):
        raise ArgumentError("relu6='relu' replaces clipped ReLU modules of a torch model; this model has none to "
                            "replace (an ONNX Clip or a Graph keeps relu6='clip')")
    if relu6 == "clip" or _is_onnx(model) or isinstance(model, Graph):
        cm = compile(model, input_shape=input_shape, example_input=example_input, progress=progress)
        return cm.equalize(bits=bits, objective=objective, inputs=inputs, progress=progress,
                           **kwargs)
    return _equalize_with_relus(model, input_shape, example_input, bits, objective, inputs, progress, kwargs)


def _equalize_with_relus(model, input_shape, example_input, bits, objective, inputs, progress, kwargs):
    """relu6="relu": every clipped ReLU module becomes a ReLU (the function changes; the report says by
    how much on ``inputs``, or on a seeded random batch), then equalize. ``inputs`` take every form
    ``relu6="clip"`` takes (:func:`pathir.ir.inputs.graph_inputs`). On any error, and with ``write_back=False``, the
    modules are put back; either way every module keeps its train/eval flag."""
    import torch  # lazy: imports torch

    from pathir.frontends.torch.clipped import measure_swap, relu_swap  # lazy: imports torch
    from pathir.frontends.torch.inputs import model_dtype_device  # lazy: imports torch

    paths, swap = relu_swap(model)
    swap.apply()
    try:
        try:
            cm = compile(model, input_shape=input_shape, example_input=example_input, progress=progress)
        except InputShapeError as err:  # the model's own forward failed: the shape's fault, or the swap's?
            swap.undo()
            compile(model, input_shape=input_shape, example_input=example_input, progress=False)  # raises if the shape's
            cause = err.__cause__ or err.__context__
            why = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
            raise PathirError(f"relu6='relu': with its clipped ReLUs ({', '.join(paths)}) replaced by ReLU the model no "
                              f"longer runs ({why}): its forward or a hook "
                              "reads what only the clipped ReLU has (max_val, min_val, ...). Equalize with "
                              "relu6='clip', or remove that dependence. The model is untouched") from None
        left = clip_threshold_names(cm.graph)
        if left:  # (a functional call, a module the forward reaches outside the module tree: nothing to replace)
            raise PathirError(f"relu6='relu': the clipped ReLU(s) {', '.join(left)} are no registered nn.ReLU6 or "
                              "nn.Hardtanh module it can replace by a ReLU (a functional call such as F.relu6 or "
                              "clamp, a subclass of nn.ReLU6 or nn.Hardtanh, which torch.fx traces through to its "
                              "call, or a module the forward reaches outside the module tree). Use a registered "
                              "nn.ReLU6 or nn.Hardtanh there, or equalize with relu6='clip', which holds them where "
                              "they are. The model is untouched")
        feed = graph_inputs(cm.graph, inputs)
        dtype, device = model_dtype_device(model)
        if feed is not None:
            probe = [torch.from_numpy(feed[n]) for n in cm.graph.inputs]
        else:
            seeded = torch.Generator().manual_seed(0)
            probe = [torch.randn((8, *cm.graph.node(n).shape), generator=seeded) for n in cm.graph.inputs]
        change, rel = measure_swap(model, swap, tuple(x.to(dtype=dtype, device=device) for x in probe))
        report = cm.equalize(bits=bits, objective=objective, inputs=feed, progress=progress, **kwargs)
    except BaseException:
        swap.undo()
        raise
    if not kwargs.get("write_back", True):  # nothing written: the clipped ReLUs stay too
        swap.undo()
    on = "the inputs" if inputs is not None else "a seeded batch of 8 N(0, 1) inputs only (inputs= measures on yours)"
    done = "" if report.written else " for the solve (write_back=False: put back, the model is untouched)"
    report.notes.append(f"relu6='relu': {len(paths)} clipped ReLUs replaced by ReLU{done}; the function changed by "
                        f"at most {change:.4g} ({rel:.3g} of the largest output) on {on}")
    report.relu_change = rel
    return report
