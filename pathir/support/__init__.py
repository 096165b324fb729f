"""Base utilities every layer may use: progress bars and phase timing on stderr
(:mod:`.progress`), all-or-nothing file writes (:mod:`.files`), ``np.unique`` of
integer keys by one sort (:mod:`.sorted_unique`), logs of large arrays on torch's
vectorised kernels (:mod:`.fast_log`), shards and all-gathers across the ranks of a
torch.distributed process group (:mod:`.distributed`)."""
