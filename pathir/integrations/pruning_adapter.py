"""Path-magnitude channel importance for Torch-Pruning (``pip install -e ".[pruning]"``).

Torch-Pruning removes channels in *groups*: removing channel c of a conv also
removes the entries of every coupled layer that read or write that channel
(the batch-norm after it, the input columns of the next conv, the other convs
of a residual add, ...). :class:`PathMagnitudeImportance` scores each channel
of a group by the path-magnitude of what its removal deletes (docs/pruning.md):

    score(c) = Σ over the group's layers Σ over the entries i the removal of c deletes  S_i,
    S_i = Σ_{p ∋ i} |Φ_p(θ)|     (``Compiled.path_magnitude_scores``),

out-channel removals deleting a layer's weight rows and bias entries, in-channel
removals its weight columns. A batch-norm folded into the conv before it has its
scores on that conv's weight and on the folded bias (named after the batch-norm's
bias), so it is counted once. Like the path-magnitude itself, the score does not
change under a rescaling of the network. The model is compiled on first use and
recompiled when Torch-Pruning has changed its structure.

Layers whose deleted entries are no whole rows/columns (grouped or transposed
convolutions) and layers with parameters pruned by an unknown function raise
PathirError naming the layer, rather than being scored as zero.
"""

from __future__ import annotations

import numpy as np

from pathir.api import compile as compile_model
from pathir.errors import ModelChanged, PathirError

try:  # the base class when Torch-Pruning is installed; the module imports without it
    from torch_pruning.pruner.importance import Importance as _Base
except ImportError:  # pragma: no cover - exercised only without the extra
    _Base = object

__all__ = ["PathMagnitudeImportance"]


class PathMagnitudeImportance(_Base):
    """A ``torch_pruning`` Importance: per channel of a group, the summed path-magnitude of the entries
    its removal deletes.

    Parameters
    ----------
    model : torch.nn.Module, the model the pruner prunes (in eval mode: batch-norms are folded)
    input_shape, example_input : as for :func:`pathir.compile`
    backend : where the scores are computed (default: pathir's)

    Examples
    --------
    See docs/pruning.md for a run; in short::

        import torch_pruning as tp
        from pathir.integrations.pruning_adapter import PathMagnitudeImportance
        imp = PathMagnitudeImportance(model, input_shape=(3, 32, 32))
        tp.pruner.MetaPruner(model, torch.randn(1, 3, 32, 32), importance=imp, pruning_ratio=0.5).step()
    """

    def __init__(self, model, input_shape=None, example_input=None, backend=None):
        if _Base is object:
            raise ImportError("PathMagnitudeImportance needs Torch-Pruning: pip install torch-pruning "
                              '(or pip install -e ".[pruning]")')
        self.model, self.input_shape, self.example_input, self.backend = model, input_shape, example_input, backend
        self._cm = None
        self._scores: dict[str, np.ndarray] | None = None
        self._key = None

    def scores(self) -> dict[str, np.ndarray]:
        """{parameter name: S of its shape} for the model as it is now (cached while it is unchanged)."""
        key = tuple((name, tuple(t.shape), t._version) for name, t in self.model.state_dict(keep_vars=True).items())
        if self._scores is None or key != self._key:
            self._scores, self._key = self._compute(), key
        return self._scores

    def _compute(self) -> dict[str, np.ndarray]:
        if self._cm is not None:
            try:
                return self._cm.path_magnitude_scores(backend=self.backend)
            except ModelChanged:  # Torch-Pruning replaced layers: compile the new structure
                self._cm = None
        self._cm = compile_model(self.model, input_shape=self.input_shape, example_input=self.example_input)
        out = self._cm.path_magnitude_scores(backend=self.backend)
        bad = [k for k, v in out.items() if not np.all(np.isfinite(v))]
        if bad:
            raise PathirError(f"path-magnitude scores of {bad[0]} do not fit float64; the network's path "
                              "magnitudes overflow (try pathir's log-scale pruning, cm.prune)")
        return out

    def __call__(self, group):
        import torch
        from torch_pruning.pruner import function

        scores = self.scores()
        names = {id(m): n for n, m in self.model.named_modules()}
        out_fns = {function.prune_conv_out_channels, function.prune_linear_out_channels,
                   function.prune_batchnorm_out_channels, function.prune_depthwise_conv_out_channels}
        in_fns = {function.prune_conv_in_channels, function.prune_linear_in_channels,
                  function.prune_depthwise_conv_in_channels, function.prune_batchnorm_in_channels}
        total = np.zeros(len(group[0].idxs))
        for item in group:
            dep, idxs = item.dep, [int(i) for i in item.idxs]
            layer, fn = dep.layer, dep.pruning_fn
            if fn not in out_fns | in_fns or id(layer) not in names:
                if isinstance(layer, torch.nn.Module) and any(True for _ in layer.parameters(recurse=False)):
                    raise PathirError(f"PathMagnitudeImportance cannot score the pruning of {type(layer).__name__} "
                                      f"'{names.get(id(layer), '?')}' ({getattr(fn, '__name__', fn)})")
                continue  # a parameter-free op (add, concat, flatten, relu): nothing of its own is deleted
            local = _deleted(scores, names[id(layer)], layer, idxs, out=fn in out_fns)
            roots = item.root_idxs
            keep = [j for j, r in enumerate(roots) if r is not None]
            np.add.at(total, np.asarray([int(roots[j]) for j in keep], dtype=np.int64), local[keep])
        return torch.as_tensor(total)


def _deleted(scores: dict[str, np.ndarray], prefix: str, layer, idxs: list[int], out: bool) -> np.ndarray:
    """Per index, Σ S over the entries of ``layer``'s weight and bias that removing that channel deletes."""
    import torch

    if isinstance(layer, torch.nn.modules.conv._ConvNd) and (layer.transposed or layer.groups != 1):
        raise PathirError(f"PathMagnitudeImportance: the {'transposed' if layer.transposed else 'grouped'} conv "
                          f"'{prefix}' is not supported (its channels are no whole rows/columns of its weight)")
    per_channel = getattr(getattr(layer, "weight", None), "ndim", 1) == 1  # a norm layer: one entry per channel
    local = np.zeros(len(idxs))
    for attr in ("weight", "bias"):
        s = scores.get(f"{prefix}.{attr}".lstrip("."))
        if s is None:
            continue
        if s.ndim == 1:  # a bias (deleted with its output channel) or a norm layer's weight/bias
            if out or per_channel:
                local += s[idxs]
            continue
        local += s.sum(axis=tuple(a for a in range(s.ndim) if a != (0 if out else 1)))[idxs]
    return local
