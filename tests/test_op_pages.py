"""docs/ops.md is the op tables written out, and the hand-written op lists in docs/ name exactly the table rows."""

import pathlib
import re

from pathir.app.op_pages import render
from pathir.frontends.onnx.table import RULES as ONNX_RULES
from pathir.frontends.onnx.why import WHY as ONNX_WHY

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def test_ops_page_is_the_tables_written_out():
    assert (DOCS / "ops.md").read_text() == render(), "regenerate it: python -m pathir.app.op_pages > docs/ops.md"


def _onnx_lowers_table() -> set[str]:
    text = (DOCS / "onnx.md").read_text()
    section = text[text.index("## What lowers"):text.index("## Errors")]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    names = set()
    for cell in [r[1] for r in rows[1:] if "folded to a constant" not in r[2]]:  # after the header; a node
        # reading no activation (an If or Loop among them) is folded before any rule runs
        names.update(re.findall(r"\b([A-Z][A-Za-z]+)\b", cell))
    return names


def test_onnx_page_lists_every_row_and_no_other_op():
    listed = _onnx_lowers_table()
    ops_named = {n for n in listed if n in ONNX_RULES or n in ONNX_WHY}
    assert set(ONNX_RULES) - listed == set(), "rows docs/onnx.md's 'What lowers' does not list"
    assert ops_named - set(ONNX_RULES) == set(), "docs/onnx.md lists op types no rule lowers"


def test_onnx_refusals_name_no_lowered_op():
    assert set(ONNX_WHY) & set(ONNX_RULES) == set()
