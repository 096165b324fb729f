"""The activation part of ``pathir demo``: path activations on the digits test set.

For a small CNN trained on digits: the distribution over the test samples of the
active path-norm ‖Φ(θ) ⊙ a(θ, x)‖₁ against the global ‖Φ(θ)‖₁; and, pruning by
path-magnitude at each amount, per test sample the real output change
‖R_θ(x) − R_θ'(x)‖₁, the local bound ‖(Φ(θ) − Φ(θ')) ⊙ a(θ, x)‖₁ · max(‖x‖∞, 1)
(valid where θ' keeps θ's pattern at x) and the global bound
‖Φ(θ) − Φ(θ')‖₁ · max(‖x‖∞, 1). Writes ``activations.json`` and two PNG plots.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

import pathir

__all__ = ["part_activations", "format_activations"]


def part_activations(model, X_test: np.ndarray, amounts, out: str, bar=None) -> dict:
    """Run the part on a trained digits CNN ``model`` (input 1x8x8); returns the tables."""
    x = np.asarray(X_test, dtype=np.float64).reshape(-1, 1, 8, 8)
    cm = pathir.compile(model, input_shape=(1, 8, 8))
    obs = pathir.observe(cm, x, qs=(1.0,), progress=False, batch_size=128)
    active = obs.columns["log10_active_l1"]
    table = {"samples": len(obs), "log10_path_norm_l1": obs.global_values["log10_path_norm_l1"],
             "log10_active_l1_quantiles": {f"{q:g}": v for q, v in obs.quantiles()["log10_active_l1"].items()},
             "active_fraction_median": float(np.median(obs.columns["active_fraction"])), "pruning": {}}
    curves = {}
    for amount in amounts:
        pruned_model = copy.deepcopy(model)
        pathir.compile(pruned_model, input_shape=(1, 8, 8)).prune(amount)
        pruned = pathir.compile(pruned_model, input_shape=(1, 8, 8))
        c = pathir.observe(cm, x, compare=pruned, counts=False, progress=False, batch_size=128).columns
        shared = c["shared"] == 1
        table["pruning"][f"{int(round(amount * 100))}%"] = {
            "shared_fraction": float(shared.mean()),
            "median_flipped_neurons": float(np.median(c["flipped"])),
            "local_bound_holds": bool(np.all(c["output_change"][shared] <= c["local_bound"][shared] * (1 + 1e-9))),
            "estimate_covers_fraction": float(np.mean(c["output_change"] <= c["local_estimate"])),
            "median_output_change": float(np.median(c["output_change"])),
            "median_local_estimate": float(np.median(c["local_estimate"])),
            "median_global_bound": float(np.median(c["global_bound"])),
            "median_tightening": float(np.median(c["global_bound"] / c["local_estimate"])),
        }
        curves[amount] = c
        if bar is not None:
            bar.update(1)
    _plot_norms(active, table["log10_path_norm_l1"], os.path.join(out, "active_path_norms.png"))
    _plot_bounds(curves, os.path.join(out, "local_vs_global_bounds.png"))
    with open(os.path.join(out, "activations.json"), "w") as f:
        json.dump(table, f, indent=2)
    return table


def _plot_norms(active: np.ndarray, glob: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.hist(active, bins=30, color="tab:blue", alpha=0.8, label="active ‖Φ(θ)⊙a(θ,x)‖₁, per test sample")
    ax.axvline(glob, color="tab:red", lw=2, label="global ‖Φ(θ)‖₁")
    ax.set_xlabel("log10 path-norm")
    ax.set_ylabel("test samples")
    ax.set_title("digits CNN: active vs global l1 path-norm")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bounds(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.8), sharey=True, squeeze=False)
    for ax, (amount, c) in zip(axes[0], curves.items()):
        order = np.argsort(c["output_change"])
        n = np.arange(len(order))
        shared = c["shared"][order] == 1
        ax.semilogy(n, c["global_bound"][order], ".", ms=2, color="tab:red", label="global bound")
        ax.semilogy(n[~shared], c["local_estimate"][order][~shared], ".", ms=2, color="tab:cyan",
                    label="local estimate (pattern changed)")
        ax.semilogy(n[shared], c["local_bound"][order][shared], ".", ms=3, color="tab:blue",
                    label="local bound (pattern kept)")
        ax.semilogy(n, c["output_change"][order], "-", color="black", lw=1.2, label="real ‖R_θ(x)−R_θ'(x)‖₁")
        ax.set_title(f"pruned {int(round(amount * 100))}%: pattern kept on {shared.mean():.0%}")
        ax.set_xlabel("test samples, by real change")
    axes[0][0].set_ylabel("output change / bound")
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend above the panels, off the data
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, markerscale=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_activations(table: dict) -> str:
    q = table["log10_active_l1_quantiles"]
    lines = [f"Path activations on the digits test set ({table['samples']} samples, CNN of part 2)", "",
             f"  log10 global l1 path-norm            {table['log10_path_norm_l1']:.3f}",
             f"  log10 active l1 path-norm  min {q['0']:.3f}  median {q['0.5']:.3f}  max {q['1']:.3f}",
             f"  median fraction of active ReLUs      {table['active_fraction_median']:.3f}", "",
             "  per test sample x (medians); local = ‖(Φ(θ)−Φ(θ'))⊙a(θ,x)‖₁·max(‖x‖∞,1), a bound only where θ' keeps",
             "  θ's pattern at x; global = ‖Φ(θ)−Φ(θ')‖₁·max(‖x‖∞,1)", "",
             "  pruned  pattern kept  flipped neurons  real change  local  global  global/local  real ≤ local"]
    for amount, r in table["pruning"].items():
        lines.append(f"  {amount:>6}  {r['shared_fraction']:>12.1%}  {r['median_flipped_neurons']:>15.0f}  "
                     f"{r['median_output_change']:>11.4g}  {r['median_local_estimate']:>5.4g}  "
                     f"{r['median_global_bound']:>6.4g}  {r['median_tightening']:>12.3g}  {r['estimate_covers_fraction']:>12.1%}")
    return "\n".join(lines)
