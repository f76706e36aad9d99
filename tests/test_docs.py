"""The docs keep up with the tree: every module is placed in docs/architecture.md, every relative
link in README.md and docs/ resolves, and nothing points outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
pytestmark = pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="no docs/ here (a source archive without them)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    pkg = ROOT / "lowgrad"
    layer_inits = {pkg / d / "__init__.py" for d in ("core", "sr", "cuda", "host", "cli")}  # docstrings only
    missing = [str(p.relative_to(pkg)) for p in sorted(pkg.rglob("*.py"))
               if p not in layer_inits and f"`{p.relative_to(pkg)}`" not in text
               and f"`{p.relative_to(ROOT)}`" not in text]
    assert not missing, f"docs/architecture.md does not place: {missing}"


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# the design file and folder that only the developers have (spelled in parts, so that this test
# does not itself name them)
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")


def test_docs_stay_inside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert not any(name in text for name in OUTSIDE), doc


def test_architecture_import_table_is_the_layer_rule() -> None:
    """The "may import" table of docs/architecture.md says what tests/test_layers.py enforces."""
    from test_layers import ALLOWED

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | may import"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        layer_cell, allowed_cell = line.split("|")[1:3]
        layer = re.findall(r"`([a-z_]+)`", layer_cell)
        if layer and layer[0] in ALLOWED:
            rows[layer[0]] = set(re.findall(r"`([a-z_]+)`", allowed_cell.split("—")[0]))
    assert rows == ALLOWED
