"""Everything a user reads is inside the repository: README.md, docs/ and the package point at no file outside it.

A user's clone has no ../shared folder (the team's design notes, formula reference and papers): the
mathematics is docs/math.md, cited as "docs/math.md §N" with the same section numbers.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("../shared", "DESIGN.md", "seeds/")
PACKAGE_DIRS = ("pathir", "frontends", "passes", "backends")


def user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file())]


def package_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def offending_lines(files: list[Path], needles: tuple[str, ...]) -> list[str]:
    hits = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {needle!r} in {line.strip()!r}" for needle in needles if needle in line]
    return hits


def test_the_scanned_files_exist():
    assert (ROOT / "docs" / "math.md").is_file()
    assert len(user_docs()) > 10 and len(package_files()) > 50


def test_docs_and_readme_point_inside_the_repository():
    hits = offending_lines(user_docs(), OUTSIDE + ("MATH.md",))
    assert not hits, "cite docs/math.md §N instead:\n" + "\n".join(hits)


def test_package_points_inside_the_repository():
    hits = offending_lines(package_files(), OUTSIDE)
    assert not hits, "\n".join(hits)


def test_package_cites_docs_math():
    hits = offending_lines(package_files(), ("MATH.md",))
    assert not hits, "cite docs/math.md §N instead:\n" + "\n".join(hits)


def relative_links(path: Path) -> list[str]:
    """Markdown link targets of ``path`` outside code, without URLs and in-page anchors."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_links_in_docs_and_readme_resolve_inside_the_repository():
    broken = []
    for path in user_docs():
        for target in relative_links(path):
            resolved = (path.parent / target.split("#")[0]).resolve()
            if ROOT not in resolved.parents or not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: ({target})")
    assert not broken, "links to nothing, or to outside the repository:\n" + "\n".join(broken)
