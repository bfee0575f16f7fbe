"""safetensors <-> .kvc files and the CLI: byte-identical restores, per-tensor access, damage detection."""

import json
import os
import resource
import signal
import subprocess
import sys
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
    err = capsys.readouterr().err
    assert "corrupt input" in err and str(junk) in err and "nope.kvc does not exist" in err
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


def _write_norms(path):
    """A checkpoint shaped like real ones: big matrices with small norm/bias vectors between them."""
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(12):
        tensors[f"l{i}.norm.weight"] = (1 + 0.05 * torch.randn(320, generator=g)).to(torch.bfloat16)
        tensors[f"l{i}.proj.weight"] = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
        tensors[f"l{i}.proj.bias"] = (torch.randn(96, generator=g) * 0.01).to(torch.float32)
    save_file(tensors, str(path))
    return tensors


def _rewrite_index(kvc, out, edit):
    """A copy of ``kvc`` whose index meta went through ``edit`` (checksums valid: only the reader's checks stand)."""
    from kvcodec import container
    blob = kvc.read_bytes()
    _, _, ioff, ilen = files._FOOTER.unpack(blob[-files._FOOTER.size:])
    _, meta, sections = container.loads(blob[ioff:ioff + ilen], expect_kind=files.INDEX_KIND)
    meta = json.loads(json.dumps(meta))
    edit(meta)
    index = container.dumps(files.INDEX_KIND, meta, {"header": bytes(sections["header"])})
    out.write_bytes(blob[:ioff] + index + files._FOOTER.pack(files.FOOTER_MAGIC, 0, ioff, len(index)))


def test_small_tensors_are_coded_in_groups(tmp_path):
    src, kvc, back = tmp_path / "m.safetensors", tmp_path / "m.kvc", tmp_path / "back.safetensors"
    tensors = _write_norms(src)
    files.compress_file(src, kvc, progress=False)
    files.decompress_file(kvc, back, progress=False)
    assert back.read_bytes() == src.read_bytes()
    with files.KvcFile(kvc) as kf:
        modes = {e["name"]: e["mode"] for e in kf.entries}
        assert sorted(g["st_dtype"] for g in kf.groups) == ["BF16", "F32"]
        bf16 = next(g for g in kf.groups if g["st_dtype"] == "BF16")
        assert bf16["mode"] == "tensor" and bf16["length"] < bf16["bytes"]
    assert modes["l0.norm.weight"] == modes["l5.proj.bias"] == "grouped" and modes["l0.proj.weight"] == "tensor"
    for name, t in tensors.items():
        assert _same_tensor(files.read_tensor(kvc, name), t), name
    rows = {r["name"]: r for r in files.inspect_file(kvc)}
    assert rows["l3.norm.weight"]["codec"] == "group planes" and rows["l3.norm.weight"]["ratio"] > 1.2

    def mutations():
        yield lambda m: m["groups"][0].update(bytes=m["groups"][0]["bytes"] + 2)
        yield lambda m: m["groups"][1].update(st_dtype=m["groups"][0]["st_dtype"])
        yield lambda m: m["groups"][0].update(offset=m["groups"][0]["offset"] + 1)
        yield lambda m: m["groups"][0].update(mode="grouped")
        yield lambda m: m["groups"].pop()
        yield lambda m: m.pop("groups")
        first = next(i for i, e in enumerate(m0["entries"]) if e["mode"] == "grouped")
        yield lambda m: m["entries"][first].update(group=7)
        yield lambda m: m["entries"][first].update(group_start=2)
        yield lambda m: m["entries"][first].update(length=1)
        yield lambda m: m["entries"][first].pop("group")
        yield lambda m: m["entries"][first].update(mode="raw")

    from kvcodec import container
    blob = kvc.read_bytes()
    _, _, ioff, ilen = files._FOOTER.unpack(blob[-files._FOOTER.size:])
    m0 = container.loads(blob[ioff:ioff + ilen])[1]
    bad = tmp_path / "bad.kvc"
    for edit in mutations():
        _rewrite_index(kvc, bad, edit)
        with pytest.raises(CorruptStreamError):
            files.decompress_file(bad, tmp_path / "x.safetensors", progress=False)
        assert not (tmp_path / "x.safetensors").exists()
    _rewrite_index(kvc, bad, lambda m: None)  # the rewrite itself keeps a valid file
    files.decompress_file(bad, tmp_path / "x.safetensors", progress=False)
    assert (tmp_path / "x.safetensors").read_bytes() == src.read_bytes()


