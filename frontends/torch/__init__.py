"""The torch frontend: an ``nn.Module`` -> a raw Graph and a writer.

:func:`lower` traces the model with torch.fx (torch.export as the fallback) and interprets the
program (:mod:`.interpreter`), every op through its rule in the op table (:mod:`.table`); the
capture checks (:mod:`.capture_checks`) refuse what a trace would get wrong (aliasing through
in-place ops, hooks, training flags fixed in code); :mod:`.writer` writes rescalings and masks
back into the model, :mod:`.reread` re-reads its current values without tracing again.
"""

from pathir.frontends.torch.lower import lower, trace

__all__ = ["lower", "trace"]
