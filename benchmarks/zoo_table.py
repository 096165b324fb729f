"""Write docs/zoo.md: every torchvision classification model, compiled or refused.

    python benchmarks/zoo_table.py [--out docs/zoo.md]

For supported models: nodes, parameters, hidden channels, compile seconds and
the IR forward's max relative error against the model's own float64 forward.
"""

from __future__ import annotations

import argparse

from pathir.app import zoo
from pathir.support.progress import bar

HEADER = """# The torchvision zoo

Every torchvision classification model, as pathir sees it (random
initialisation, batch-norm statistics randomised so that folding is exercised,
float64, batch 1, torch backend). *Rel. error* compares the IR forward with the
model's own forward ("tested": not measured for this table; tests/test_zoo.py
holds every supported model to 1e-9). *Units* counts the free rescaling
directions (batch-norms folded, residual-stream channels tied across blocks). The supported models are checked by `tests/test_zoo.py`.
Regenerate this page with `python benchmarks/zoo_table.py`.
googlenet and inception_v3 are built with their default `aux_logits=True`: their
aux classifiers run only in train mode, so in eval mode (this table) a rescaling
write-back (`pathcond`, `enorm`, `normalize`) is refused naming them; compile them
in train mode to have the aux heads as extra outputs, which a rescaling keeps, or
build them with `aux_logits=False` (see [capture](capture.md)).

| model | status | input | nodes | parameters | hidden channels | units | compile (s) | rel. error |
|---|---|---|---|---|---|---|---|---|
"""

REJECTED_HEADER = """
## Refused

These raise `pathir.UnsupportedOperation` naming the first node outside the
ReLU DAG model; the model is left untouched.

| model | node | op | module | why |
|---|---|---|---|---|
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/zoo.md")
    parser.add_argument("--no-forward", action="store_true", help="compile only (the forward check is tests/test_zoo.py's)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    rows, refused = [], []
    models = zoo.SUPPORTED + sorted(zoo.REJECTED)
    for name in (progress := bar(models, desc="zoo", progress=False if args.quiet else None, unit="model")):
        progress.set_postfix_str(name)
        r = zoo.check_model(name, forward=not args.no_forward)
        if r["status"] == "supported":
            err = "tested" if r["max_rel_error"] is None else f"{r['max_rel_error']:.1e}"
            rows.append(f"| {name} | supported | {r['input']} | {r['nodes']} | {r['params']:,} | "
                        f"{r['hidden_channels']:,} | {r['units']:,} | {r['compile_seconds']:.2f} | {err} |")
        else:
            refused.append(f"| {name} | `{r['node']}` | {r['op']} | `{r['where']}` | {r['why']} |")
    with open(args.out, "w") as f:
        f.write(HEADER + "\n".join(rows) + "\n" + REJECTED_HEADER + "\n".join(refused) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
