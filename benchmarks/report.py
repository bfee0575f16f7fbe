"""Turn the benchmark JSON files into one report: ``benchmarks/results/REPORT.md`` (+ README).

    python benchmarks/report.py                    # REPORT.md from benchmarks/results/*.json
    python benchmarks/report.py --demo             # first run `kvcodec demo` and save demo.json
    python benchmarks/report.py --readme FILE      # also refresh FILE's results region (its markers)
    python benchmarks/report.py --results DIR      # another results folder

Every table is generated from the JSON (never typed by hand), with the machine and date that
produced it. A JSON file is a suite result: ``{"suite": str, "rows": [dict], "machine": dict,
"notes": [str]}``, optionally ``"columns"`` (table columns, in order), ``"plots"`` (PNG file
names in the same folder), ``"headline"`` (row indices or a row count for the README) and
``"quick"`` (true for a ``--quick`` smoke run: flagged in every table heading).

Rate-distortion overview: every row that has ``bits_per_value`` and ``attn_rel_err`` (relative
attention-output error on real SmolLM2 queries; ``K_bits_per_value``/``V_bits_per_value`` and
``attn_err_KV`` are read too) is one point of ``overview_rd.png``, on the curve of its
``family`` (default: its ``method`` without the bit width).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import save  # noqa: E402

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
OVERVIEW_PNG = "overview_rd.png"
MAX_COLUMNS = 12
README_ROWS = 8
# Suites shown first, in this order; any other suite follows alphabetically.
ORDER = ["demo", "bench_lossless", "bench_lossless_kv", "bench_quant", "bench_entropy", "bench_entropy_models", "bench_hf", "gpu_kernels", "gpu_hf_decode", "gpu_rans"]


def fmt(value) -> str:
    """A table cell: 4 significant digits, integers as they are, no float noise."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a" if value != value else ("inf" if value > 0 else "-inf")
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out) + "\n"


class ResultFileError(ValueError):
    """A results JSON file does not follow the suite schema."""


def validate(result: object, name: str = "result") -> dict:
    """Check the documented schema; return the result or raise ResultFileError saying what is wrong."""
    if not isinstance(result, dict):
        raise ResultFileError(f"{name}: top level must be an object")
    if not isinstance(result.get("suite"), str) or not result["suite"]:
        raise ResultFileError(f"{name}: 'suite' must be a non-empty string")
    rows = result.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ResultFileError(f"{name}: 'rows' must be a list of objects")
    if not isinstance(result.get("machine"), dict):
        raise ResultFileError(f"{name}: 'machine' must be an object")
    notes = result.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ResultFileError(f"{name}: 'notes' must be a list of strings")
    for key in ("columns", "plots"):
        if key in result and not (isinstance(result[key], list) and all(isinstance(c, str) for c in result[key])):
            raise ResultFileError(f"{name}: '{key}' must be a list of strings")
    return result


def load_results(results_dir: str | Path) -> tuple[list[dict], list[str]]:
    """All valid suite results in ``results_dir`` (sorted by ORDER) and a list of problems found."""
    results, problems = [], []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            validate(data, path.name)
        except (OSError, json.JSONDecodeError, ResultFileError) as exc:
            problems.append(f"{path.name}: skipped ({exc})")
            continue
        data["_file"] = path.name
        results.append(data)
    rank = {name: i for i, name in enumerate(ORDER)}
    results.sort(key=lambda r: (rank.get(r["suite"], len(ORDER)), r["suite"]))
    return results, problems


def table_columns(result: dict) -> list[str]:
    """The suite's own column list, else the row keys in first-seen order (scalars only, capped)."""
    if result.get("columns"):
        return result["columns"]
    cols: list[str] = []
    for row in result["rows"]:
        for key, value in row.items():
            if key not in cols and (value is None or isinstance(value, (int, float, str, bool))):
                cols.append(key)
    return cols[:MAX_COLUMNS]


def machine_line(machine: dict) -> str:
    """One line: date, CPU/GPU, cores and the versions that matter."""
    parts = []
    if machine.get("date"):
        parts.append(str(machine["date"]))
    if machine.get("gpu"):
        parts.append(f"GPU {machine['gpu']}")
    if machine.get("processor"):
        parts.append(f"CPU {machine['processor']}")
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    versions = machine.get("versions") or {}
    if versions:
        parts.append(", ".join(f"{k} {v}" for k, v in versions.items()))
    return "; ".join(parts) or "machine not recorded"


def plots_of(result: dict, results_dir: Path) -> list[str]:
    """PNG files of a suite that exist: its ``plots`` list plus ``<suite>*.png`` in the folder."""
    names = list(result.get("plots", []))
    names += [p.name for p in sorted(results_dir.glob(f"{result['suite']}*.png"))]
    seen: list[str] = []
    for n in names:
        if n not in seen and (results_dir / n).is_file():
            seen.append(n)
    return seen