def test_not_safetensors_input(tmp_path):
    p = tmp_path / "x.bin"
    for content in (b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}", struct.pack("<Q", 2) + b"[]", struct.pack("<Q", 1 << 40)):
        p.write_bytes(content)
        with pytest.raises(CorruptStreamError):
            files.compress_file(p, tmp_path / "x.kvc", progress=False)
    p.write_bytes(struct.pack("<Q", 60) + json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}).encode().ljust(60))
    with pytest.raises(CorruptStreamError):
        files.compress_file(p, tmp_path / "x.kvc", progress=False)


# ---- the command line as a user runs it: a subprocess, exit codes, messages, files on disk ----
CLI = [sys.executable, "-m", "kvcodec.cli"]


def _kvcodec(*args, cwd=None, preexec_fn=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd,
                          preexec_fn=preexec_fn)


def _tree(folder):
    return sorted(p.name for p in folder.iterdir())


def test_cli_never_overwrites_without_force_and_never_the_input(tmp_path, capsys):
    src, kvc = tmp_path / "m.safetensors", tmp_path / "m.kvc"
    _write_model(src)
    original = src.read_bytes()
    os.link(src, tmp_path / "alias.safetensors")  # the same file under another name
    proc = _kvcodec("compress", src, src, "--force")
    assert proc.returncode == 2 and "is the input file" in proc.stderr, proc.stderr
    assert main(["compress", str(src), str(tmp_path / "alias.safetensors"), "--force"]) == 2
    assert src.read_bytes() == original
    kvc.write_bytes(b"precious")
    proc = _kvcodec("compress", src, kvc)
    assert proc.returncode == 2 and "already exists; pass --force" in proc.stderr
    assert kvc.read_bytes() == b"precious"
    proc = _kvcodec("compress", src, kvc, "--force")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"compressed {src} -> {kvc}:") and "ratio 1." in line and "MB/s" in line and " s" in line
    assert "8 tensors" in line and line.count("\n") == 0
    back = tmp_path / "back.safetensors"
    back.write_bytes(b"also precious")
    assert main(["decompress", str(kvc), str(back)]) == 2 and back.read_bytes() == b"also precious"
    assert main(["decompress", str(kvc), str(back), "--force", "--quiet"]) == 0 and back.read_bytes() == original
    back.unlink()
    assert "already exists" in capsys.readouterr().err
    assert _tree(tmp_path) == ["alias.safetensors", "m.kvc", "m.safetensors"]  # no temp files left


