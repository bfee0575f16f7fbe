"""docs/architecture.md draws only imports the code has.

Its ```arrows block lists one ``a -> b`` per line (names relative to ``kvcodec``; ``#`` starts a
comment): module ``a``, or a module inside package ``a``, imports ``b`` or a module inside package
``b``, anywhere in its source (imports inside functions count). The import graph is the one
tests/test_import_graph.py builds from the AST of every module under kvcodec/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_import_graph import imports_of, modules

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
ARROW = re.compile(r"^([\w.]+)\s*->\s*([\w.]+)$")


def doc_arrows() -> list[tuple[str, str]]:
    blocks = re.findall(r"^```arrows\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/architecture.md needs exactly one ```arrows block"
    arrows = []
    for line in blocks[0].splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = ARROW.match(line)
        assert m, f"not an arrow: {line!r}"
        arrows.append(tuple("kvcodec" if n == "kvcodec" else f"kvcodec.{n}" for n in m.groups()))
    return arrows


def _graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


GRAPH = _graph()


def _inside(name: str, prefix: str) -> bool:
    return prefix == "kvcodec" and name == "kvcodec" or name == prefix or name.startswith(prefix + ".")


def test_the_doc_has_arrows():
    assert len(doc_arrows()) >= 11


@pytest.mark.parametrize("a, b", doc_arrows(), ids=lambda n: n.removeprefix("kvcodec."))
def test_each_arrow_is_an_import(a, b):
    assert any(_inside(m, a) for m in GRAPH), f"{a} is not a kvcodec module or package"
    assert any(_inside(m, b) for m in GRAPH), f"{b} is not a kvcodec module or package"
    edges = [(m, t) for m, targets in GRAPH.items() if _inside(m, a) for t in targets if _inside(t, b)]
    assert edges, f"docs/architecture.md draws {a} -> {b}, but no module of {a} imports {b}"


def test_a_wrong_arrow_fails():
    """The check can fail: the device runtime never imports the quantizers (it is the other way round)."""
    assert any(_inside(t, "kvcodec.device") for m, ts in GRAPH.items() if _inside(m, "kvcodec.quant") for t in ts)
    assert not any(_inside(t, "kvcodec.quant") for m, ts in GRAPH.items() if _inside(m, "kvcodec.device") for t in ts)
