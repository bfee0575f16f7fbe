"""The shape of the package ``kvcodec/`` (the house), to report a redesign before and after.

Measured for the working tree, or with ``--rev`` for a revision extracted with ``git archive REV
kvcodec README.md docs`` into a temporary folder. Lines are ``len(text.splitlines())``. A room is a
first-level folder of ``kvcodec/`` with an ``__init__.py``; a top-level module is in the room ``base`` when it
imports no subpackage, else in ``kvcodec`` (the front door).

- rooms: per room, its .py files and their lines, its .cu/.cuh files and their lines.
- arrows: one per name imported from a kvcodec module (``import kvcodec.x``, ``from kvcodec.x import y``, relative imports resolved), read from each module's AST, counted from the importer's room to the imported module's room, ``module_level`` or ``in_function`` (inside a def or lambda); ``if __name__ == "__main__":`` blocks are scripts and not counted.
- cycles: strongly connected components of more than one room (iterative Tarjan) over all arrows, and over module-level arrows only.
- in-function imports: arrows (own room included) that sit inside a def or lambda.
- walks: ``kvcodec.compress`` of a seeded ``torch.randn(4, 256, 128)`` bf16 tensor (``layout="kv"`` where ``kvcodec.lossless.api.compress`` documents it), ``kvcodec.decompress`` of its blob, and the LMCache lossless serde's ``deserialize`` of one [2, 4, 256, 128] bf16 chunk; ``threads=1`` so every call runs on the traced thread; each runs once to warm up, once timed (``wall_s``), once traced, in a subprocess with ``PYTHONPATH`` set to the measured tree.
- steps: ``'call'`` events of ``sys.setprofile`` whose code file is under the measured ``kvcodec/`` folder; files: the distinct files among them.
- climbs back up: steps whose callee room differs from the caller's room (the nearest kvcodec frame up the stack) while the callee's room imports the caller's room at module level: calls against the import direction.
- largest files: the ten .py/.cu/.cuh files under ``kvcodec/`` with the most lines.
- docs: lines of README.md and of each docs/*.md.
- duplicates: function bodies (every def, methods and nested defs included; docstring dropped; every name, argument and def name renamed in order of first use; at least 20 AST nodes) whose ``ast.dump`` occurs more than once, as groups of file:qualified name.
- suite (``--suite``, working tree only, ~13 min): wall seconds and summary line of ``python -m pytest -q -p no:cacheprovider``.

    python benchmarks/house.py [--rev GIT_REV] [--out benchmarks/results] [--suite]
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = "kvcodec-bench-results"  # common.DEFAULT_OUT; common itself is imported late (see common())
TOP = "kvcodec"
BASE = "base"
CUDA_SUFFIXES = (".cu", ".cuh")
MIN_BODY_NODES = 20
WALK_TIMEOUT_S = 1800
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


# ------------------------------------------------------------------------------------- rooms
def line_count(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


def room_names(pkg: Path) -> dict[str, str]:
    """The room of each first-level entry of ``pkg`` by its name: a subpackage (a folder with an
    ``__init__.py``) is its own room; a top-level module (by its stem) is in ``base`` when it imports no
    subpackage (errors, container, checksum...), else in ``kvcodec`` (the front door: the package's
    ``__init__``, the CLI, the demo)."""
    subs = {d.name for d in pkg.iterdir() if d.is_dir() and (d / "__init__.py").is_file()}
    out = {name: name for name in subs}
    known = set(modules(pkg))
    for path in sorted(pkg.glob("*.py")):
        name = module_name(path, pkg)
        tree = ast.parse(path.read_text(), str(path))
        targets = [t for node, _ in import_nodes(tree) for t in imported_modules(node, name, path.name == "__init__.py", known)]
        front = any(t.split(".")[0] == pkg.name and len(t.split(".")) > 1 and t.split(".")[1] in subs for t in targets)
        out[path.stem] = TOP if front else BASE
    return out


def room_of_file(path: Path, pkg: Path, rooms: dict[str, str]) -> str:
    parts = path.relative_to(pkg).parts
    return rooms.get(parts[0] if len(parts) > 1 else Path(parts[0]).stem, TOP)


def source_files(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*") if p.suffix in (".py", *CUDA_SUFFIXES) and p.is_file()
                  and "__pycache__" not in p.parts)


def rooms(pkg: Path) -> dict[str, dict]:
    """Per room: .py files and lines, .cu/.cuh files and lines."""
    names = room_names(pkg)
    out = {r: {"py_files": 0, "py_lines": 0, "cu_files": 0, "cu_lines": 0} for r in sorted({*names.values(), TOP})}
    for p in source_files(pkg):
        kind = "py" if p.suffix == ".py" else "cu"
        room = out[room_of_file(p, pkg, names)]
        room[f"{kind}_files"] += 1
        room[f"{kind}_lines"] += line_count(p)
    return out


def largest_files(pkg: Path, n: int = 10) -> list[dict]:
    sized = [{"file": str(p.relative_to(pkg.parent)), "lines": line_count(p)} for p in source_files(pkg)]
    return sorted(sized, key=lambda r: (-r["lines"], r["file"]))[:n]


def docs_lines(tree: Path) -> dict[str, int]:
    found = [tree / "README.md", *sorted((tree / "docs").glob("*.md"))]
    return {str(p.relative_to(tree)): line_count(p) for p in found if p.is_file()}


# -------------------------------------------------------------------------- floors and arrows
def module_name(path: Path, pkg: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: Path) -> dict[str, Path]:
    return {module_name(p, pkg): p for p in source_files(pkg) if p.suffix == ".py"}


def is_main_block(node) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def import_nodes(node, in_function: bool = False):
    """(Import or ImportFrom node, inside a def or lambda) for every import under ``node``; a
    ``__main__`` block is skipped (it runs only as a script)."""
    for child in ast.iter_child_nodes(node):
        if is_main_block(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from import_nodes(child, in_function or isinstance(child, FUNCS))


def imported_modules(node, name: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The module each imported name of ``node`` loads: ``from pkg import sub`` names the submodule,
    ``from mod import obj`` the module; relative imports are resolved against ``name``'s package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = (name if is_pkg else name.rpartition(".")[0]).split(".")
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def room_of_module(mod: str, rooms_: dict[str, str]) -> str:
    parts = mod.split(".")
    return rooms_.get(parts[1] if len(parts) > 1 else "__init__", TOP)


def arrows(pkg: Path) -> dict[tuple[str, str], Counter]:
    """{(importer room, imported room): Counter(module_level=n, in_function=m)} over every kvcodec
    module's imports of kvcodec modules, own room included."""
    mods, names = modules(pkg), room_names(pkg)
    known, top = set(mods), pkg.name
    out: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in import_nodes(tree):
            for target in imported_modules(node, name, path.name == "__init__.py", known):
                if target.split(".")[0] == top:
                    key = (room_of_module(name, names), room_of_module(target, names))
                    out[key]["in_function" if in_function else "module_level"] += 1
    return dict(out)


