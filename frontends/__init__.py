"""Frontends: a model -> a raw Graph and a writer. ``torch/`` (torch.fx, torch.export), ``onnx/``,
and their shared ``core/``; each frontend dispatches an op through its op table
(``pathir.frontends.torch.table.RULES``, ``pathir.frontends.onnx.table.RULES``)."""
