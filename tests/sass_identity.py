"""SASS of the decode-attention and quantize+pack kernel instances the launchers build, compared
between a git revision and the work tree.

    python tests/sass_identity.py --base HEAD~1 [--jobs 2] [--archs sm_90,sm_100] [--only REGEX] [--keep DIR]

exports ``kvcodec/`` of ``--base`` to a temporary folder, and for each tree (the base's and this one)
builds with nvcc, for every target in ``--archs``, the template instances listed below with the macros
that tree's own launcher passes for them (``decode_kernels.split_defines`` for a symmetric and an
asymmetric 4-bit codebook, ``decode_kernels.fused_defines`` on those; prep and merge without macros;
``tq_pack.cu`` without macros), disassembles each function with ``cuobjdump -sass`` and compares the
two trees call situation by call situation (instance and codebook symmetry; the macro strings may
differ between the trees): the SASS text (addresses, instructions and encodings) and the resource usage
line (registers, shared memory, stack). Exit status 0 when every build is identical.

The instances (``split_configs``, ``pack_configs``): every (k_bits, v_bits) of head_dims 64 and 128, five
of them with QJL keys; three bit pairs of head_dims 32, 96, 160, 192, 224 and 256; bfloat16 key and/or
value norms at head_dims 64 and 128; each in narrow and wide tiles; the one-launch twin of each
instance without QJL keys; prep and merge of each head_dim; ten quantize+pack configurations: 460
builds per target. An nvcc build is about a second per instance and target on an idle core; ``--jobs``
nvcc runs go at once.

``cuobjdump`` comes with the CUDA toolkit or the ``nvidia-cuda-cuobjdump`` wheel (found on PATH or in
that wheel's ``nvidia/cu13/bin``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 12  # instances per nvcc run (one front-end parse each)


def split_configs() -> list[tuple]:
    """(dim, k_bits, v_bits, k_bf16, v_bf16, qjl, narrow) of the split kernels built."""
    cfgs = [(d, kb, vb, False, False, False, n) for d in (64, 128) for kb in range(1, 5) for vb in range(1, 5)
            for n in (False, True)]
    cfgs += [(d, kb, vb, False, False, True, n) for d in (64, 128)
             for kb, vb in ((4, 4), (3, 4), (2, 2), (1, 3), (4, 1)) for n in (False, True)]
    cfgs += [(d, kb, vb, False, False, False, n) for d in (32, 96, 160, 192, 224, 256)
             for kb, vb in ((4, 4), (3, 3), (2, 4)) for n in (False, True)]
    cfgs += [(d, 4, 4, False, False, True, False) for d in (32, 96, 256)]
    cfgs += [(d, kb, vb, kbf, vbf, False, n) for d in (64, 128) for kb, vb in ((4, 4), (3, 3))
             for kbf, vbf in ((False, True), (True, True), (True, False)) for n in (False, True)]
    cfgs += [(128, 3, 4, True, True, True, False), (64, 4, 4, True, False, True, True)]
    return list(dict.fromkeys(cfgs))


def pack_configs() -> list[tuple]:
    """(dim, bits, in_code, norm_bf16, rounds, nc) of the quantize+pack kernels built: every input type,
    one and two rounds, with and without norm correction, head_dims 32-1024, bits 1-8."""
    return [(128, 4, 2, False, 1, False), (128, 4, 1, True, 2, True), (128, 3, 0, False, 1, True),
            (64, 2, 2, True, 2, False), (256, 4, 0, False, 2, True), (32, 1, 0, False, 2, False),
            (512, 4, 2, False, 2, True), (1024, 8, 1, True, 1, False), (64, 5, 0, False, 2, True),
            (256, 7, 1, False, 1, False)]


def launcher_builds(only: str | None = None) -> list[tuple[str, str, tuple[str, ...], str, str]]:
    """(label, source, macros, instance name, instance declaration) of every build, with the macros of the
    importable kvcodec's launcher (the tree on sys.path). The label names the call situation (instance and
    codebook symmetry), so the two trees' builds of one situation compare even where their macros differ."""
    import inspect

    import torch

    from kvcodec.quant.cuda import decode_kernels as dk
    from kvcodec.quant.cuda import pack

    sym = torch.linspace(-1.0, 1.0, 16)  # cb[15 - i] == -cb[i]
    asym = torch.linspace(-1.0, 1.2, 16)
    fused_params = inspect.signature(dk.fused_defines).parameters
    builds = []
    dims = set()
    for cfg in split_configs():
        d, kb, vb, kbf, vbf, qjl, narrow = cfg
        dims.add(d)
        for tag, cb in (("symmetric codebooks", sym), ("asymmetric codebooks", asym)):
            if tag.startswith("a") and 4 not in (kb, vb):
                continue  # the codebook symmetry only matters for 4-bit codes: the same call as above
            defines = dk.split_defines((), kb, vb, cb, cb, vbf)
            name = dk.split_name(*cfg)
            builds.append((f"{name} | {tag}", dk.SOURCE, defines, name, f"__global__ void {name}{dk.SPLIT_SIGNATURE}"))
            if qjl:
                continue
            if "tcap" in fused_params:
                fused = dk.fused_defines(defines, 4096, d, kb, vb, narrow)
            else:
                fused = dk.fused_defines(defines, d, kb, vb, narrow)
            name = dk.fused_name(d, kb, vb, kbf, vbf, narrow)
            builds.append((f"{name} | {tag}", dk.SOURCE, tuple(fused), name,
                           f"__global__ void {name}{dk.FUSED_SIGNATURE}"))
    for d in sorted(dims):
        names = [(dk.merge_name(d), dk.MERGE_SIGNATURE)] + [(dk.prep_name(d, qin), dk.PREP_SIGNATURE) for qin in (0, 1, 2)]
        builds += [(name, dk.SOURCE, (), name, f"__global__ void {name}{sig}") for name, sig in names]
    for cfg in pack_configs():
        name = pack.pack_name(*cfg)
        builds.append((name, pack.SOURCE, (), name, f"__global__ void {name}{pack.SIGNATURE}"))
    return [b for b in builds if not only or re.search(only, b[0])]


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for p in sys.path:
        cand = Path(p) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if cand.exists():
            return str(cand)
    raise SystemExit("cuobjdump not found: install the CUDA toolkit's or the nvidia-cuda-cuobjdump wheel")


