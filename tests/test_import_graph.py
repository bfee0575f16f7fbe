"""kvcodec's import graph has no cycles, counting imports inside functions too: not between modules,
and not between packages either (collapsed to each package's members, a subpackage with everything
inside it counts as one: ``lossless`` may import ``device`` or ``entropy``, never the reverse through
any of their modules). ``kvcodec.device``, the device runtime every kernel owner shares, imports no
other subpackage. No kvcodec module imports the lab code of ``benchmarks/`` or ``tests/``.

A function-level import hides a cycle from the interpreter but not from a reader: the two modules
still depend on each other. The graph is built statically from the AST of every module (an edge
A -> B for each ``import B`` / ``from B import x`` / ``from A's package import B`` anywhere in A,
and for each kvcodec module named by a string in a module that calls ``importlib.import_module``
or ``__import__``), so the check needs no optional dependency and imports nothing. A module's
``if __name__ == "__main__":`` block is a script, not part of the module: its imports do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvcodec

ROOT = Path(kvcodec.__file__).parent

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvcodec modules ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    # a script block (if __name__ == "__main__":) never runs on import: its imports are not the module's
    tree.body = [n for n in tree.body if not _is_main_block(n)]
    dynamic = any(isinstance(n, (ast.Attribute, ast.Name)) and getattr(n, "attr", getattr(n, "id", None))
                  in ("import_module", "__import__") for n in ast.walk(tree))
    for node in ast.walk(tree):
        if dynamic and isinstance(node, ast.Constant) and node.value in known:
            targets = [node.value]  # importlib.import_module("kvcodec.x") of a name written in the module
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from pkg import sub" imports the submodule; "from mod import name" imports mod
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # "import kvcodec.x.y" of a name inside a module: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _is_main_block(node) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                    for c in test.comparators))


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def packages() -> list[str]:
    return sorted(name for name, path in modules().items() if path.name == "__init__.py")


def member(name: str, package: str) -> str | None:
    """The member of ``package`` that module ``name`` belongs to: the package itself (its
    ``__init__``), a module directly in it, or the subpackage that holds it; None outside it."""
    if name == package:
        return package
    if not name.startswith(package + "."):
        return None
    return ".".join(name.split(".")[: package.count(".") + 2])


def package_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``graph`` collapsed to ``package``'s members: an edge A -> B for each import from a module of
    member A to a module of member B (A != B)."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        a = member(name, package)
        if a is None:
            continue
        for t in targets:
            b = member(t, package)
            if b is not None and b != a:
                out.setdefault(a, set()).add(b)
    return out


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_function_level_imports(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from kvcodec.quant import turboquant\n    import kvcodec.errors\n")
    known = {"kvcodec.quant", "kvcodec.quant.turboquant", "kvcodec.errors", "kvcodec.probe"}
    assert imports_of("kvcodec.probe", path, known) == {"kvcodec.quant.turboquant", "kvcodec.errors"}


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_package_graph_finds_a_cycle_no_module_has():
    graph = {"kvcodec.a.x": {"kvcodec.b.y"}, "kvcodec.b.z": {"kvcodec.a.w"}, "kvcodec.a.w": set(), "kvcodec.b.y": set()}
    assert not cycles(graph)
    assert cycles(package_graph(graph, "kvcodec")) == [frozenset({"kvcodec.a", "kvcodec.b"})]
    assert package_graph(graph, "kvcodec.a") == {}  # the imports leave kvcodec.a


def test_no_cycles_between_packages():
    graph = import_graph()
    found = {p: sorted(sorted(c) for c in cycles(package_graph(graph, p))) for p in packages()}
    found = {p: c for p, c in found.items() if c}
    assert not found, f"import cycles between the members of a package: {found}"


def test_device_imports_no_other_subpackage():
    """kvcodec.device (compile and cache kernels, transfers, the device CRC-32) is the leaf every
    kernel owner imports: it reads only kvcodec's base modules (errors, validate, safe_write, threads)."""
    graph, pkgs = import_graph(), set(packages())
    outside = {t for name, targets in graph.items() if member(name, "kvcodec.device") for t in targets
               if not member(t, "kvcodec.device")}
    assert outside, "kvcodec.device imports no base module: the check reads nothing"
    above = sorted(t for t in outside if member(t, "kvcodec") in pkgs)
    assert not above, f"kvcodec.device imports {above}"


def test_graph_skips_script_blocks(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import kvcodec.errors\nif __name__ == '__main__':\n    import kvcodec.magics\n")
    known = {"kvcodec.errors", "kvcodec.magics", "kvcodec.probe"}
    assert imports_of("kvcodec.probe", path, known) == {"kvcodec.errors"}


def lab_imports(path: Path, lab: set[str]) -> set[str]:
    """The absolute imports in ``path`` (script blocks included) whose top-level name is ``lab``'s."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in lab)
    return found


def test_lab_finder_sees_a_lab_import(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import torch\nfrom . import report\ndef f():\n    import smollm2\n    from benchmarks.common import save\n")
    assert lab_imports(path, {"smollm2", "report", "benchmarks"}) == {"smollm2", "benchmarks.common"}


def test_the_package_imports_nothing_of_the_lab():
    """benchmarks/ and tests/ hold the lab (the SmolLM2 loader, the suites and their runner, the CUDA
    test cases); they are on sys.path while the tests run (tests/conftest.py) but not in a wheel, so a
    kvcodec module that imported one would pass here and fail for every user."""
    checkout = ROOT.parent
    lab = {"benchmarks", "tests"} | {p.stem for folder in ("benchmarks", "tests") for p in (checkout / folder).glob("*.py")}
    assert {"smollm2", "cuda_cases", "run", "common"} <= lab
    found = {name: sorted(hits) for name, path in modules().items() if (hits := lab_imports(path, lab))}
    assert not found, f"kvcodec modules importing lab code: {found}"
