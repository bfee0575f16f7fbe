"""benchmarks/house.py reads the package's shape from files alone: its import graph parser, its
cycle finder, and its measurements of the real tree (the walks, which import kvcodec, are not run
here)."""

from collections import Counter
from pathlib import Path
from textwrap import indent

import house

FILES = {
    "__init__.py": "",
    "errors.py": "",
    "a/__init__.py": "from kvcodec.b import x\n",
    "a/m.py": "def f():\n    from kvcodec.c import y\n    return y\n",
    "b/__init__.py": "from ..a import m\nfrom . import x\n",
    "b/x.py": "from .. import errors\nif __name__ == '__main__':\n    import kvcodec.c\n",
    "c/__init__.py": "",
    "c/y.py": "import kvcodec.errors, kvcodec.a.m\n",
}


def tiny_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "kvcodec"
    for name, text in FILES.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_arrows_of_a_tiny_package(tmp_path):
    found = house.arrows(tiny_package(tmp_path))
    assert found == {
        ("a", "b"): Counter(module_level=1),
        ("a", "c"): Counter(in_function=1),  # inside f()
        ("b", "a"): Counter(module_level=1),  # from ..a import m, resolved
        ("b", "b"): Counter(module_level=1),  # from . import x
        ("b", "base"): Counter(module_level=1),  # from .. import errors; the __main__ block is skipped
        ("c", "base"): Counter(module_level=1),  # errors imports no subpackage: the base room
        ("c", "a"): Counter(module_level=1),
    }
    floors = house.floors(found)
    assert floors["cycles"] == [["a", "b", "c"]]
    assert floors["cycles_module_level"] == [["a", "b"]]
    assert floors["imports_in_functions"] == 1
    assert {(e["from"], e["to"]) for e in floors["edges"]} == {k for k in found if k[0] != k[1]}


def test_strongly_connected():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}}
    assert house.strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert house.strongly_connected({"a": {"b"}, "b": set()}) == []


def test_climbs_run_against_the_import_direction():
    graph = {"lossless": {"entropy", "kvcodec"}}
    crossings = {"kvcodec->lossless": 2, "lossless->entropy": 5, "entropy->lossless": 3}
    assert house.climbs(crossings, graph) == 2 + 3


def test_duplicates_ignore_names_and_docstrings(tmp_path):
    pkg = tmp_path / "kvcodec"
    pkg.mkdir()
    body = "total = 0\nfor v in {0}:\n    total += v * v + 1\nreturn total / len({0})\n"
    (pkg / "__init__.py").write_text("def f(xs):\n    '''Sum.'''\n" + indent(body.format("xs"), " " * 4))
    (pkg / "other.py").write_text("class C:\n    def g(self, ys):\n" + indent(body.format("ys"), " " * 8))
    assert house.duplicates(pkg) == [["kvcodec/__init__.py:f", "kvcodec/other.py:C.g"]]


def test_measure_the_real_tree():
    result = house.measure(house.REPO, with_walks=False)
    assert {"lossless", "quant", "hf", "kvcodec"} <= set(result["rooms"])
    assert all(result["rooms"][r]["py_files"] > 0 for r in ("lossless", "quant", "hf"))
    assert len(result["largest_files"]) == 10 and result["docs"]["README.md"] > 0
    assert result["floors"]["edges"]
