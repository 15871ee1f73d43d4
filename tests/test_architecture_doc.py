"""docs/ARCHITECTURE.md names every module of router/, bench/ and scripts/ (a new module gets its line there)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
MODULES = sorted(p.relative_to(ROOT) for pkg in ("router", "bench") for p in (ROOT / pkg).rglob("*.py")
                 if p.name != "__init__.py" and "results" not in p.parts)
SCRIPTS = sorted(p.relative_to(ROOT) for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh"))


def named(path: Path) -> bool:
    """As `name.py`, `dir/name.py`, or the dotted module (`bench.sim.fit`, `router.curves`)."""
    dotted = ".".join(path.with_suffix("").parts)
    pattern = rf"(?<![\w.]){re.escape(path.name)}\b|(?<![\w.]){re.escape(dotted)}\b"
    return re.search(pattern, DOC) is not None


@pytest.mark.parametrize("path", MODULES + SCRIPTS, ids=str)
def test_every_module_is_named_in_the_architecture_doc(path):
    assert named(path), f"docs/ARCHITECTURE.md does not name {path}: add it to its layer"


def test_a_module_the_doc_does_not_name_is_caught():
    assert not named(Path("bench/no_such_module.py"))
    assert named(Path("bench/breakeven.py")) and named(Path("router/curves.py"))
