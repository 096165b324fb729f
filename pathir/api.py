"""pathir.compile: the one entry point from a model to a Compiled object."""

from __future__ import annotations

import os
from typing import Sequence

from pathir.compiled import Compiled
from pathir.errors import ArgumentError
from pathir.frontends.onnx import lower as lower_onnx
from pathir.ir import Graph, verify
from pathir.passes import DEFAULT_PIPELINE, run_passes
from pathir.passes.fold_batchnorm import pooled_folds
from pathir.support.model_state import keeps_model, kept
from pathir.support.progress import Phases

__all__ = ["compile", "equalize"]


def _is_onnx(model) -> bool:
    if isinstance(model, (str, bytes, bytearray, os.PathLike)):
        return True
    return type(model).__name__ == "ModelProto"


@keeps_model
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
    kind = "graph" if isinstance(model, Graph) else "onnx" if _is_onnx(model) else "torch"
    if kind == "graph":
        graph, writer, n_src, name = verify(model), None, None, model.name
    elif kind == "onnx":
        low = lower_onnx(model, input_shape=input_shape)
        graph, writer, n_src, name = low.graph, low.writer, low.source_num_params, low.name
    else:
        from pathir.frontends.torch.live import ModelWatch  # lazy: imports torch
        from pathir.frontends.torch.lower import lower  # lazy: imports torch

        low = lower(model, input_shape=input_shape, example_input=example_input)
        graph, writer, n_src, name = low.graph, low.writer, low.source_num_params, low.name
        watch = ModelWatch(model)

        reread = low.reread
        pipeline = (*pooled_folds(DEFAULT_PIPELINE, in_place=True), *passes)  # each raw graph is handed over

        def relower(moved: set[str] | None = None) -> Graph:
            """The model's current values in the same pipeline: re-read without tracing when only
            recipe inputs ``moved`` (docs/live.md), else lowered again."""
            raw = reread.graph(model) if reread is not None and reread.covers(moved) else None
            if raw is None:
                with kept(model):  # tracing runs the forward: a refusal leaves the model as it was
                    raw = lower(model, input_shape=input_shape, example_input=example_input,
                                heads=bool(writer.train_paths)).graph  # the outputs it was compiled with
            return run_passes(raw, pipeline, check=False)

        relower.covers = lambda moved: reread is not None and reread.covers(moved)  # a re-read without tracing

    bar.phase("passes")
    # the torch lowering's raw graph is read by nothing after the default passes: batch-norms fold into
    # its own memory (never in a user pass's graph, which the pass may keep)
    graph = run_passes(graph, (*pooled_folds(DEFAULT_PIPELINE, in_place=kind == "torch"), *passes), check=check)
    cm = Compiled(graph, model=model, writer=writer, source_num_params=n_src, backend=backend, name=name,
                  watch=watch, relower=relower)
    if self_check:
        from pathir.self_check import self_check as run_self_check  # lazy: imports torch

        bar.phase("self-check")
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
    if relu6 == "clip" or _is_onnx(model) or isinstance(model, Graph):
        cm = compile(model, input_shape=input_shape, example_input=example_input, progress=progress)
        return cm.equalize(bits=bits, objective=objective, inputs=inputs, progress=progress, **kwargs)
    return _equalize_with_relus(model, input_shape, example_input, bits, objective, inputs, progress, kwargs)


def _equalize_with_relus(model, input_shape, example_input, bits, objective, inputs, progress, kwargs):
    """relu6="relu": every clipped ReLU module becomes a ReLU (the function changes; the report says by
    how much on ``inputs``, or on a seeded random batch), then equalize; on any error the modules are put back."""
    import torch  # lazy: imports torch

    from pathir.frontends.torch.clipped import clipped_to_relu  # lazy: imports torch

    modules = dict(model.named_modules())
    if inputs is not None:
        probe = torch.as_tensor(inputs)
    else:
        shape = tuple(example_input.shape[1:]) if example_input is not None else tuple(input_shape)
        probe = torch.randn((8, *shape), generator=torch.Generator().manual_seed(0))
    dtype = next((t.dtype for t in model.parameters()), torch.float32)
    swap = clipped_to_relu(model, probe.to(dtype))
    try:
        cm = compile(model, input_shape=input_shape, example_input=example_input, progress=progress)
        report = cm.equalize(bits=bits, objective=objective, inputs=inputs, progress=progress, **kwargs)
    except BaseException:
        for path in swap.replaced:
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, modules[path])
        raise
    report.notes.append(f"relu6='relu': {len(swap.replaced)} clipped ReLUs replaced by ReLU; the function changed by "
                        f"at most {swap.max_abs_change:.4g} ({swap.max_rel_change:.3g} of the largest output) on "
                        f"{'the inputs' if inputs is not None else 'a random batch'}")
    report.relu_change = swap.max_rel_change
    return report
