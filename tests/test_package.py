import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvcodec
from kvcodec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_error_class_is_a_value_error():
    assert issubclass(kvcodec.CorruptStreamError, ValueError)


def test_cli_lists_every_command():
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("demo", "compress", "decompress", "inspect"):
        assert cmd in text
    with pytest.raises(SystemExit):  # the benchmark runner is benchmarks/run.py in a checkout
        parser.parse_args(["bench"])


def _checkout_files(folder: Path) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="building a wheel needs setuptools")
def test_the_wheel_ships_the_library_and_not_the_lab(tmp_path):
    """A wheel built from a copy of this checkout holds exactly the files under kvcodec/ (modules, kernel
    sources, the KV sample and fit) and one console script; nothing of benchmarks/ or tests/ (the
    SmolLM2 loader, the calibration script, the suite runner, the CUDA test cases) goes in."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis", "results",
        ".whl", ".gpu_out", "kvcodec-bench-results"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("kvcodec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
        scripts = z.read(f"{info}/entry_points.txt").decode()
        shipped = {n: z.read(n) for n in names if not n.startswith(info + "/")}
    assert set(shipped) == _checkout_files(ROOT / "kvcodec")
    assert "kvcodec/data/smollm2_kv.npz" in shipped and "kvcodec/quant/cuda/tq_pack.cu" in shipped
    lab = {p.read_bytes(): p.name for folder in ("benchmarks", "tests") for p in (ROOT / folder).glob("*.py")}
    assert {"smollm2.py", "calibrate_smollm2.py", "run.py", "cuda_cases.py"} <= set(lab.values())
    copied = sorted(f"{name} = {lab[data]}" for name, data in shipped.items() if data.strip() and data in lab)
    assert not copied, f"lab files in the wheel: {copied}"
    assert [line for line in scripts.splitlines() if "=" in line] == ["kvcodec = kvcodec.cli:main"]


def test_cli_unknown_command_fails():
    proc = subprocess.run([sys.executable, "-m", "kvcodec.cli", "nosuchcommand"], capture_output=True)
    assert proc.returncode != 0


def test_every_magic_comes_from_kvcodec_magics():
    """The writers use the one table in kvcodec.magics; the leading magics tell objects apart."""
    import torch

    from kvcodec import container, magics
    from kvcodec.entropy import stream
    from kvcodec.lossless import files

    assert (container.MAGIC, stream.MAGIC) == (magics.CONTAINER, magics.STREAM)
    assert (files.FILE_MAGIC, files.FOOTER_MAGIC) == (magics.FILE, magics.FILE_FOOTER)
    assert len(magics.LEADING) == 3 and all(len(m) == 4 for m in magics.LEADING)
    assert kvcodec.compress(torch.arange(8, dtype=torch.float32))[:4] in magics.LEADING
    assert kvcodec.entropy.encode(torch.arange(64, dtype=torch.uint8).numpy())[:4] == magics.STREAM
