"""Equalization for quantization (docs/math.md §12): the rescaling that makes per-tensor quantization
of every weight tensor as fine as possible (``range``), or that minimises the certified bound on the
output change quantization causes (``path-metric``), over the graph's whole rescaling group."""
