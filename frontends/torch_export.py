"""torch.export fallback of the torch frontend: interpret the exported ATen graph.

Used when torch.fx symbolic tracing fails (e.g. Python control flow on shapes).
ATen ops map onto the same op semantics (lowering.Lowering) as the fx path;
parameters and buffers arrive as lifted placeholders named by their FQN.
"""

from __future__ import annotations

import operator

import torch

from pathir.frontends import conv_transpose, fixed_dispatch
from pathir.frontends.capture_checks import effect_export
from pathir.frontends.fx_interpreter import FxInterpreter, bind, substitute, values_in, why
from pathir.frontends.lower_extra import lower_function
from pathir.frontends.torch_inputs import model_dtype_device
from pathir.frontends.values import NOT_MINE, ParamTensor, Value

__all__ = ["lower_exported"]

aten = torch.ops.aten

_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.permute.default, aten.transpose.int, aten.slice.Tensor, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.narrow.default, aten.cat.default, aten.select.int, aten.expand.default,
    aten.flip.default, aten.roll.default, aten.repeat.default, aten.stack.default, aten.unbind.int,
    aten.index_select.default, aten.repeat_interleave.self_int, aten.movedim.int, aten.unfold.default,
    aten.rot90.default, aten.tile.default, aten.swapaxes.default, aten.tensor_split.sections,
    aten.tensor_split.indices, aten.fliplr.default, aten.flipud.default, aten.swapdims.default,
    aten.moveaxis.int, aten.hstack.default, aten.movedim.intlist,
}
_SAME = {aten.clone.default, aten.alias.default, aten.detach.default, aten.detach_.default, aten.contiguous.default,
         aten.dropout.default, aten.feature_dropout.default, aten.lift_fresh_copy.default}

#: ATen ops lowered by lower_extra through their torch spelling
_EXTRA = {
    aten.sub.Tensor: torch.sub, aten.sub.Scalar: torch.sub, aten.rsub.Scalar: torch.rsub,
    aten.mul.Tensor: torch.mul, aten.mul.Scalar: torch.mul, aten.div.Tensor: torch.div, aten.div.Scalar: torch.div,
    aten.neg.default: torch.neg, aten.matmul.default: torch.matmul, aten.mm.default: torch.mm, aten.maximum.default: torch.maximum, aten.clamp_min.default: torch.clamp_min,
    aten.clamp.default: torch.clamp, aten.leaky_relu.default: torch.nn.functional.leaky_relu,
    aten.threshold.default: torch.threshold, aten.unflatten.int: torch.unflatten,
    aten.mul_.Tensor: torch.mul, aten.sub_.Tensor: torch.sub, aten.div_.Tensor: torch.div,
    aten.sum.dim_IntList: torch.sum, aten.amax.default: torch.amax, aten.max.dim: torch.max,
    aten.hardtanh.default: torch.nn.functional.hardtanh, aten.hardtanh_.default: torch.nn.functional.hardtanh,
    aten.masked_fill.Scalar: torch.masked_fill, aten.masked_fill_.Scalar: torch.masked_fill,
    aten.where.self: torch.where,
}


def lower_exported(model, shapes, name):
    """Export with example inputs in the model's own dtype and device (batch 2) and interpret;
    constants torch.export lifts to inputs are constants, never tensor inputs."""
    shapes = [tuple(shapes)] if shapes and not isinstance(shapes[0], (tuple, list)) else list(shapes)
    dtype, device = model_dtype_device(model)
    examples = tuple(torch.zeros((2, *s), dtype=dtype, device=device) for s in shapes)
    program = torch.export.export(model, examples)
    sig = program.graph_signature
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers()), **dict(program.constants)}
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
              **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
    return _ExportInterpreter(model, program.graph_module, name, lifted, tensors).run(shapes)


