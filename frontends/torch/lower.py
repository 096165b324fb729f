"""The torch frontend: nn.Module -> Graph via torch.fx (torch.export as fallback).

The traced program is interpreted once: activation tensors become pending
Values (core/values.py), each op is lowered by its rule in the op table (table.py), shape
arithmetic (``x.size(0)``, ``x.shape``) is evaluated on concrete sizes, and any
other op that touches an activation raises ``UnsupportedOperation`` naming the
fx node, its op, the module path it came from and why it breaks the rescaling
symmetry. Batch-norm uses its running statistics and dropout is the identity
(inference semantics), whatever mode the model is in. A model in train mode whose
train-mode forward returns heads the eval forward does not (aux classifiers) is lowered
in its heads forward (train_branches.head_modes): every head an output.

The user's model is never modified: tracing flips no flag for good (the
training flags are restored), and no tensor is written.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.fx
import torch.nn as nn

from pathir.errors import PathirError, UnsupportedOperation
from pathir.frontends.core.lowered import Lowered
from pathir.frontends.torch import capture_checks
from pathir.frontends.torch import inputs as torch_inputs
from pathir.frontends.torch.clipped import pin_unwritable
from pathir.frontends.torch.export import FX_FAILED, lower_exported
from pathir.frontends.torch.interpreter import FxInterpreter
from pathir.frontends.torch.reread import Reread
from pathir.frontends.torch.train_branches import head_modes, runs_heads, train_only_modules
from pathir.frontends.torch.writer import TorchWriter

__all__ = ["lower", "trace"]

# ---------------------------------------------------------------- tracing


def trace(model: nn.Module, n_inputs: int | None = None) -> torch.fx.Graph:
    """torch.fx symbolic trace with torch.nn modules as leaves; ``a += b`` is
    recorded as the in-place ``operator.iadd`` (capture_checks.InplaceTracer); the forward's
    arguments after the first ``n_inputs`` traced as their defaults."""
    return capture_checks.trace(model, n_inputs)


def lower(model: nn.Module, input_shape=None, example_input=None, heads: bool | None = None) -> Lowered:
    """Lower ``model`` to a raw Graph (batch-norms not yet folded). A model whose train-mode forward
    runs heads its eval forward does not (aux classifiers) is lowered in its heads forward, every
    head an output, when ``heads`` (None: when its forward, each module's flag as it stands, uses a
    head); otherwise, or when the heads forward cannot be lowered (warned), the eval graph's
    write-back is refused naming them."""
    if not isinstance(model, nn.Module):
        raise PathirError(f"expected a torch.nn.Module, got {type(model).__name__}")
    shapes = torch_inputs.input_shapes(input_shape, example_input)
    torch_inputs.check_model(model)
    torch_inputs.warn_train_batchnorm(model)
    stale = capture_checks.check_hooks(model)
    name = type(model).__name__
    with torch_inputs.eval_forward(model), capture_checks.fresh_hook_tensors(stale), capture_checks.state_kept(model):
        try:
            graph, low, clips = _lower_graph(model, shapes, name)
        except Exception as err:
            torch_inputs.explain(model, shapes, err)
            raise
    train_only, train, why_not = train_only_modules(model, graph, shapes), [], ""
    if train_only and (_runs_heads(model, train_only, shapes) if heads is None else heads):
        try:
            train = head_modes(train_only)
            with torch_inputs.eval_forward(model, train), capture_checks.fresh_hook_tensors(stale), \
                    capture_checks.state_kept(model):
                graph, low, clips = _lower_graph(model, shapes, name)
            train_only = train_only_modules(model, graph, shapes)
        except Exception as err:  # the eval graph stays, its write-back refused naming the heads and why
            train, why_not = [], f"{type(err).__name__}: {err}"
            warnings.warn(f"{name}: the heads {', '.join(train_only)} that run only in train mode could not be "
                          f"lowered as extra outputs ({why_not}); pathir analyses the eval forward and refuses "
                          "a rescaling write-back", UserWarning, stacklevel=4)
    graph = pin_unwritable(model, graph, clips)  # thresholds no write-back moves: no unit
    n_params = sum(p.numel() for p in model.parameters())
    reread = None if low is None else Reread.of(model, graph, low.recipes, low.read, low.direct_reads, low.arrays)
    writer = TorchWriter(model, train_only=train_only, clips=clips, train_paths=train, why_not=why_not)
    return Lowered(graph, writer, n_params, name, reread)


def _runs_heads(model: nn.Module, train_only: list[str], shapes) -> bool:
    """Whether the forward as the flags stand runs the train-only heads (a root in train mode around a module in
    eval mode does not); where no trace can tell, the train flag of the module under the root wrappers."""
    runs = runs_heads(model, train_only, shapes)
    return _innermost(model).training if runs is None else runs


def _innermost(model: nn.Module) -> nn.Module:
    """The module whose forward runs under the root wrappers (``torch.compile``, ``nn.DataParallel``): its
    training flag, not a wrapper's, is the mode the model runs in."""
    inner, _ = capture_checks.root_wrapped(model)
    return model if inner is model else _innermost(inner)


