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
