"""safetensors <-> .kvc files and the CLI: byte-identical restores, per-tensor access, damage detection."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvcodec import CorruptStreamError
from kvcodec.cli import main
from kvcodec.lossless import files


def _write_model(path, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "layer.0.weight": (torch.randn(256, 96, generator=g) * 0.02).to(dtype),
        "layer.0.bias": torch.randn(96, generator=g).to(dtype),
        "emb.weight": (torch.randn(300, 64, generator=g) * 0.05).to(torch.float32),
        "fp16.weight": torch.randn(64, 64, generator=g).to(torch.float16),
        "fp8.weight": torch.randn(128, 64, generator=g).to(torch.float8_e4m3fn),
        "ids": torch.arange(3000, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, str(path), metadata={"format": "pt", "note": "kvcodec test"})
    return tensors


def _same_tensor(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes())


def test_round_trip_is_byte_identical_and_tensors_addressable(tmp_path):
    src, kvc, out = tmp_path / "m.safetensors", tmp_path / "m.kvc", tmp_path / "back.safetensors"
    tensors = _write_model(src)
    summary = files.compress_file(src, kvc, progress=False)
    assert summary["tensors"] == len(tensors) and summary["compressed_bytes"] == kvc.stat().st_size
    assert kvc.stat().st_size < src.stat().st_size
    files.decompress_file(kvc, out, progress=False)
    assert out.read_bytes() == src.read_bytes()
    for name, t in tensors.items():
        assert _same_tensor(files.read_tensor(kvc, name), t), name
    assert dict(files.iter_tensors(kvc)).keys() == tensors.keys()
    with pytest.raises(KeyError):
        files.read_tensor(kvc, "missing")


def test_inspect_rows_and_table(tmp_path):
    src, kvc = tmp_path / "m.safetensors", tmp_path / "m.kvc"
    tensors = _write_model(src)
    files.compress_file(src, kvc, progress=False)
    rows = files.inspect_file(kvc)
    assert {r["name"] for r in rows} == set(tensors)
    big = next(r for r in rows if r["name"] == "layer.0.weight")
    assert big["codec"] == "planes" and big["raw_bytes"] == 256 * 96 * 2 and big["ratio"] > 1.3
    assert next(r for r in rows if r["name"] == "scalar")["codec"] == "stored"
    table = files.format_inspect_table(rows)
    assert "layer.0.weight" in table and "TOTAL" in table and "planes" in table


def test_cli_round_trip_and_inspect(tmp_path, capsys):
    src, kvc, out = tmp_path / "m.safetensors", tmp_path / "m.kvc", tmp_path / "o.safetensors"
    _write_model(src)
    assert main(["compress", str(src), str(kvc), "--quiet", "--threads", "2"]) == 0
    assert main(["decompress", str(kvc), str(out), "--quiet"]) == 0
    assert out.read_bytes() == src.read_bytes()
    assert main(["inspect", str(kvc)]) == 0
    assert "layer.0.weight" in capsys.readouterr().out


def test_cli_reports_corrupt_and_missing_input(tmp_path, capsys):
    junk = tmp_path / "junk.kvc"
    junk.write_bytes(b"definitely not a kvcodec file" * 10)
    assert main(["decompress", str(junk), str(tmp_path / "o"), "--quiet"]) == 2
    assert main(["compress", str(junk), str(tmp_path / "o.kvc"), "--quiet"]) == 2
    assert main(["inspect", str(tmp_path / "nope.kvc")]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.kvc").exists()


def test_gaps_and_unusual_layout_are_kept_byte_exact(tmp_path):
    # hand-built safetensors: unsorted header keys, a gap between tensors, trailing bytes,
    # an unknown dtype code and header padding spaces
    a = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    a_bytes = a.view(torch.uint8).numpy().tobytes()
    header = {
        "z_second": {"dtype": "BF16", "shape": [64, 64], "data_offsets": [len(a_bytes) + 40, 2 * len(a_bytes) + 40]},
        "a_first": {"dtype": "BF16", "shape": [64, 64], "data_offsets": [0, len(a_bytes)]},
        "odd": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [2 * len(a_bytes) + 40, 2 * len(a_bytes) + 43]},
        "__metadata__": {"k": "v"},
    }
    hbytes = json.dumps(header).encode() + b"    "
    data = a_bytes + bytes(range(40)) + a_bytes + b"\x01\x02\x03" + b"trailing"
    src = tmp_path / "odd.safetensors"
    src.write_bytes(struct.pack("<Q", len(hbytes)) + hbytes + data)
    kvc, out = tmp_path / "odd.kvc", tmp_path / "odd_back.safetensors"
    files.compress_file(src, kvc, progress=False)
    files.decompress_file(kvc, out, progress=False)
    assert out.read_bytes() == src.read_bytes()
    assert _same_tensor(files.read_tensor(kvc, "z_second"), a)
    assert files.read_tensor(kvc, "odd").tolist() == [1, 2, 3]


def test_damaged_files_raise_corrupt_stream_error(tmp_path):
    src, kvc = tmp_path / "m.safetensors", tmp_path / "m.kvc"
    _write_model(src)
    files.compress_file(src, kvc, progress=False)
    blob = kvc.read_bytes()
    bad = tmp_path / "bad.kvc"
    rng = np.random.default_rng(1)
    cases = [blob[: len(blob) // 2], blob[:-1], blob[:30], b""]
    for _ in range(12):  # flips anywhere: records, index, footer
        b = bytearray(blob)
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        cases.append(bytes(b))
    for case in cases:
        bad.write_bytes(case)
        with pytest.raises(CorruptStreamError):
            files.decompress_file(bad, tmp_path / "x.safetensors", progress=False)
        assert not (tmp_path / "x.safetensors").exists()  # no partial output left behind


def test_not_safetensors_input(tmp_path):
    p = tmp_path / "x.bin"
    for content in (b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}", struct.pack("<Q", 2) + b"[]", struct.pack("<Q", 1 << 40)):
        p.write_bytes(content)
        with pytest.raises(CorruptStreamError):
            files.compress_file(p, tmp_path / "x.kvc", progress=False)
    p.write_bytes(struct.pack("<Q", 60) + json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}).encode().ljust(60))
    with pytest.raises(CorruptStreamError):
        files.compress_file(p, tmp_path / "x.kvc", progress=False)