def _lower_graph(model, shapes, name):
    """(raw graph, the fx lowering or None, the clipped ReLUs' threshold sites)."""
    with _parametrize_cache_kept():
        return _lower_graph_here(model, shapes, name)


@contextlib.contextmanager
def _parametrize_cache_kept():
    """Inside ``torch.nn.utils.parametrize.cached()``, the entries a trace adds to its cache (fx's proxies of a
    parametrized attribute read in the forward) are dropped after it: the user's next forward computes them again."""
    cache = getattr(torch.nn.utils.parametrize, "_cache", None)
    before = set(cache) if isinstance(cache, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for key in [k for k in cache if k not in before]:
                del cache[key]


def _lower_graph_here(model, shapes, name):
    clips: dict = {}
    try:
        n_inputs = 1 if shapes and not isinstance(shapes[0], (tuple, list)) else len(shapes)
        traced = trace(model, n_inputs)
    except PathirError:
        raise
    except Exception as fx_error:  # whatever fx's proxies raise (len() of a Proxy is a RuntimeError): torch.export
        return _lower_exported(model, shapes, name, fx_error, clips), None, clips
    try:
        interpreter = FxInterpreter(model, traced, name)
        return interpreter.run(shapes), interpreter.low, interpreter.low.clips
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError, capture_checks.WriteThroughView,
            capture_checks.ReadsWhatItWrites) as fx_error:
        # (a write reading another view of its base: fx cannot tell which elements; the export path's eager run can)
        if isinstance(fx_error, UnsupportedOperation) and \
                not isinstance(fx_error, (capture_checks.WriteThroughView, capture_checks.ReadsWhatItWrites)):
            raise
        return _lower_exported(model, shapes, name, fx_error, clips), None, clips  # no re-read record: re-lowered


# ---------------------------------------------------------------- torch.export


def _lower_exported(model, shape, name, fx_error, clips):
    """Fallback for models torch.fx cannot trace: interpret the exported ATen graph."""
    try:
        program_made = []
        return lower_exported(model, shape, name, clips, made=program_made)
    except UnsupportedOperation as err:
        said = str(fx_error).strip().splitlines()
        if FX_FAILED in err.why and said and "Proxy" not in said[0]:  # say why fx failed (unless in its internals)
            raise UnsupportedOperation(err.node, err.op, err.where, err.why.replace(
                FX_FAILED, f"({type(fx_error).__name__}: {said[0][:200]})")) from None
        raise
    except Exception as err:
        if type(err).__name__ == "GuardOnDataDependentSymNode":  # (torch.fx.experimental.symbolic_shapes)
            raise PathirError(
                f"could not trace {name}: torch.export found a size or a branch that depends on the values of a tensor "
                "(if h.sum() > 0, h.item(), an assert on values; or a boolean mask's count, x[:, mask], read by an op "
                "that needs its size before it runs), so it is not one graph for every input: pathir analyses forwards "
                "whose ops and branches do not depend on the data (index by a constant index tensor instead of a "
                f"mask; torch.fx: {type(fx_error).__name__}: {fx_error})") from None
        if program_made:  # torch.export succeeded: pathir's reading of its graph failed
            raise PathirError(
                f"could not lower {name}: torch.fx failed ({type(fx_error).__name__}: {fx_error}), and pathir could "
                f"not read torch.export's graph of it ({type(err).__name__}: {err}); please report it") from err
        if isinstance(fx_error, capture_checks.WriteThroughView):
            raise UnsupportedOperation(fx_error.node, fx_error.op, fx_error.where, (
                f"{fx_error.why}; torch.export, whose functionalized graph would give the eager semantics, "
                f"failed ({type(err).__name__}: {err})")) from err
        raise PathirError(
            f"could not trace {name}: torch.fx failed ({type(fx_error).__name__}: {fx_error}); "
            f"torch.export failed too ({type(err).__name__}: {err})"
        ) from err
