"""The ``kvcodec`` command line: demo, compress, decompress, inspect.

Rules every command follows (those of ``kvcodec.safe_write``): an existing file is never
overwritten without ``--force``, and never the input itself, a symbolic link or a file with other
hard links; output is written to a temporary file beside the target, fsync'ed and renamed into
place only once complete, so a failure (full disk, Ctrl-C, kill -9, corrupt input) leaves the old
file or nothing; errors name the user's paths, never a temporary one; success prints one summary
line; a bad argument prints one line. Exit codes: 0 success, 2 bad arguments, bad input or a
refused/failed write, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

DESCRIPTION = (
    "Compress LLM KV caches and weights. 'kvcodec demo' shows every codec on a real KV cache; "
    "'kvcodec compress' / 'decompress' turn a .safetensors file into a .kvc file and back, bit for bit; "
    "'kvcodec inspect' says what a kvcodec file is and checks it (--verify). "
    "Run 'kvcodec COMMAND --help' for a command's options."
)


class CliError(Exception):
    """A refusal or failure to report to the user as one line, exit code 2."""


def version() -> str:
    """The installed distribution's version (the package's own if run from a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version("kvcodec")
    except metadata.PackageNotFoundError:
        from kvcodec import __version__

        return __version__


# ----------------------------------------------------------------------------------- output files
def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


@contextlib.contextmanager
def _writing(src: Path, dst: Path, force: bool):
    """Check ``dst`` by kvcodec.safe_write's rules now (before any work), and turn its refusals and
    write errors inside the block into one-line CliErrors naming ``dst``."""
    from kvcodec.errors import WriteRefusedError
    from kvcodec.safe_write import check_target

    try:
        check_target(dst, overwrite=force, inputs=(src,))
        yield
    except WriteRefusedError as exc:
        if exc.reason == "exists":
            raise CliError(f"{dst} already exists; pass --force to overwrite it") from None
        raise CliError(str(exc)) from None
    except OSError as exc:
        if exc.filename != str(dst):
            raise  # an error about another file (the input): its own message names it
        raise CliError(f"cannot write {dst}: {exc.strerror or exc}") from None


def _summary(verb: str, src: Path, dst: Path, n_in: int, n_out: int, raw: int, seconds: float, extra: str = "") -> str:
    ratio = max(n_in, n_out) / min(n_in, n_out) if min(n_in, n_out) else float("nan")
    speed = raw / 1e6 / seconds if seconds > 0 else float("inf")
    return (f"{verb} {src} -> {dst}: {_size(n_in)} -> {_size(n_out)}, ratio {ratio:.3f}x{extra}, "
            f"{speed:.1f} MB/s, {seconds:.2f} s")


# ----------------------------------------------------------------------------------- commands
def _cmd_demo(args: argparse.Namespace) -> int:
    from kvcodec.demo import run_demo

    run_demo(quick=args.quick)
    return 0


def _input(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CliError(f"{p} does not exist")
    if p.is_dir():
        raise CliError(f"{p} is a folder, not a file")
    return p


def _cmd_compress(args: argparse.Namespace) -> int:
    from kvcodec.errors import CorruptStreamError
    from kvcodec.inspection import identify
    from kvcodec.lossless.files import compress_file

    src, dst = _input(args.input), Path(args.output)
    with contextlib.suppress(CorruptStreamError):
        fmt = identify(src)
        raise CliError(f"{src} is already a kvcodec file: {fmt.description}")
    t0 = time.perf_counter()
    with _writing(src, dst, args.force):
        info = compress_file(src, dst, threads=args.threads, progress=not args.quiet, overwrite=args.force)
    seconds = time.perf_counter() - t0
    if not args.quiet:
        print(_summary("compressed", src, dst, info["source_bytes"], info["compressed_bytes"],
                       info["source_bytes"], seconds, f", {info['tensors']} tensors"))
    return 0


def _cmd_decompress(args: argparse.Namespace) -> int:
    from kvcodec.inspection import identify
    from kvcodec.lossless.files import decompress_file

    src, dst = _input(args.input), Path(args.output)
    fmt = identify(src)
    if fmt.key != "kvc":
        raise CliError(f"{src} is a {fmt.description}; 'kvcodec decompress' restores .kvc files made by "
                       "'kvcodec compress' ('kvcodec inspect' shows what this file holds)")
    t0 = time.perf_counter()
    with _writing(src, dst, args.force):
        info = decompress_file(src, dst, threads=args.threads, progress=not args.quiet,
                               max_output_bytes=args.max_output, overwrite=args.force)
    seconds = time.perf_counter() - t0
    if not args.quiet:
        print(_summary("restored", src, dst, src.stat().st_size, info["bytes"], info["bytes"], seconds))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvcodec import inspection

    path = _input(args.file)
    t0 = time.perf_counter()
    fmt = inspection.identify(path)
    print(f"{path}: {fmt.description}, {_size(path.stat().st_size)}")
    report = inspection.describe(path, fmt.key, verify=args.verify, threads=args.threads,
                                 max_output_bytes=args.max_output)
    if report.table:
        print(report.table)
    if args.verify:
        print(f"verified {path}: {report.verified} ({time.perf_counter() - t0:.2f} s)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is reported in one line (exit 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all cores) or a positive number of threads, got {text!r}")
    return n


def _size_arg(text: str) -> int:
    from kvcodec.validate import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_max_output(p: argparse.ArgumentParser) -> None:
    from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES

    p.add_argument("--max-output", type=_size_arg, default=DEFAULT_MAX_OUTPUT_BYTES, metavar="SIZE",
                   help="refuse files that restore to more than SIZE bytes (default 4G; e.g. 64G for a "
                        "big model you trust): a tiny hostile file could otherwise fill the disk")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcodec", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvcodec {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", help="compress the real SmolLM2 KV sample that ships with kvcodec, with every codec")
    p.add_argument("--quick", action="store_true", help="two layers only (used by the tests)")
    p.set_defaults(func=_cmd_demo)

    for name, func, helptext in (
        ("compress", _cmd_compress, "losslessly compress a .safetensors file into a .kvc file"),
        ("decompress", _cmd_decompress, "restore the original .safetensors file, byte for byte, from a .kvc file"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("input")
        p.add_argument("output")
        p.add_argument("--force", action="store_true", help="overwrite the output if it exists (never the input)")
        p.add_argument("--threads", type=_threads, default=0, help="threads to use (default 0: all cores)")
        p.add_argument("--quiet", action="store_true", help="print nothing on success (no progress bar, no summary)")
        if name == "decompress":
            _add_max_output(p)
        p.set_defaults(func=func)

    p = sub.add_parser("inspect", help="say what a kvcodec file is and what it holds",
                       description="Say which kvcodec format a file is and what it holds; --verify checks it.")
    p.add_argument("file")
    p.add_argument("--verify", action="store_true",
                   help="check every checksum (decoding every record); exit 2 if anything is corrupt")
    p.add_argument("--threads", type=_threads, default=0, help="threads for --verify (default 0: all cores)")
    _add_max_output(p)
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvcodec.errors import CorruptStreamError

    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"kvcodec: {exc}", file=sys.stderr)
        return 2
    except CorruptStreamError as exc:
        subject = getattr(args, "input", None) or getattr(args, "file", None)
        said = str(exc).startswith(str(subject))  # the message names the file already
        print(f"kvcodec: {exc}" if said else f"kvcodec: corrupt input {subject}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvcodec: {exc.strerror or exc}: {exc.filename}" if exc.filename else f"kvcodec: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("kvcodec: out of memory", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcodec: interrupted; no output was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
