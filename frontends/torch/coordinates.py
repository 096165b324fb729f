"""The compiled graph's params as torch functions of the model's own tensors.

A torch model's graph param is its source tensor (in the param's layout), or, for a folded
batch-norm (docs/math.md; ``passes/fold_batchnorm.py``), a product of them:

- a weight folded with the batch-norm after it: W' = W · c per output channel, c = γ/√(var + eps);
- the bias of a folded batch-norm: b' = β − μc + c · (the biases of the layers folded into it);
- an unfolded batch-norm scale: c; a clipped ReLU's threshold: −t (a buffer or a constant).

``Coordinates`` builds one torch function per param (``ParamRecipe``), checks at construction that
they rebuild the compiled graph, and evaluates them on detached copies (Path-SGD's diag G pulled
back to the model's coordinates) or on the live tensors, with autograd (the differentiable
path-norm, ``pathir.frontends.torch.differentiable``). Each entry of a param depends on at most
one entry of each tensor it reads. A pruned parameter (``torch.nn.utils.prune``) is read through
its ``weight_orig``, its mask a constant factor.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import numpy as np
import torch

from pathir.errors import PathirError, PathNormOverflow
from pathir.ir import Graph, Param, Role

__all__ = ["tensor_names", "layout", "Leaf", "float64_copy", "narrowed", "ParamRecipe", "graph_recipes", "Coordinates", "value_ref", "batchnorm_of",
           "is_threshold"]


def tensor_names(model: torch.nn.Module) -> tuple[set, set]:
    """(parameter names, buffer names) of ``model``, every name a tensor is reachable by: a parameter
    shared by two modules (tied weights) is named by both, as the lowering names its uses."""
    return ({n for n, _ in model.named_parameters(remove_duplicate=False)},
            {n for n, _ in model.named_buffers(remove_duplicate=False)})


def layout(model: torch.nn.Module) -> tuple:
    """What the recipes and leaves are resolved against: every module (path, identity) and every
    parameter and buffer name, duplicates included. Values moving leave it as it is; pruning's
    reparametrization (weight → weight_orig, weight_mask) or a replaced module changes it."""
    modules = tuple((n, id(m)) for n, m in model.named_modules(remove_duplicate=False))
    params, buffers = tensor_names(model)
    return modules, tuple(sorted(params)), tuple(sorted(buffers))


def _parametrized(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is a tensor attribute that a torch.nn.utils.parametrize parametrization computes."""
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    return torch.nn.utils.parametrize.is_parametrized(module, attr)