def room_graph(arrows_: dict, module_level_only: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for (a, b), n in arrows_.items():
        if a != b and (n["module_level"] or not module_level_only):
            graph[a].add(b)
    return dict(graph)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, iterative (sorted lists)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    out.append(_pop_component(v, stack, on))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return sorted(c for c in out if len(c) > 1)


def _pop_component(v: str, stack: list, on: set) -> list[str]:
    comp = []
    while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
            return sorted(comp)


def floors(found: dict[tuple[str, str], Counter]) -> dict:
    """The arrows between rooms, the cycles among them, and the kvcodec imports inside functions."""
    edges = [{"from": a, "to": b, **{k: found[a, b][k] for k in ("module_level", "in_function")}}
             for a, b in sorted(found) if a != b]
    return {
        "edges": edges,
        "cycles": strongly_connected(room_graph(found)),
        "cycles_module_level": strongly_connected(room_graph(found, module_level_only=True)),
        "imports_in_functions": sum(n["in_function"] for n in found.values()),
        "imports_module_level": sum(n["module_level"] for n in found.values()),
    }


# -------------------------------------------------------------------------------- duplicates
class _Rename(ast.NodeTransformer):
    """Every name, argument and def name becomes n0, n1, ... in order of first use."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def _new(self, name: str) -> str:
        return self.names.setdefault(name, f"n{len(self.names)}")

    def visit_Name(self, node):
        node.id = self._new(node.id)
        return node

    def visit_arg(self, node):
        node.arg, node.annotation = self._new(node.arg), None
        return node

    def _visit_def(self, node):
        node.name = self._new(node.name)
        return self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_def


def body_key(fn) -> str | None:
    """The normalised dump of ``fn``'s body, or None for a body under MIN_BODY_NODES nodes."""
    body = fn.body[1:] if ast.get_docstring(fn, clean=False) is not None else fn.body
    module = _Rename().visit(ast.Module(body=copy.deepcopy(body), type_ignores=[]))
    if sum(1 for _ in ast.walk(module)) < MIN_BODY_NODES:
        return None
    return ast.dump(module, annotate_fields=False)


def functions(node, prefix: str = ""):
    """(qualified name, def node) for every def under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield qual, child
            yield from functions(child, qual + ".")
        else:
            yield from functions(child, prefix)


def duplicates(pkg: Path) -> list[list[str]]:
    """Groups of file:function whose normalised bodies are the same (two or more places)."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in modules(pkg).values():
        rel = path.relative_to(pkg.parent)
        for qual, fn in functions(ast.parse(path.read_text(), str(path))):
            key = body_key(fn)
            if key is not None:
                seen[key].append(f"{rel}:{qual}")
    return sorted(sorted(g) for g in seen.values() if len(g) > 1)


# ------------------------------------------------------------------------------------- walks
class Skip(Exception):
    """A walk that cannot run in this environment (the reason is recorded)."""


def walk_compress(torch, kvcodec):
    """The front door; ``layout="kv"`` where the installed ``compress`` documents it (the KV codec)."""
    from kvcodec.lossless import api

    t = torch.randn(4, 256, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    kv = 'layout="kv"' in (api.compress.__doc__ or "")
    opts = {"layout": "kv"} if kv else {}
    text = "kvcodec.compress(t, " + ('layout="kv", ' if kv else "") + "threads=1)"
    return text, lambda: kvcodec.compress(t, threads=1, **opts)


def walk_decompress(torch, kvcodec):
    _, compress = walk_compress(torch, kvcodec)
    blob = compress()
    return "kvcodec.decompress(blob, threads=1)", lambda: kvcodec.decompress(blob, threads=1)


def walk_lmcache_get(torch, kvcodec):
    """Serialize one chunk with the lossless serde; the walk is its deserialize (an L2 get)."""
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        raise Skip("lmcache is not installed")
    try:
        spec = importlib.util.find_spec("kvcodec.integrations.lmcache")
    except ModuleNotFoundError:  # no kvcodec.integrations either
        spec = None
    if spec is None or not str(spec.origin).startswith(os.path.dirname(kvcodec.__file__) + os.sep):
        raise Skip("kvcodec.integrations.lmcache does not exist in this tree")
    from kvcodec.integrations import lmcache as kvlm

    chunk = torch.randn(2, 4, 256, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    proc = kvlm.lossless_serde({"slot_ratio": 1.0, "threads": 1})
    ser, de = proc._serializer, proc._deserializer
    dst = torch.zeros(kvlm.FRAME.size + chunk.nbytes, dtype=torch.uint8)
    n = ser.serialize(kvlm.host_memory_obj(chunk), kvlm.host_memory_obj(dst), None)
    out = torch.empty_like(chunk)
    src_obj, dst_obj = kvlm.host_memory_obj(dst[:n]), kvlm.host_memory_obj(out)

    def get():
        de.deserialize(src_obj, dst_obj, None)
        if not torch.equal(out.view(torch.int16), chunk.view(torch.int16)):
            raise AssertionError("the lossless serde did not restore the chunk")

    return "kvcodec_lossless deserialize (slot_ratio=1.0, threads=1)", get


WALKS = {"compress": walk_compress, "decompress": walk_decompress, "lmcache_get": walk_lmcache_get}


def trace(op, pkg: str) -> dict:
    """Steps, files and room crossings ("caller room->callee room": n) of one run of ``op``."""
    prefix = pkg.rstrip(os.sep) + os.sep
    rooms_, known = room_names(Path(pkg)), {}
    steps, files, crossings = 0, Counter(), Counter()

    def room(filename: str) -> str:
        if filename not in known:
            known[filename] = room_of_file(Path(filename), Path(pkg), rooms_)
        return known[filename]

    def profile(frame, event, arg):
        nonlocal steps
        callee = frame.f_code.co_filename
        if event != "call" or not callee.startswith(prefix):
            return
        steps += 1
        files[callee[len(prefix):]] += 1
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(prefix):
            caller = caller.f_back
        if caller is not None and room(caller.f_code.co_filename) != room(callee):
            crossings[f"{room(caller.f_code.co_filename)}->{room(callee)}"] += 1

    sys.setprofile(profile)
    try:
        op()
    finally:
        sys.setprofile(None)
    return {"steps": steps, "files": len(files), "crossings": dict(crossings), "steps_per_file": dict(files)}


def run_walk(name: str, torch, kvcodec, pkg: str) -> dict:
    """One walk's record; an error where it loaded kvcodec modules from outside ``pkg`` (an
    installed kvcodec standing in for a module the measured tree lacks)."""
    before = set(sys.modules)
    record = _run_walk(name, torch, kvcodec, pkg)
    elsewhere = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == TOP
                       and not str(getattr(sys.modules[m], "__file__", "")).startswith(pkg + os.sep))
    return {"error": f"imported from outside the measured tree: {', '.join(elsewhere)}"} if elsewhere else record


def _run_walk(name: str, torch, kvcodec, pkg: str) -> dict:
    try:
        text, op = WALKS[name](torch, kvcodec)
        op()  # warm-up: numba compiles or loads its cache here
        t0 = time.perf_counter()
        op()
        wall = time.perf_counter() - t0
        return {"call": text, "wall_s": wall, **trace(op, pkg)}
    except Skip as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # recorded, so that one broken walk leaves the others measured
        return {"error": f"{type(exc).__name__}: {exc}"}


def walks_here() -> None:
    """Subprocess side: run every walk with the kvcodec found on PYTHONPATH; print one JSON line."""
    import torch

    import kvcodec

    pkg = os.path.dirname(kvcodec.__file__)
    result = {"package": pkg, "walks": {name: run_walk(name, torch, kvcodec, pkg) for name in WALKS}}
    print(json.dumps(result), flush=True)


def walks(tree: Path, graph: dict[str, set[str]]) -> dict:
    """Run the walks in a subprocess on ``tree``; climbs counted against ``graph`` (module-level)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--walks-here"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=WALK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {name: {"error": f"the walks ran past {WALK_TIMEOUT_S} s"} for name in WALKS}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {name: {"error": f"exit {proc.returncode}: {err}"} for name in WALKS}
    result = json.loads(lines[-1])
    if Path(result["package"]).resolve() != (tree / TOP).resolve():
        return {name: {"error": f"imported kvcodec from {result['package']}, not the measured tree"} for name in WALKS}
    for w in result["walks"].values():
        if "crossings" in w:
            w["climbs_back_up"] = climbs(w["crossings"], graph)
    return result["walks"]


def climbs(crossings: dict[str, int], graph: dict[str, set[str]]) -> int:
    """Crossings a->b where room b imports room a at module level."""
    total = 0
    for pair, n in crossings.items():
        a, b = pair.split("->")
        total += n if a in graph.get(b, ()) else 0
    return total


# ------------------------------------------------------------------------------------- trees
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def extract(rev: str, dest: Path) -> None:
    """``git archive REV kvcodec README.md docs | tar -x -C dest`` (the paths REV has)."""
    present = git("ls-tree", "--name-only", rev, "--", TOP, "README.md", "docs").split()
    archive = subprocess.Popen(["git", "archive", rev, *present], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {rev} failed")


def measure(tree: Path, with_walks: bool = True) -> dict:
    """Every measurement of the tree at ``tree`` (a folder holding ``kvcodec/``)."""
    pkg = tree / TOP
    found = arrows(pkg)
    dups = duplicates(pkg)
    result = {
        "rooms": rooms(pkg),
        "floors": floors(found),
        "largest_files": largest_files(pkg),
        "docs": docs_lines(tree),
        "duplicates": {"groups": len(dups), "functions": sum(map(len, dups)), "list": dups},
    }
    if with_walks:
        result["walks"] = walks(tree, room_graph(found, module_level_only=True))
    return result


def run_suite(tree: Path) -> dict:
    """Wall seconds and summary line of the whole test suite in ``tree``."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tree,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return {"wall_s": wall, "exit_code": proc.returncode, "summary": summary[-1].strip("= ") if summary else ""}


# ------------------------------------------------------------------------------------ report
def common():
    """The benchmarks' ``common`` module, imported only to write results: it imports kvcodec (this
    tree's), and the walk subprocess must import no kvcodec but the measured one."""
    for path in (REPO / "benchmarks", REPO):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import common as module

    return module


def markdown(result: dict) -> str:
    markdown_table = common().markdown_table
    rooms_ = [{"room": k, **v} for k, v in result["rooms"].items()]
    rooms_.append({"room": "total", **{c: sum(r[c] for r in rooms_) for c in rooms_[0] if c != "room"}})
    fl = result["floors"]
    walk_rows = [{"walk": k, **_walk_cells(v)} for k, v in result.get("walks", {}).items()]
    dup = result["duplicates"]
    docs = result["docs"]
    lines = [
        f"## house: {result['tree']}\n",
        markdown_table(rooms_),
        f"Arrows between rooms: {len(fl['edges'])} (imported names: {fl['imports_module_level']} module-level, "
        f"{fl['imports_in_functions']} inside functions). Cycles: {_cycles(fl['cycles'])}; "
        f"module-level only: {_cycles(fl['cycles_module_level'])}.\n",
        markdown_table(walk_rows) if walk_rows else "(walks not run)\n",
        markdown_table(result["largest_files"]),
        f"README.md: {docs.get('README.md', 0)} lines; docs/*.md: {len(docs) - ('README.md' in docs)} files, "
        f"{sum(n for k, n in docs.items() if k != 'README.md')} lines. Duplicate function bodies: "
        f"{dup['groups']} groups ({dup['functions']} functions).\n",
    ]
    if "test_suite" in result:
        suite = result["test_suite"]
        lines.append(f"Test suite: {suite['wall_s']:.0f} s, {suite['summary']} (exit {suite['exit_code']}).\n")
    lines.append(f"`{result['command']}`\n")
    return "\n".join(lines)


def _cycles(found: list[list[str]]) -> str:
    return "; ".join(" <-> ".join(c) for c in found) if found else "none"


def _walk_cells(w: dict) -> dict:
    if "steps" not in w:
        return {"steps": "", "files": "", "climbs_back_up": "", "wall_s": "",
                "call": w.get("skipped") or w.get("error", "")}
    return {k: w[k] for k in ("steps", "files", "climbs_back_up", "wall_s", "call")}


def save(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"-> {(out / f'{name}.json').resolve()}", flush=True)


def command(args) -> str:
    parts = ["python benchmarks/house.py"] + [f"--rev {args.rev}"] * bool(args.rev) + ["--suite"] * args.suite
    return " ".join(parts + [f"--out {args.out}"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--walks-here"]:
        walks_here()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="measure this git revision instead of the working tree")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--suite", action="store_true", help="also time the whole test suite (working tree only)")
    args = ap.parse_args(argv)
    if args.suite and args.rev:
        ap.error("--suite measures the working tree only")
    if args.rev:
        short = git("rev-parse", "--short", f"{args.rev}^{{commit}}")
        with tempfile.TemporaryDirectory(prefix="kvcodec-house-") as tmp:
            extract(short, Path(tmp))
            result = {"suite": "house", "tree": f"revision {short}", **measure(Path(tmp))}
        name = f"house_{short}"
    else:
        dirty = git("status", "--porcelain", "--", TOP, "README.md", "docs")
        head = git("rev-parse", "--short", "HEAD")
        result = {"suite": "house", "tree": f"working tree at {head}" + (" with changes" if dirty else ""),
                  **measure(REPO)}
        if args.suite:
            result["test_suite"] = run_suite(REPO)
        name = "house"
    result["command"] = command(args)
    result["machine"] = common().machine_record()
    save(result, Path(args.out), name)


if __name__ == "__main__":
    main()
