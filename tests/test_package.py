import subprocess
import sys


import kvcodec
from kvcodec.cli import build_parser


def test_error_class_is_a_value_error():
    assert issubclass(kvcodec.CorruptStreamError, ValueError)


def test_cli_lists_every_command():
    text = build_parser().format_help()
    for cmd in ("demo", "bench", "compress", "decompress", "inspect"):
        assert cmd in text


def test_cli_unknown_command_fails():
    proc = subprocess.run([sys.executable, "-m", "kvcodec.cli", "nosuchcommand"], capture_output=True)
    assert proc.returncode != 0