class Leaf:
    """A model tensor by source name: the parameter to step (or None for a
    buffer), the tensor to read (float64), a constant mask (pruned) or None.
    ``names``: ``tensor_names(model)``, if already read."""

    def __init__(self, model: torch.nn.Module, name: str, names: tuple[set, set] | None = None):
        params, buffers = tensor_names(model) if names is None else names
        self.name, self.mask, self.computed = name, None, False
        if name in params:
            self.param_name = name
        elif name + "_orig" in params and name + "_mask" in buffers:
            self.param_name, self.mask = name + "_orig", name + "_mask"
        elif name in buffers:
            self.param_name = None
        elif _parametrized(model, name):  # weight_norm, orthogonal, ...: read through the parametrization
            self.param_name, self.computed = None, True
        else:
            raise PathirError(f"source tensor '{name}' is neither a parameter, a buffer nor a parametrization's output "
                              "of the model: a plain tensor attribute (register it as an nn.Parameter), or one a "
                              "forward pre-hook sets (the legacy torch.nn.utils.weight_norm does: use "
                              "torch.nn.utils.parametrizations.weight_norm instead), is not followed between forwards")

    def read(self, model: torch.nn.Module, live: bool = False) -> torch.Tensor:
        """The tensor in float64: detached, or ``live`` (autograd reaches the model's parameter, through
        its parametrization for a parametrized tensor)."""
        if self.computed:
            path, _, attr = self.name.rpartition(".")
            module = model.get_submodule(path)
            with _evaluating(module.parametrizations[attr]):
                t = getattr(module, attr)
        else:
            t = model.get_parameter(self.param_name) if self.param_name else model.get_buffer(self.name)
        mask = model.get_buffer(self.mask) if self.mask else None
        if not live or not (self.param_name or self.computed):
            # a buffer's own copy (no gradient reaches it): a train-mode batch norm updates its running statistics
            # in place without bumping their version, which a backward reading them by reference would then see
            return float64_copy(t, mask)
        if t.dtype != torch.float64:
            t = _Widened.apply(t, self.name)
        return t * mask.to(torch.float64, copy=True) if self.mask else t

    def watched(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The model's parameters this tensor is read from: its own, or its parametrization's."""
        if self.computed:
            path, _, attr = self.name.rpartition(".")
            return list(model.get_submodule(path).parametrizations[attr].parameters())
        return [model.get_parameter(self.param_name)] if self.param_name else []


def float64_copy(t: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (times a pruning ``mask``) as a float64 tensor of its own, detached, on its device."""
    t = t.detach().to(torch.float64, copy=True)
    return t * mask.to(torch.float64) if mask is not None else t


class _Widened(torch.autograd.Function):
    """``t`` in float64; the backward casts the float64 gradient to t's dtype, and refuses one that dtype cannot
    hold (a finite derivative that would become inf: a float16 weight's beyond 65504) rather than give inf."""

    @staticmethod
    def forward(ctx, t, name):
        ctx.dtype, ctx.name = t.dtype, name
        return t.to(torch.float64)

    @staticmethod
    def backward(ctx, grad):
        return narrowed(grad, ctx.dtype, ctx.name), None


def narrowed(grad: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A float64 gradient by tensor ``name`` cast to its ``dtype``; PathNormOverflow where a finite entry
    would become inf."""
    out = grad.to(dtype)
    if dtype != torch.float64 and bool((torch.isinf(out) & torch.isfinite(grad)).any()):
        raise PathNormOverflow(
            f"the path-norm's derivative by '{name}' reaches about {float(grad.abs().max()):.3g}, beyond "
            f"{str(dtype).replace('torch.', '')}'s largest number {torch.finfo(dtype).max:.3g}: its "
            "gradient cannot be stored in the parameter's dtype: weigh the penalty down (λ · penalty, applied "
            "in float64 before the cast), train in float32 or float64, or rescale the layers")
    return out


@contextlib.contextmanager
def _evaluating(parametrizations: torch.nn.Module):
    """The parametrization modules in eval mode meanwhile, as pathir captures the model: a train-mode
    spectral_norm would take a power-iteration step, writing its _u and _v, at each read."""
    modes = [(m, m.training) for m in parametrizations.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class ParamRecipe:
    """One graph param as a torch function of model tensors: ``fn({name: tensor})``,
    each entry of the result depending on at most one entry of each tensor. ``source``: the
    ``SourceRef`` where the param is one tensor laid out anew (``fn`` moves entries, computes none)."""

    def __init__(self, param: Param, leaves: list[str], fn: Callable, source=None):
        self.param, self.leaves, self.fn, self.source = param, leaves, fn, source

    def adjoint(self, grad: torch.Tensor, source_shape) -> torch.Tensor:
        """The gradient by the one source tensor (of ``source_shape``) of a layout-only recipe, given ``grad`` by
        the param: its entries moved back (a permutation's adjoint is its inverse), no value read."""
        middle = self.source.from_source(torch.empty(tuple(source_shape), device="meta")).shape
        return self.source.to_source(grad.reshape(middle))


def value_ref(p: Param):
    refs = [r for r in p.sources if r.role is Role.VALUE]
    if len(refs) != 1:
        raise PathirError(f"param '{p.name}' has {len(refs)} VALUE source tensors, expected one")
    return refs[0]


def batchnorm_of(model, p: Param):
    """(module path, module) of the batch-norm behind a param's OUT_SCALE refs."""
    paths = {r.name.rpartition(".")[0] for r in p.sources if r.role is Role.OUT_SCALE}
    if len(paths) != 1:
        raise PathirError(f"param '{p.name}' is scaled by {sorted(paths)}, expected one batch-norm")
    path = paths.pop()
    bn = model.get_submodule(path)
    if getattr(bn, "running_var", None) is None or getattr(bn, "running_mean", None) is None:
        raise PathirError(f"'{path}' has no running statistics")
    return path, bn


def threshold_recipe(p: Param, model: torch.nn.Module) -> ParamRecipe:
    """A clipped ReLU's threshold param (−t per channel): read from its buffer, else a constant (a number
    in an nn.ReLU6 / nn.Hardtanh or a call); not a parameter, so no optimizer steps it."""
    name = next(r.name for r in p.sources if r.role is Role.CLIP_THRESHOLD)
    if name in tensor_names(model)[1]:
        return ParamRecipe(p, [name], lambda t, name=name, s=p.shape: -torch.broadcast_to(t[name].reshape(-1), s))
    return ParamRecipe(p, [], lambda t, v=torch.as_tensor(p.value): v.clone())


def is_threshold(p: Param) -> bool:
    return any(r.role is Role.CLIP_THRESHOLD for r in p.sources)


#: how ``fold_batchnorm`` writes the bias of a layer it folds into a batch-norm's bias (``Param.how``)
_FOLDED_BIAS = re.compile(r" \+ scale \* (\S+)")


def folded_biases(p: Param) -> list[str] | None:
    """The model tensors ``fold_batchnorm`` added, scaled, into the folded batch-norm bias ``p`` (the biases of
    the layers before it, however the model holds them: a module's ``bias``, pruned or not, a Parameter added to
    its output); None where its ``how`` records none. Each is resolved as any recipe's tensor is (``Leaf``),
    which names one the model does not hold."""
    return _FOLDED_BIAS.findall(p.how) or None


def graph_recipes(graph: Graph, model: torch.nn.Module) -> list[ParamRecipe]:
    biases = {id(n.bias): n for n in graph.nodes if n.bias is not None}
    value_names = {value_ref(p).name for p in graph.params() if not is_threshold(p)}
    out = []
    for p in graph.params():
        if is_threshold(p):
            out.append(threshold_recipe(p, model))
            continue
        ref = value_ref(p)
        roles = {r.role for r in p.sources}
        shape = p.shape
        if roles == {Role.VALUE}:
            out.append(ParamRecipe(p, [ref.name], lambda t, ref=ref, s=shape: ref.from_source(t[ref.name]).reshape(s),
                                   source=ref))
            continue
        path, bn = batchnorm_of(model, p)
        g_name, b_name, m_name, v_name = (f"{path}.{a}" for a in ("weight", "bias", "running_mean", "running_var"))
        eps = float(bn.eps)

        def c_of(t, g_name=g_name, v_name=v_name, eps=eps):
            return t[g_name] / torch.sqrt(t[v_name] + eps)

        if Role.IN_STATS in roles:  # an unfolded batch-norm scale: c itself
            out.append(ParamRecipe(p, [g_name, v_name], lambda t, c_of=c_of, s=shape: c_of(t).reshape(s)))
        elif id(p) in biases:  # β − μc (+ c · the biases of the layers folded into it)
            convs = folded_biases(p)
            if convs is None:  # (a graph the pass did not record it in: the layers' own biases)
                convs = []
                for e in biases[id(p)].edges:
                    w = e.map.weight
                    if w is None or not any(r.role is Role.OUT_SCALE and r.name.startswith(path + ".")
                                            for r in w.sources):
                        continue
                    owner = value_ref(w).name.rpartition(".")[0]
                    name = f"{owner}.bias" if owner else "bias"
                    bias = getattr(model.get_submodule(owner), "bias", None)
                    if isinstance(bias, torch.Tensor) and name not in value_names:
                        convs.append(name)

            def fn(t, c_of=c_of, b_name=b_name, m_name=m_name, convs=tuple(convs), s=shape):
                c = c_of(t)
                extra = sum((t[n].reshape(c.shape) for n in convs), torch.zeros_like(c))  # (a bias held (1, C, 1, 1))
                return (t[b_name] - t[m_name] * c + c * extra).reshape(s)

            out.append(ParamRecipe(p, [b_name, g_name, m_name, v_name, *convs], fn))
        else:  # a weight folded with the batch-norm after it: W · c per output channel
            if p.how.count(" / sqrt(") > 1:
                raise PathirError(f"param '{p.name}' ({p.how}) has several batch-norms folded into it, one after "
                                  "the other: pathir follows one batch-norm folded into a layer, not a chain of them; "
                                  "fold them into one batch-norm, or put a nonlinearity between them")
            def fn(t, ref=ref, c_of=c_of, s=shape):
                w = ref.from_source(t[ref.name]).reshape(s)
                return w * c_of(t).reshape(-1, *([1] * (len(s) - 1)))

            out.append(ParamRecipe(p, [ref.name, g_name, v_name], fn))
    return out


def _check_one(p: Param, v: torch.Tensor, rtol: float, who: str, built: bool = False) -> None:
    """PathirError unless ``v`` (this call's own tensor: overwritten) is param ``p``'s value to ``rtol`` of its
    largest entry. ``built``: the recipes were just built (the message names both causes)."""
    ref = torch.as_tensor(p.value).to(v.device)
    scale = max(float(ref.max()), -float(ref.min())) if ref.numel() else 0.0
    off = float(v.detach().sub_(ref).abs_().max()) if ref.numel() and tuple(v.shape) == p.shape else 0.0
    if tuple(v.shape) != p.shape or not off <= rtol * max(scale, 1e-300):
        cause = ("they were changed where pathir cannot see it (an edit through .data, or a module swapped for one "
                 "with other tensors); call cm.refresh() after such an edit (docs/live.md)")
        if built:
            cause = (f"either {cause}, or the param is made from them in a way {who} does not follow (a fold it "
                     "does not know: please report the model)")
        raise PathirError(f"{who} cannot rebuild param '{p.name}' ({p.how or p.name}) from the model's tensors: {cause}")


class Coordinates:
    """The compiled graph as a function of the model's tensors, and diag G pulled back to them.

    ``recipes[j].fn(tensors)`` is ``graph.params()[j]`` computed in torch from ``tensors`` (``read()``);
    built once per graph structure, it holds for every later value of the model's tensors as long as
    the model's ``layout`` is the one it was built on (``fits``)."""

    def __init__(self, graph: Graph, model: torch.nn.Module, rtol: float = 1e-6, who: str = "PathSGD"):
        self.graph, self.model = graph, model
        self.layout = layout(model)
        self.recipes = graph_recipes(graph, model)
        names = {n for r in self.recipes for n in r.leaves}
        tensors = tensor_names(model)
        self.leaves = {n: Leaf(model, n, tensors) for n in sorted(names)}
        self.check_each(graph, rtol, who, built=True)  # the recipes must rebuild the compiled graph

    def fits(self) -> bool:
        """Whether the model still has the layout the recipes and leaves were resolved against."""
        return layout(self.model) == self.layout

    def read(self) -> dict[str, torch.Tensor]:
        """{source name: float64 tensor}: detached copies on the CPU."""
        return {n: leaf.read(self.model).cpu() for n, leaf in self.leaves.items()}

    def check_each(self, graph: Graph, rtol: float, who: str, built: bool = False) -> None:
        """PathirError naming the first param of ``graph`` (same structure) that the model's tensors as they are
        now do not rebuild to ``rtol`` of its largest entry; one param at a time without autograd, each float64
        value (and its tensors' reads) dropped once compared, never the whole model's."""
        params = graph.params()
        if len(params) != len(self.recipes):
            raise PathirError(f"{who}: the graph has {len(params)} params, the model's tensors give "
                              f"{len(self.recipes)}")
        with torch.no_grad():
            for p, r in zip(params, self.recipes):
                _check_one(p, r.fn({n: self.leaves[n].read(self.model) for n in r.leaves}), rtol, who, built)

    def current_graph(self, tensors) -> Graph:
        values = {id(r.param): r.fn(tensors).resolve_neg().numpy() for r in self.recipes}
        return self.graph.map_params(lambda p: Param.adopt(p.name, values[id(p)].copy(), p.sources, p.how))

    def pull_back(self, tensors, g: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """{model parameter name: Σ over graph params j of (∂θ_j/∂θ_model)² g_j}."""
        out: dict[str, torch.Tensor] = {}
        for r, gj in zip(self.recipes, g):
            gj = torch.as_tensor(gj, dtype=torch.float64)
            for name in r.leaves:
                leaf = self.leaves[name]
                if leaf.computed:
                    raise PathirError(f"'{name}' is computed by a parametrization: Path-SGD's preconditioner is "
                                      "pulled back to plain parameters only; remove the parametrization "
                                      "(torch.nn.utils.parametrize.remove_parametrizations) to use it")
                if leaf.param_name is None:
                    continue
                x = tensors[name]

                def f(v, name=name, r=r):
                    return r.fn({**tensors, name: v})

                _, slope = torch.func.jvp(f, (x,), (torch.ones_like(x),))  # ∂θ_j/∂x, one x entry per j
                _, vjp = torch.func.vjp(f, x)
                (contrib,) = vjp(gj * slope)
                if leaf.mask:
                    contrib = contrib * self.model.get_buffer(leaf.mask).to(torch.float64).cpu()
                out[leaf.param_name] = out[leaf.param_name] + contrib if leaf.param_name in out else contrib
        return out
