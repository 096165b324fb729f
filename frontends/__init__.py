"""Frontends: torch_fx (nn.Module) and onnx (ModelProto / .onnx files) -> Graph."""
