"""The frontends' shared core: what every frontend lowers to and writes back through.

Pending values (:mod:`.values`: an activation is a pending sum of maps of nodes, index ops run on
element ids), the lowering semantics of each kind of op on them (:class:`.lowering.Lowering`, the
public API every rule calls, with :mod:`.fixed_factors`, :mod:`.fixed_maps`, :mod:`.reductions`,
:mod:`.conv_transpose`, :mod:`.pointwise_linear`), what a frontend hands to ``pathir.compile``
(:mod:`.lowered`), and the write rules that turn a rescaling or a mask into per-tensor factors
(:mod:`.write_rules`, :mod:`.param_write`).
"""
