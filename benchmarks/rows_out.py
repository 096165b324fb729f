"""The benchmark scripts' shared output: each row as a JSON line on stderr as soon as it is measured
(a long run shows its progress and keeps what it measured if stopped), and all rows as a JSON file
on request (``--json``)."""

from __future__ import annotations

import json
import sys


def measured(rows) -> list[dict]:
    """The rows of an iterable that measures them one by one, each printed as a JSON line on stderr."""
    out = []
    for row in rows:
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def save_json(rows: list[dict], path: str | None) -> None:
    """Write ``rows`` to ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