def rd_points(results: list[dict]) -> list[tuple[str, str, float, float]]:
    """(suite, method, bits_per_value, attn_rel_err) of every row that has both numbers."""
    return [(suite, method, bits, err) for suite, method, _, bits, err in _rd_rows(results)]


_BITS_TOKEN = re.compile(r"\s*'?(\d+(\.\d+)?-?b(it)?|m=\d+d)'?(?!\w)")


def family_of(row: dict) -> str:
    """The curve a rate-distortion row belongs to: its ``family`` key, else its method name with
    the bit width taken out ("KIVI 2b (group 32)" -> "KIVI (group 32)")."""
    if isinstance(row.get("family"), str) and row["family"]:
        return row["family"]
    name = _BITS_TOKEN.sub("", str(row.get("method", "?"))).replace(" ,", ",").strip(" ,")
    return re.sub(r"\s+", " ", name) or "?"


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def rd_coordinates(row: dict) -> tuple[float | None, float | None]:
    """(bits per value, attention-output error) of a row, or None where absent. Accepts the
    documented keys and the K/V split some suites print: the mean of ``K_bits_per_value`` and
    ``V_bits_per_value`` (K and V have the same element count) and ``attn_err_KV``."""
    bits = _number(row.get("bits_per_value"))
    if bits is None:
        kb, vb = _number(row.get("K_bits_per_value")), _number(row.get("V_bits_per_value"))
        bits = (kb + vb) / 2 if kb is not None and vb is not None else None
    err = _number(row.get("attn_rel_err"))
    if err is None:
        err = _number(row.get("attn_err_KV"))
    return bits, err


def _rd_rows(results: list[dict]):
    for res in results:
        for row in res["rows"]:
            bits, err = rd_coordinates(row)
            if bits is not None and err is not None:
                yield res["suite"], str(row.get("method", "?")), family_of(row), float(bits), float(err)


# Which suite's rows draw the overview (others would duplicate the same methods): the first of
# these that has such rows, else any suite that has them.
LOSSY_SOURCES = ["bench_quant", "demo"]
EXACT_SOURCES = ["bench_lossless_kv", "bench_lossless", "demo"]


def _source(rows, lossy: bool, prefer: list[str]) -> str | None:
    have = {r[0] for r in rows if (r[4] > 0) == lossy}
    for name in prefer:
        if name in have:
            return name
    return min(have) if have else None


