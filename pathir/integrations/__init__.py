"""pathir inside other tools: Path-SGD as a ``torch.optim.Optimizer`` (:mod:`.optim`,
public as ``pathir.optim``) and a Torch-Pruning importance (:mod:`.pruning_adapter`)."""