def _file_size_limit(limit):
    def apply():  # in the child: writes past ``limit`` bytes fail with EFBIG, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_cli_failed_write_keeps_the_old_file_and_names_the_users_path(tmp_path, capsys):
    src, kvc = tmp_path / "m.safetensors", tmp_path / "m.kvc"
    _write_model(src)
    kvc.write_bytes(b"old output")
    proc = _kvcodec("compress", src, kvc, "--force", preexec_fn=_file_size_limit(20_000))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kvcodec: cannot write {kvc}: File too large"
    assert kvc.read_bytes() == b"old output" and _tree(tmp_path) == ["m.kvc", "m.safetensors"]
    missing = tmp_path / "nodir" / "sub" / "x.kvc"
    assert main(["compress", str(src), str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"kvcodec: cannot write {missing}: folder {missing.parent} does not exist"
    assert not (tmp_path / "nodir").exists()


def test_cli_inspect_verify_fails_on_a_flipped_bit(tmp_path, capsys):
    src, kvc = tmp_path / "m.safetensors", tmp_path / "m.kvc"
    _write_model(src)
    files.compress_file(src, kvc, progress=False)
    record = next(e for e in files.KvcFile(kvc).entries if e["name"] == "layer.0.weight")
    blob = bytearray(kvc.read_bytes())
    blob[record["offset"] + record["length"] // 2] ^= 0x08  # inside a tensor's payload, not the index
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(bytes(blob))
    assert main(["inspect", str(bad)]) == 0  # the index is intact: the table alone cannot see the damage
    assert "layer.0.weight" in capsys.readouterr().out
    proc = _kvcodec("inspect", bad, "--verify")
    assert proc.returncode == 2 and "corrupt input" in proc.stderr and "layer.0.weight" in proc.stderr
    assert main(["inspect", str(kvc), "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{kvc}: .kvc file") and f"verified {kvc}:" in out
    assert main(["inspect", str(kvc), "--verify", "--max-output", "1K"]) == 2  # bounded like decompress
    assert "max_output_bytes" in capsys.readouterr().err


def test_cli_version_and_plain_help():
    from kvcodec.cli import version

    proc = _kvcodec("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvcodec {version()}"
    from importlib import metadata

    assert version() == metadata.version("kvcodec")
    proc = _kvcodec("--help")
    assert proc.returncode == 0 and "``" not in proc.stdout
    for command in ("demo", "compress", "decompress", "inspect"):
        assert command in proc.stdout


def test_inspect_and_decompress_recognise_every_format(tmp_path, capsys):
    import numpy as np

    import kvcodec
    from kvcodec import entropy, inspection
    from kvcodec.quant import TurboQuantMSE

    keys = (torch.randn(2, 3, 40, 64) * 0.5).to(torch.bfloat16)
    made = {
        "tensor.kvc": kvcodec.compress(keys),
        "stream.kvc": entropy.encode(np.arange(5000, dtype=np.uint16) % 7),
        "quant.kvc": TurboQuantMSE(64, 4, seed=0).quantize(keys).to_bytes(),
    }
    expect = {"tensor.kvc": "compressed tensor", "stream.kvc": "entropy-coded stream", "quant.kvc": "quantized K/V tensor"}
    for name, blob in made.items():
        (tmp_path / name).write_bytes(blob)
        assert main(["inspect", str(tmp_path / name), "--verify"]) == 0, name
        out = capsys.readouterr().out
        assert expect[name] in out and "verified" in out
        assert main(["decompress", str(tmp_path / name), str(tmp_path / "o.safetensors")]) == 2
        assert expect[name] in capsys.readouterr().err
    (tmp_path / "other").write_bytes(b"PK\x03\x04 a zip, not ours")
    assert main(["inspect", str(tmp_path / "other")]) == 2
    assert "is not a kvcodec file" in capsys.readouterr().err
    from kvcodec.hf import persist

    assert (inspection.SAVED_CACHE_KIND, inspection.SAVED_LAYER_KIND) == (persist.CACHE_KIND, persist.LAYER_KIND)


def test_cli_recognises_a_saved_compressed_cache(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcodec.cache_argument import cache_kwargs
    from kvcodec.hf import CompressedCache

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    cache = CompressedCache(model, method="turboquant", key_bits=4, residual=4, block_size=4)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 21)), **cache_kwargs(model, cache), use_cache=True)
    saved = tmp_path / "prefix.kvc"
    cache.save(saved)
    proc = _kvcodec("inspect", saved, "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "saved CompressedCache" in proc.stdout and "method=turboquant" in proc.stdout
    assert [line.split()[:3] for line in proc.stdout.splitlines() if line.startswith("layer")][1:] == [
        ["layer0", "21", "1"], ["layer1", "21", "1"]]
    assert main(["decompress", str(saved), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "saved CompressedCache" in err and "CompressedCache.load" in err
    blob = bytearray(saved.read_bytes())
    blob[-40] ^= 0x01
    saved.write_bytes(bytes(blob))
    assert main(["inspect", str(saved), "--verify"]) == 2
    assert "checksum" in capsys.readouterr().err
