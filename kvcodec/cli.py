"""The ``kvcodec`` command line: demo, bench, compress, decompress, inspect."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvcodec.demo import run_demo

    run_demo(quick=args.quick)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvcodec.benchrunner import run_bench

    return run_bench(suite=args.suite, quick=args.quick, out_dir=args.out)


def _cmd_compress(args: argparse.Namespace) -> int:
    from kvcodec.lossless.files import compress_file

    compress_file(args.input, args.output, threads=args.threads, progress=not args.quiet)
    return 0


def _cmd_decompress(args: argparse.Namespace) -> int:
    from kvcodec.lossless.files import decompress_file

    decompress_file(args.input, args.output, threads=args.threads, progress=not args.quiet)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvcodec.lossless.files import inspect_file, format_inspect_table

    print(format_inspect_table(inspect_file(args.file)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcodec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="compress the embedded real SmolLM2 KV sample with every codec")
    p.add_argument("--quick", action="store_true", help="fewer layers (used by the tests)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="run benchmark suites (needs a source checkout)")
    p.add_argument("--suite", default="all", help="entropy|lossless|quant|hf|gpu|all")
    p.add_argument("--quick", action="store_true", help="small inputs, for a smoke run")
    p.add_argument("--out", default="benchmarks/results", help="output folder for JSON, markdown and PNG")
    p.set_defaults(func=_cmd_bench)

    for name, func, helptext in (
        ("compress", _cmd_compress, "losslessly compress a .safetensors file into a .kvc file"),
        ("decompress", _cmd_decompress, "restore the original .safetensors file byte for byte"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("input")
        p.add_argument("output")
        p.add_argument("--threads", type=int, default=0, help="0 = all cores")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=func)

    p = sub.add_parser("inspect", help="per-tensor ratio table of a kvcodec file")
    p.add_argument("file")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvcodec.errors import CorruptStreamError

    try:
        return int(args.func(args) or 0)
    except CorruptStreamError as exc:
        print(f"kvcodec: corrupt input: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(f"kvcodec: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