class _ExportInterpreter(FxInterpreter):
    effect = staticmethod(effect_export)

    def _is_state(self, node) -> bool:
        return node.op == "placeholder" and node.name in self.lifted

    def __init__(self, model, gm, name, lifted, tensors):
        super().__init__(model, gm, name)
        self.lifted, self.tensors = lifted, tensors

    def _eval(self, node, shape):
        if node.op == "placeholder" and node.name in self.lifted:
            fqn = self.lifted[node.name]
            return ParamTensor(fqn, self.tensors[fqn])
        return super()._eval(node, shape)

    def _function(self, fn, args, kwargs):
        low = self.low
        if not values_in(args, kwargs) or fn is operator.getitem and not isinstance(args[0], Value):
            if fn is operator.getitem or not isinstance(fn, torch._ops.OpOverload):
                return super()._function(fn, args, kwargs)
        out = fixed_dispatch.aten_op(low, self.model, fn, args, kwargs)
        if out is NOT_MINE:
            out = conv_transpose.aten_op(low, self.model, fn, args, kwargs)
        if out is not NOT_MINE:
            return out
        if fn in _SAME:
            return args[0]
        if fn in (aten.relu.default, aten.relu_.default):
            return low.relu(args[0])
        if fn in (aten.add.Tensor, aten.add_.Tensor):
            if kwargs.get("alpha", 1) != 1:  # a + alpha * b: a fixed-scale edge on b
                return lower_function(low, torch.add, args, kwargs)
            return low.add(args[0], args[1])
        if fn in (aten.conv1d.default, aten.conv2d.default, aten.conv1d.padding, aten.conv2d.padding):
            return low.conv(*bind(args, kwargs, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
                                   {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}))
        if fn is aten.convolution.default:
            x, w, b, stride, padding, dilation, _, _, groups = args[:9]  # transposed: conv_transpose.aten_op
            return low.conv(x, w, b, stride, padding, dilation, groups)
        if fn is aten.linear.default:
            return low.linear(*bind(args, kwargs, ["input", "weight", "bias"], {"bias": None}))
        if fn is aten.batch_norm.default:
            x, w, b, mean, var, training, _, eps = args[:8]
            return low.batch_norm(x, "", w, b, mean, var, eps)
        if fn is aten._native_batch_norm_legit_no_training.default:
            x, w, b, mean, var, _, eps = args[:7]
            return (low.batch_norm(x, "", w, b, mean, var, eps), None, None)
        if fn in (aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool2d_with_indices.default):
            a = bind(args, kwargs, ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"],
                      {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False})
            out = low.max_pool(*a)
            return (out, None) if fn is aten.max_pool2d_with_indices.default else out
        if fn in (aten.avg_pool1d.default, aten.avg_pool2d.default):
            return low.avg_pool(*bind(args, kwargs, ["input", "kernel_size", "stride", "padding", "ceil_mode",
                                                      "count_include_pad", "divisor_override"],
                                       {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True,
                                        "divisor_override": None}))
        if fn in (aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default):
            return low.adaptive_avg_pool(args[0], args[1])
        if fn in (aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default):
            return (lower_function(low, torch.nn.functional.adaptive_max_pool2d, args[:2], {}), None)
        if fn is aten.mean.dim:
            out = lower_function(low, torch.mean, args, kwargs)  # over other axes than all spatial ones
            if out is not NOT_MINE:
                return out
            x, dim, keepdim = bind(args, kwargs, ["input", "dim", "keepdim"], {"keepdim": False})
            return low.mean(x, dim, keepdim)
        if fn in _VIEW_OPS:
            return self._index(lambda *ids: fn(*substitute(args, ids), **substitute(kwargs, ids)), values_in(args, kwargs), args, kwargs)
        if fn in _EXTRA:
            out = lower_function(low, _EXTRA[fn], args, kwargs)
            if out is not NOT_MINE:
                return out
        op = getattr(fn, "__name__", str(fn))
        low.unsupported(why(op.split(".")[0]), op)
