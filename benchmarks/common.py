"""Shared helpers for the benchmark suites: machine record, timing, tables, JSON.

Every suite returns a dict ``{"suite": name, "rows": [...], "notes": [...]}`` (plus ``"quick": bool``
for a smoke run); ``save`` adds the machine record and writes ``<out>/<suite>.json`` and
``<out>/<suite>.md``. Results go to ``DEFAULT_OUT`` (``./kvcodec-bench-results``) unless the caller
names a folder: the committed ``benchmarks/results`` is only written when asked for by name.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from kvcodec.demo import cpu_name

DEFAULT_OUT = "kvcodec-bench-results"  # relative: a folder in the directory the command runs in


def machine_record() -> dict:
    """What ran the benchmark: CPU, cores, GPU if any, and package versions."""
    rec = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": cpu_name(),
        "cores": os.cpu_count(),
        "versions": {},
    }
    for mod in ("numpy", "numba", "torch", "zstandard", "transformers", "cupy", "constriction", "zipnn"):
        try:
            rec["versions"][mod] = __import__(mod).__version__
        except Exception:  # a peer that is not installed is simply not recorded
            pass
    try:
        import torch

        if torch.cuda.is_available():
            rec["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return rec


def best_time(fn, *, repeat: int = 5, min_time: float = 0.0) -> float:
    """Best wall time of ``repeat`` calls (seconds); one untimed warm-up call first (JIT)."""
    fn()
    best = float("inf")
    t_end = time.perf_counter() + min_time
    n = 0
    while n < repeat or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0].keys())
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}"
        return f"{v:.4g}"
    return str(v)


def save(result: dict, out_dir: str | os.PathLike, columns: list[str] | None = None) -> Path:
    """Write ``<suite>.json`` (rows + machine) and ``<suite>.md``; print the table. Returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(result)
    result.setdefault("machine", machine_record())
    result.setdefault("notes", [])
    name = result["suite"]
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    table = markdown_table(result["rows"], columns)
    md = f"## {name}\n\n{table}\n" + "".join(f"- {n}\n" for n in result["notes"])
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"-> {path.resolve()}", flush=True)
    return path



def pyplot(path: str | os.PathLike):
    """matplotlib.pyplot on the Agg backend, or None after saying that ``path`` is not drawn
    (matplotlib comes with the ``bench`` extra; the tables and JSON never need it)."""
    try:
        import matplotlib
    except ImportError:
        print(f"(no {Path(path).name}: matplotlib is not installed; pip install 'kvcodec[bench]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_with_out(result: dict, out_dir: str | os.PathLike, columns: list[str] | None = None) -> None:
    """``save`` into ``out_dir`` and, when set, into ``$OUT`` too (the device machine sends back only
    what lands under ``$OUT``)."""
    for d in dict.fromkeys(filter(None, (str(out_dir), os.environ.get("OUT")))):
        save(result, d, columns=columns)

def constriction_categorical(symbols, probs, repeat: int = 5):
    """Time constriction's stack ANS and queue range coder on one categorical model.

    ``symbols``: int32 indices into ``probs``. Yields ``(name, compressed_bytes, encode_s,
    decode_s)`` after checking that each coder decodes the input exactly; yields nothing when
    constriction is not installed. The model itself is not counted (constriction has no stream
    format).
    """
    try:
        import constriction
    except ImportError:
        return
    import numpy as np

    model = constriction.stream.model.Categorical(np.asarray(probs, dtype=np.float64), perfect=False)
    n = symbols.size
    stack, queue = constriction.stream.stack, constriction.stream.queue

    def ans_encode():
        coder = stack.AnsCoder()
        coder.encode_reverse(symbols, model)
        return coder.get_compressed()

    def range_encode():
        coder = queue.RangeEncoder()
        coder.encode(symbols, model)
        return coder.get_compressed()

    for name, encode, decoder in (("constriction ANS", ans_encode, stack.AnsCoder),
                                  ("constriction range", range_encode, queue.RangeDecoder)):
        comp = encode()
        if not np.array_equal(decoder(comp).decode(model, n), symbols):
            raise AssertionError(f"{name} did not decode its own output")
        yield (name, comp.nbytes, best_time(encode, repeat=repeat),
               best_time(lambda: decoder(comp).decode(model, n), repeat=repeat))