def plot_overview(results: list[dict], results_dir: Path) -> Path | None:
    """Rate-distortion chart (bits/value vs attention error, log scale) across every suite: one
    curve per method family; exact (lossless) methods as labelled squares on the bottom edge.
    None if no data or no matplotlib."""
    rows = list(_rd_rows(results))
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lossy_src = _source(rows, lossy=True, prefer=LOSSY_SOURCES)
    exact_src = _source(rows, lossy=False, prefer=EXACT_SOURCES)
    lossy = [r for r in rows if r[4] > 0 and r[0] == lossy_src]
    floor = min(r[4] for r in lossy) / 3 if lossy else 1e-3
    fig, ax = plt.subplots(figsize=(12, 5.5))
    curves: dict[str, list[tuple[float, float]]] = {}
    for _, _, family, bits, err in lossy:
        curves.setdefault(family, []).append((bits, err))
    colors = plt.get_cmap("tab20").colors
    for i, (label, pts) in enumerate(sorted(curves.items())):
        pts.sort()
        peer = "peer" in label.lower()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if peer else "o", ms=4,
                ls="--" if peer else "-", color=colors[i % len(colors)], label=label)
    rows = [r for r in rows if r[0] == exact_src]
    exact = sorted((bits, method) for _, method, _, bits, err in rows if err == 0)
    if exact:
        ax.scatter([b for b, _ in exact], [floor] * len(exact), marker="s", color="black", zorder=3,
                   label="exact (lossless): error 0")
        for i, (bits, method) in enumerate(exact):
            ax.annotate(method, (bits, floor), xytext=(0, 8 + 9 * (i % 3)), textcoords="offset points",
                        fontsize=6, rotation=0, ha="center")
    ax.set_yscale("log")
    ax.set_xlabel("true bits per value, every stored byte counted (bf16 = 16)")
    ax.set_ylabel("attention-output relative error (real queries)")
    sources = ", ".join(sorted({src for src in (lossy_src, exact_src) if src}))
    ax.set_title(f"Rate vs attention error on the real SmolLM2-135M KV cache ({sources})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    out = results_dir / OVERVIEW_PNG
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def run_line(result: dict) -> str:
    """The italic machine line under a suite heading, flagged when the run was ``--quick``."""
    line = f"*{machine_line(result['machine'])}*"
    return line + " **quick run: small inputs, not for comparison**" if result.get("quick") else line


def render_report(results: list[dict], results_dir: Path, problems: list[str] | None = None) -> str:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = [
        "# kvcodec benchmark report",
        "",
        f"Generated {now} by `python benchmarks/report.py` from the JSON files in this folder; "
        "every number below was measured by the suite named in its heading, on the machine listed "
        "under it. How to reproduce: `benchmarks/README.md`.",
        "",
    ]
    if (results_dir / OVERVIEW_PNG).is_file():
        out += ["## Overview", "", f"![rate vs attention error]({OVERVIEW_PNG})", ""]
    for res in results:
        out += [f"## {res['suite']}", "", f"{run_line(res)} (`{res['_file']}`)", ""]
        cols = table_columns(res)
        out.append(markdown_table(res["rows"], cols) if res["rows"] else "(no rows)\n")
        hidden = sorted({k for r in res["rows"] for k in r} - set(cols))
        if hidden and not res.get("columns"):
            out.append(f"(more columns in `{res['_file']}`: {', '.join(hidden)})\n")
        for note in res.get("notes", []):
            out.append(f"- {note}")
        if res.get("notes"):
            out.append("")
        for png in plots_of(res, results_dir):
            out += [f"![{png}]({png})", ""]
    if problems:
        out += ["## Files not included", ""] + [f"- {p}" for p in problems] + [""]
    return "\n".join(out).rstrip() + "\n"


def _headline_rows(res: dict) -> list[dict]:
    head = res.get("headline")
    rows = res["rows"]
    if isinstance(head, list) and all(isinstance(i, int) and 0 <= i < len(rows) for i in head):
        return [rows[i] for i in head]
    if isinstance(head, int) and head > 0:
        return rows[:head]
    return rows[:README_ROWS]


def render_readme_section(results: list[dict], report_link: str = "benchmarks/results/REPORT.md",
                          overview_link: str | None = None) -> str:
    """The README's results region: the headline rows of each suite, machine and a report link."""
    out = ["## Results", "", f"Generated by `python benchmarks/report.py --readme`; all tables and plots: "
           f"[{report_link}]({report_link}).", ""]
    if overview_link:
        out += [f"![rate vs attention error]({overview_link})", ""]
    for res in results:
        if not res["rows"]:
            continue
        rows = _headline_rows(res)
        more = len(res["rows"]) - len(rows)
        out += [f"### {res['suite']}", "", run_line(res), ""]
        out.append(markdown_table(rows, table_columns(res)))
        if more > 0:
            out.append(f"({more} more rows in the report)\n")
    return "\n".join(out).rstrip() + "\n"


def replace_region(text: str, new_body: str) -> str:
    """``text`` with everything strictly between the results markers replaced by ``new_body``.
    ValueError unless each marker occurs exactly once, begin before end."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README must contain {BEGIN} and {END} exactly once each")
    start = text.index(BEGIN) + len(BEGIN)
    stop = text.index(END)
    if stop < start:
        raise ValueError(f"{END} comes before {BEGIN}")
    return text[:start] + "\n" + new_body.rstrip("\n") + "\n" + text[stop:]


def run_demo_suite(results_dir: Path, quick: bool = False) -> Path:
    """Run ``kvcodec demo`` and store its rows as the ``demo`` suite (for the report and overview)."""
    from kvcodec.demo import run_demo

    demo = run_demo(quick=quick)
    result = {
        "suite": "demo",
        "quick": quick,
        "rows": demo["rows"],
        "notes": demo["notes"],
        "columns": demo["columns"],
    }
    return save(result, results_dir, columns=demo["columns"])


def _relative_link(target: Path, readme: Path) -> str:
    try:
        return target.resolve().relative_to(readme.resolve().parent).as_posix()
    except ValueError:
        return target.resolve().as_posix()


def build(results_dir: str | Path = "benchmarks/results", readme: str | Path | None = None,
          demo: bool = False, quick: bool = False) -> Path:
    """Write REPORT.md (and the overview plot) for ``results_dir``; with ``readme``, refresh that
    README's results region. Returns the report path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    if demo:
        run_demo_suite(results_dir, quick=quick)
    results, problems = load_results(results_dir)
    plot_overview(results, results_dir)
    report = results_dir / "REPORT.md"
    report.write_text(render_report(results, results_dir, problems))
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    print(f"wrote {report} ({len(results)} suites)")
    if readme is not None:
        readme = Path(readme)
        link = _relative_link(report, readme)
        overview = results_dir / OVERVIEW_PNG
        overview_link = _relative_link(overview, readme) if overview.is_file() else None
        readme.write_text(replace_region(readme.read_text(), render_readme_section(results, link, overview_link)))
        print(f"updated the results region of {readme}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of suite JSON files")
    parser.add_argument("--readme", default=None, metavar="PATH",
                        help="also replace the results region (between the results markers) of this markdown file")
    parser.add_argument("--demo", action="store_true", help="run `kvcodec demo` first and save demo.json")
    parser.add_argument("--quick", action="store_true", help="with --demo: the quick demo")
    args = parser.parse_args(argv)
    build(args.results, args.readme, demo=args.demo, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
