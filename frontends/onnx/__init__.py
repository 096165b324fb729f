"""The ONNX frontend: an .onnx file, its bytes or an ``onnx.ModelProto`` -> a raw Graph and a writer.

:func:`lower` loads the model (:mod:`.load`), walks its live nodes (:mod:`.lowering`), every op
type through its rule in the op table (:mod:`.table`), folding what reads no activation with
onnx's reference evaluator (:mod:`.evaluate`); :mod:`.writer` writes rescalings and masks into a
copy of the model.
"""

from pathir.frontends.onnx.lower import OnnxModelError, lower

__all__ = ["lower", "OnnxModelError"]
