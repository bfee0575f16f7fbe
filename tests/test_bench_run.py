"""``python benchmarks/run.py`` writes schema-valid JSON for every suite present; report.py renders it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "run.py"
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks import run as runner  # noqa: E402
from benchmarks.common import save  # noqa: E402


def _present(suite: str) -> bool:
    return all((ROOT / "benchmarks" / f"{m}.py").is_file() for m in runner.SUITES[suite])


def _suite_files(root: Path) -> dict:
    """Every ``bench_quant.*`` file and results folder under ``root`` with its modification time."""
    found = [*root.rglob("bench_quant.*"), *root.rglob("kvcodec-bench-results")]
    return {p: p.stat().st_mtime_ns for p in found if "tests" not in p.relative_to(root).parts}


def test_run_writes_only_where_told_and_marks_quick_runs(tmp_path):
    """``python benchmarks/run.py --out DIR`` from another folder: results land in DIR only (not in the
    cwd, not over the checkout's committed results), the JSON says quick, the path is printed."""
    cwd, out = tmp_path / "cwd", tmp_path / "my results"
    cwd.mkdir()
    before = _suite_files(ROOT)
    proc = subprocess.run(
        [sys.executable, str(RUNNER), "--suite", "quant", "--quick", "--out", str(out)],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench_quant.json", "bench_quant.md", "bench_quant.png"]
    assert list(cwd.iterdir()) == []
    assert _suite_files(ROOT) == before  # the committed benchmarks/results/bench_quant.* untouched
    data = report.validate(json.loads((out / "bench_quant.json").read_text()))
    assert data["quick"] is True and data["rows"]
    assert f"results go to {out}" in proc.stdout and f"in {out}" in proc.stdout.splitlines()[-1]
    report.build(out)
    assert "quick run: small inputs" in (out / "REPORT.md").read_text()


def test_default_folder_is_in_the_cwd_outside_the_checkout():
    args = runner.build_parser().parse_args(["--suite", "quant"])
    assert args.out == runner.DEFAULT_OUT == "kvcodec-bench-results"
    assert not Path(args.out).is_absolute()  # resolved against the user's working folder


def test_a_failing_suite_fails_the_run_and_the_others_still_write(tmp_path, monkeypatch, capsys):
    """Exit code 1 when a suite raises; the next suite still runs, and only the files this run wrote
    are stamped ``"quick"`` (a file already in the folder and left alone keeps what it says)."""
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "bench_raises.py").write_text("def run(quick, out_dir):\n    raise RuntimeError('broken suite')\n")
    (suites / "bench_writes.py").write_text(
        "import json, pathlib\n"
        "def run(quick, out_dir):\n"
        "    pathlib.Path(out_dir, 'bench_writes.json').write_text(json.dumps({'suite': 'bench_writes', 'rows': []}))\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "older.json").write_text(json.dumps({"suite": "older", "rows": [], "quick": True}))
    monkeypatch.syspath_prepend(str(suites))
    monkeypatch.setitem(runner.SUITES, "pair", ["bench_raises", "bench_writes"])
    assert runner.run_bench(suite="pair", quick=False, out_dir=out) == 1
    text = capsys.readouterr().out
    assert "bench_raises FAILED" in text and "wrote bench_writes.json in" in text
    assert json.loads((out / "bench_writes.json").read_text())["quick"] is False
    assert json.loads((out / "older.json").read_text())["quick"] is True


CPU_SUITES = [s for s in runner.SUITES if s not in ("gpu", "quant")]  # quant: the subprocess test above


@pytest.mark.slow
@pytest.mark.parametrize("suite", CPU_SUITES)
def test_bench_suite_quick_writes_valid_json(suite, tmp_path, capsys):
    """Each CPU suite's quick run, in this process (the hf suite shares the SmolLM2 model the
    other tests load): valid result files, stamped quick, rendered by report.py."""
    if not _present(suite):
        pytest.skip(f"benchmarks for suite {suite!r} are not written yet")
    assert runner.run_bench(suite=suite, quick=True, out_dir=tmp_path) == 0, capsys.readouterr().out[-3000:]
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) >= len(runner.SUITES[suite])
    for f in files:
        data = report.validate(json.loads(f.read_text()), f.name)
        assert data["rows"], f"{f.name} has no rows"
        assert data["quick"] is True
        assert "date" in data["machine"] and "cores" in data["machine"]
        for png in data.get("plots", []):
            assert (tmp_path / png).is_file(), f"{f.name} promises {png}"
    report.build(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    for f in files:
        assert f"## {json.loads(f.read_text())['suite']}" in text
    if suite == "hf":  # the lossless cache scores exactly what the bf16 cache scores, quick or not
        lossless = [r for r in json.loads((tmp_path / "bench_hf.json").read_text())["rows"]
                    if r["cache"] == "kvcodec/lossless"]
        assert lossless and all(r["ppl_delta_pct"] == 0 and r["top1_agree"] == 1 for r in lossless), lossless


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_gpu_quick(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # $OUT would also receive the results
    proc = subprocess.run(
        [sys.executable, str(RUNNER), "--suite", "gpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for f in tmp_path.glob("*.json"):
        report.validate(json.loads(f.read_text()), f.name)


def test_bench_unknown_suite_fails():
    with pytest.raises(SystemExit):
        runner.run_bench(suite="nosuchsuite", quick=True, out_dir="unused")
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args(["--suite", "nosuchsuite"])


# ---- report.py on hand-made result files (the renderer, not the numbers, is under test) ----


def _write_suite(out, name, rows, **extra):
    result = {"suite": name, "rows": rows, "notes": [f"{name} note"], **extra}
    return save(result, out)


def test_report_renders_tables_machine_and_plots(tmp_path):
    _write_suite(tmp_path, "bench_quant", [
        {"method": "TurboQuant-MSE 4b", "bits_per_value": 4.25, "attn_rel_err": 0.05},
        {"method": "TurboQuant-MSE 2b", "bits_per_value": 2.25, "attn_rel_err": 0.3},
        {"method": "KIVI 4b", "bits_per_value": 5.0, "attn_rel_err": 0.04},
    ], plots=["bench_quant_rd.png"])
    (tmp_path / "bench_quant_rd.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    _write_suite(tmp_path, "bench_lossless", [{"method": "kvctx", "bits_per_value": 10.5, "attn_rel_err": 0.0}])
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text(json.dumps({"suite": "x", "rows": "nope", "machine": {}}))
    report.build(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert text.index("## bench_lossless") < text.index("## bench_quant")  # documented order
    assert "| TurboQuant-MSE 4b | 4.25 | 0.05 |" in text
    assert "bench_quant note" in text and "![bench_quant_rd.png](bench_quant_rd.png)" in text
    assert "cores" in text  # the machine line
    assert "broken.json: skipped" in text and "wrong.json: skipped" in text
    assert (tmp_path / report.OVERVIEW_PNG).stat().st_size > 1000
    assert f"![rate vs attention error]({report.OVERVIEW_PNG})" in text
    points = report.rd_points(report.load_results(tmp_path)[0])
    assert ("bench_lossless", "kvctx", 10.5, 0.0) in points and len(points) == 4


def test_report_updates_only_the_readme_region(tmp_path):
    results = tmp_path / "results"
    _write_suite(results, "bench_entropy", [{"coder": f"c{i}", "bits_per_symbol": 5.0 + i} for i in range(12)])
    readme = tmp_path / "README.md"
    before, after = "# title\n\ntext before\n\n", "\n\ntext after\n"
    readme.write_text(before + report.BEGIN + "\nold stuff\n" + report.END + after)
    report.build(results, readme=readme)
    text = readme.read_text()
    assert text.startswith(before + report.BEGIN) and text.endswith(report.END + after)
    assert "old stuff" not in text and "| c0 | 5 |" in text
    assert "(4 more rows in the report)" in text and "(results/REPORT.md)" in text
    report.build(results, readme=readme)  # idempotent
    assert readme.read_text() == text


def test_replace_region_needs_both_markers_once():
    with pytest.raises(ValueError):
        report.replace_region("no markers", "x")
    with pytest.raises(ValueError):
        report.replace_region(report.END + report.BEGIN, "x")
    with pytest.raises(ValueError):
        report.replace_region(report.BEGIN + report.BEGIN + report.END, "x")
    assert report.replace_region(f"a{report.BEGIN}b{report.END}c", "new") == f"a{report.BEGIN}\nnew\n{report.END}c"


def test_cell_format():
    assert [report.fmt(v) for v in (3, 86.0641, 1172.83, 0.000567512, 0.0, float("nan"), None, True, "a|b")] == [
        "3", "86.06", "1173", "0.0005675", "0", "n/a", "", "True", "a\\|b"]


def test_validate_rejects_bad_results():
    good = {"suite": "s", "rows": [{"a": 1}], "machine": {}, "notes": []}
    assert report.validate(good) is good
    for bad in ({**good, "suite": ""}, {**good, "rows": [1]}, {**good, "machine": None},
                {**good, "notes": [3]}, {**good, "plots": "x.png"}, []):
        with pytest.raises(report.ResultFileError):
            report.validate(bad)


def test_family_groups_bit_widths_of_one_method():
    names = ["KIVI 2b (group 32)", "KIVI 4b (group 32)", "TurboQuant outlier split '2.5-bit' (paper)",
             "QJL m=4d K, TurboQuant-MSE 4b V"]
    assert [report.family_of({"method": n}) for n in names] == [
        "KIVI (group 32)", "KIVI (group 32)", "TurboQuant outlier split (paper)", "QJL K, TurboQuant-MSE V"]
    assert report.family_of({"method": "x 2b", "family": "mine"}) == "mine"


def test_rd_coordinates_read_the_kv_split_keys():
    assert report.rd_coordinates({"bits_per_value": 4.0, "attn_rel_err": 0.1}) == (4.0, 0.1)
    assert report.rd_coordinates({"K_bits_per_value": 4.0, "V_bits_per_value": 3.0, "attn_err_KV": 0.2}) == (3.5, 0.2)
    assert report.rd_coordinates({"bits_per_value": float("nan"), "attn_rel_err": 0.1}) == (None, 0.1)
    assert report.rd_coordinates({"method": "x"}) == (None, None)


def test_plots_are_skipped_with_a_hint_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    """The tables and JSON never need matplotlib: without it a suite draws nothing, says why and
    names the extra, and ``benchmarks/run.py`` lists only the files that exist."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_quant
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    bench_quant.plot([], tmp_path / "bench_quant.png")
    assert not (tmp_path / "bench_quant.png").exists()
    assert "no bench_quant.png: matplotlib is not installed; pip install 'kvcodec[bench]'" in capsys.readouterr().out
