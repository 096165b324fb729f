"""`pathir demo` end to end on a tiny configuration (the full run is the README's main command)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

import pathir.app.demo as demo
from pathir.app.cli import main


def test_demo_quick_writes_tables_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PathCond at initialisation" in text and "Pruning under rescaling" in text
    for name in ("results.json", "pathcond_autoencoder.png", "pruning_under_rescaling.png"):
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["pathcond"]["compression_8"]) == {"baseline", "enorm", "pathcond"}
    assert "Path activations on the digits test set" in text
    assert "Equalization before quantization" in text
    for name in ("activations.json", "active_path_norms.png", "local_vs_global_bounds.png", "equalize_digits.png"):
        assert (out / name).stat().st_size > 0
    act = results["activations"]
    assert act["log10_active_l1_quantiles"]["1"] <= act["log10_path_norm_l1"]
    assert all(r["local_bound_holds"] for r in act["pruning"].values())
    row = results["pruning"]["table"]["60%"]
    # path-magnitude pruning is invariant under rescaling: the same weights go, the same accuracy stays
    assert row["path-magnitude (original)"] == row["path-magnitude (rescaled)"]


def test_random_rescaling_keeps_the_function():
    X = torch.rand(5, 1, 8, 8)
    model = demo.DigitsCNN()
    before = model(X).detach()
    params = [p.detach().clone() for p in model.parameters()]
    demo.random_rescaling(model, spread=2.0, seed=3)
    assert any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    torch.testing.assert_close(model(X).detach(), before, rtol=1e-4, atol=1e-5)


def test_epochs_to_reach():
    assert demo.epochs_to_reach([3.0, 2.0, 1.0], 2.0) == 1
    assert demo.epochs_to_reach([3.0, 2.5], 1.0) is None


@pytest.mark.slow
def test_the_full_demo_prints_the_tables_docs_demo_md_shows(tmp_path, capsys):
    # docs/demo.md quotes the tables of one full run, which repeat on the same software versions: a change to
    # the demo or to what it computes shows here, and the page is updated with it
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    printed = {line.strip() for line in capsys.readouterr().out.splitlines()}
    page = (Path(__file__).parent.parent / "docs" / "demo.md").read_text()
    rows = [line.strip() for line in page.splitlines()
            if re.match(r" {4}\s*(\d+%|not equalized|Brevitas CLE|pathir \()", line)]
    if importlib.util.find_spec("brevitas") is None:
        rows = [row for row in rows if not row.startswith("Brevitas")]
    assert len(rows) >= 6
    assert [row for row in rows if row not in printed] == []