def _functions(text: str) -> dict[str, str]:
    """cuobjdump -sass output -> {mangled name: its SASS lines}."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                out[name] = "\n".join(lines)
            name, lines = m.group(1), []
        elif name and line.strip():
            lines.append(line.rstrip())
    if name:
        out[name] = "\n".join(lines)
    return out


def _resources(text: str) -> dict[str, str]:
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            out[name] = line.strip()
            name = None
    return out


def _build_chunk(job) -> dict:
    """nvcc one chunk of instances of one source, macro set and target; {key: (sass, resources)}."""
    from kvcodec.device import build

    source, defines, arch, decls, workdir = job
    extra = tuple(f"-D{d}" for d in defines)
    proc = build.nvcc_compile(source, list(decls), arch, workdir, extra)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed ({arch}, {defines}):\n{proc.stderr[-3000:]}")
    cubin = Path(proc.args[proc.args.index("-o") + 1])
    tool = cuobjdump()
    sass = _functions(subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout)
    res = _resources(subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True,
                                    check=True).stdout)
    shutil.rmtree(workdir, ignore_errors=True)
    tag = f"{Path(source).name} {arch} {' '.join(defines)}"
    return {f"{tag} | {fn}": (text, res.get(fn, "")) for fn, text in sass.items()}


def dump(out_dir: Path, archs: list[str], jobs: int, only: str | None = None) -> None:
    """Build every launcher instance of the importable kvcodec; SASS per function under out_dir."""
    groups: dict[tuple, list[str]] = {}
    builds = launcher_builds(only)
    for _, source, defines, _, decl in builds:
        for arch in archs:
            decls = groups.setdefault((source, defines, arch), [])
            if decl not in decls:
                decls.append(decl)
    work = Path(tempfile.mkdtemp(prefix="sass-build-"))
    chunks = [(s, d, a, tuple(decls[i:i + CHUNK]), work / f"{n}-{i}")
              for n, ((s, d, a), decls) in enumerate(sorted(groups.items())) for i in range(0, len(decls), CHUNK)]
    print(f"{sum(len(c[3]) for c in chunks)} instance builds in {len(chunks)} nvcc runs", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = {}
    with ThreadPoolExecutor(jobs) as pool:
        for n, result in enumerate(pool.map(_build_chunk, chunks), 1):
            for key, (sass, res) in result.items():
                name = hashlib.sha256(key.encode()).hexdigest()[:24]
                (out_dir / f"{name}.sass").write_text(sass + "\n")
                index[key] = {"file": f"{name}.sass", "resources": res,
                              "sha256": hashlib.sha256(sass.encode()).hexdigest()}
            print(f"  {n}/{len(chunks)} nvcc runs done", flush=True)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    # each call situation's build (source file, macros, instance name)
    labels = {label: {"file": Path(source).name, "defines": list(defines), "instance": name}
              for label, source, defines, name, _ in builds}
    (out_dir / "labels.json").write_text(json.dumps(labels, indent=1, sort_keys=True))
    shutil.rmtree(work, ignore_errors=True)


def _by_instance(folder: Path) -> dict[tuple, dict]:
    """A dump's index keyed by (source file, arch, macros, demangled instance name)."""
    index = json.loads((folder / "index.json").read_text())
    keys = sorted(index)
    mangled = [k.split(" | ", 1)[1] for k in keys]
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    out = {}
    for key, dem in zip(keys, demangled):
        tag = key.split(" | ", 1)[0].split()
        name = dem.split("(", 1)[0].removeprefix("void ")
        out[(tag[0], tag[1], tuple(tag[2:]), name)] = index[key]
    return out


def diff(a: Path, b: Path) -> int:
    """Compare two dumps situation by situation (labels.json); prints the differences, returns how many
    builds differ or are missing."""
    ea, eb = _by_instance(a), _by_instance(b)
    la, lb = json.loads((a / "labels.json").read_text()), json.loads((b / "labels.json").read_text())
    archs = sorted({k[1] for k in ea} | {k[1] for k in eb})
    bad = same = 0
    for label in sorted(la.keys() | lb.keys()):
        if label not in la or label not in lb:
            print(f"only in {'base' if label in la else 'work tree'}: {label}")
            bad += 1
            continue
        for arch in archs:
            ka, kb = ((x["file"], arch, tuple(x["defines"]), x["instance"]) for x in (la[label], lb[label]))
            fa, fb = ea.get(ka), eb.get(kb)
            if fa is None or fb is None:
                print(f"not built: {label} {arch} ({'base' if fa is None else 'work tree'})")
                bad += 1
            elif fa["sha256"] != fb["sha256"] or fa["resources"] != fb["resources"]:
                print(f"differs: {label} {arch}\n  base {ka[2]}: {fa['resources']}\n  work {kb[2]}: {fb['resources']}")
                bad += 1
            else:
                same += 1
    print(f"{len(la)} call situations x {len(archs)} targets: {same} identical, {bad} differ or are missing")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="git revision to compare the work tree with")
    ap.add_argument("--archs", default="sm_90,sm_100")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--keep", help="folder for the two dumps (default: a temporary one, removed)")
    ap.add_argument("--only", help="regular expression: only the builds whose label (instance | codebooks) matches")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # internal: dump the kvcodec on sys.path here
    ap.add_argument("--diff", nargs=2, help="compare two dump folders")
    args = ap.parse_args()
    archs = args.archs.split(",")
    if args.dump:
        dump(Path(args.dump), archs, args.jobs, args.only)
        return 0
    if args.diff:
        return 1 if diff(Path(args.diff[0]), Path(args.diff[1])) else 0
    if not args.base:
        ap.error("--base REV (or --diff A B)")
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sass-identity-"))
    base_tree = keep / "base-tree"
    shutil.rmtree(base_tree, ignore_errors=True)
    base_tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "kvcodec"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive.stdout, check=True)
    for label, tree in (("base", base_tree), ("work", ROOT)):
        print(f"{label}: {tree}", flush=True)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, __file__, "--dump", str(keep / label), "--archs", args.archs, "--jobs", str(args.jobs)]
        subprocess.run(cmd + (["--only", args.only] if args.only else []), env=env, cwd=tree, check=True)
    bad = diff(keep / "base", keep / "work")
    if not args.keep:
        shutil.rmtree(keep, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
