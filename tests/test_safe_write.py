"""Every file kvcodec writes goes through kvcodec.safe_write: refusals, concurrent writers, kill -9,
a full disk, and a read-only install.

python -m pytest -q tests/test_safe_write.py -x
"""

import errno
import os
import random
import shutil
import signal
import stat
import subprocess
import sysconfig
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kvcodec
from kvcodec import WriteRefusedError, safe_write
from kvcodec.cli import main
from kvcodec.lossless import files

REPO = Path(__file__).resolve().parents[1]


def _model(path, seed=0, n=24):
    """A small safetensors file; ``seed`` makes different bytes."""
    g = torch.Generator().manual_seed(seed)
    save_file({"w": (torch.randn(n, 64, generator=g) * 0.02).to(torch.bfloat16),
               "b": torch.randn(64, generator=g)}, str(path))
    return Path(path).read_bytes()


def _temporaries(folder):
    return sorted(p.name for p in Path(folder).iterdir() if safe_write.TAG in p.name)


def _restores_to(kvc, expected: set, scratch):
    """The .kvc file decodes (crc-checked) to one of ``expected``."""
    out = Path(scratch) / f"restored-{random.getrandbits(32):08x}"
    files.decompress_file(kvc, out, progress=False)
    data = out.read_bytes()
    out.unlink()
    return data in expected


# ------------------------------------------------------------------------------- the helper itself
def test_refusals_write_nothing(tmp_path):
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(b"input")
    with pytest.raises(WriteRefusedError) as e:
        safe_write.write_bytes(src, b"x", overwrite=True, inputs=[src])
    assert e.value.reason == "input" and e.value.filename == str(src) and isinstance(e.value, OSError)
    os.symlink(src, dst)
    with pytest.raises(WriteRefusedError, match="is the input file"):  # a link to the input is the input
        safe_write.write_bytes(dst, b"x", overwrite=True, inputs=[src])
    with pytest.raises(WriteRefusedError, match="symbolic link") as e:
        safe_write.write_bytes(dst, b"x", overwrite=True)
    assert e.value.reason == "symlink" and dst.is_symlink()
    dst.unlink()
    os.link(src, dst)
    with pytest.raises(WriteRefusedError, match="2 hard links") as e:
        safe_write.write_bytes(dst, b"x", overwrite=True)
    assert e.value.reason == "hardlink"
    dst.unlink()
    dst.write_bytes(b"old")
    with pytest.raises(WriteRefusedError, match="already exists; pass overwrite=True") as e:
        safe_write.write_bytes(dst, b"new")
    assert e.value.reason == "exists"
    with pytest.raises(WriteRefusedError, match="is a folder"):
        safe_write.write_bytes(tmp_path, b"x", overwrite=True)
    with pytest.raises(WriteRefusedError, match="does not exist") as e:
        safe_write.write_bytes(tmp_path / "no" / "x", b"x")
    assert e.value.reason == "no-folder"
    assert src.read_bytes() == b"input" and dst.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.bin", "out.bin"]
    assert safe_write.write_bytes(dst, b"new", overwrite=True) == 3 and dst.read_bytes() == b"new"


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_error_in_the_block_keeps_the_old_file_and_no_temporary(tmp_path, error):
    dst = tmp_path / "out.bin"
    dst.write_bytes(b"old")
    with pytest.raises(error):
        with safe_write.atomic_write(dst, overwrite=True) as out:
            out.write(b"partial" * 1000)
            assert _temporaries(tmp_path)  # the bytes go to a temporary beside the target
            raise error("encoder failed")
    assert dst.read_bytes() == b"old" and _temporaries(tmp_path) == []


def test_a_file_that_appears_while_writing_is_not_clobbered(tmp_path):
    dst = tmp_path / "out.bin"
    with pytest.raises(WriteRefusedError, match="already exists"):
        with safe_write.atomic_write(dst) as out:
            out.write(b"mine")
            dst.write_bytes(b"theirs")
    assert dst.read_bytes() == b"theirs" and _temporaries(tmp_path) == []


def test_replacing_keeps_the_mode_and_new_files_follow_the_umask(tmp_path):
    dst = tmp_path / "private.bin"
    dst.write_bytes(b"old")
    dst.chmod(0o600)
    safe_write.write_bytes(dst, b"new", overwrite=True)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        safe_write.write_bytes(tmp_path / "fresh.bin", b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh.bin").stat().st_mode) == 0o644


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid runs nothing now
    ours = safe_write.temporary_path(tmp_path / "a.kvc")
    stale = Path(str(ours).replace(f".{os.getpid()}.", f".{dead.pid}."))
    other_host = Path(str(stale).replace(safe_write._HOST, "0" * 8 if safe_write._HOST != "0" * 8 else "1" * 8))
    lookalike = tmp_path / "notes.kvcodec-tmp.txt"
    for p in (ours, stale, other_host, lookalike):
        p.write_bytes(b"leftover")
    safe_write.write_bytes(tmp_path / "b.kvc", b"data")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert stale.name not in left  # its writer is gone
    assert {ours.name, other_host.name, lookalike.name, "b.kvc"} == set(left)  # a live or unknown writer's


# ------------------------------------------------------------------------------- the library writers
def test_compress_and_decompress_file_refusals(tmp_path):
    src, other = tmp_path / "m.safetensors", tmp_path / "other.safetensors"
    original = _model(src)
    _model(other, seed=1)
    with pytest.raises(WriteRefusedError, match="is the input file"):
        files.compress_file(src, src, progress=False, overwrite=True)
    link = tmp_path / "link.kvc"
    os.symlink(other, link)
    with pytest.raises(WriteRefusedError, match="symbolic link"):
        files.compress_file(src, link, progress=False, overwrite=True)
    alias = tmp_path / "alias.kvc"
    os.link(other, alias)
    with pytest.raises(WriteRefusedError, match="hard links"):
        files.compress_file(src, alias, progress=False, overwrite=True)
    kvc = tmp_path / "m.kvc"
    kvc.write_bytes(b"precious")
    with pytest.raises(WriteRefusedError, match="already exists"):
        files.compress_file(src, kvc, progress=False)
    assert kvc.read_bytes() == b"precious" and src.read_bytes() == original
    files.compress_file(src, kvc, progress=False, overwrite=True)
    with pytest.raises(WriteRefusedError, match="is the input file"):
        files.decompress_file(kvc, kvc, progress=False, overwrite=True)
    back = tmp_path / "back.safetensors"
    files.decompress_file(kvc, back, progress=False)
    with pytest.raises(WriteRefusedError, match="already exists"):
        files.decompress_file(kvc, back, progress=False)
    assert back.read_bytes() == original and _temporaries(tmp_path) == []


def tiny_model(layers=2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_cache(model, tokens, method="none"):
    from kvcodec.cache_argument import cache_kwargs
    from kvcodec.hf import CompressedCache

    cache = CompressedCache(model, method=method, residual=2, block_size=2)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(tokens)),
              **cache_kwargs(model, cache), use_cache=True)
    return cache


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_compressed_cache_save_refusals(tmp_path, model):
    from kvcodec.hf import CompressedCache

    cache = tiny_cache(model, 5)
    path, target = tmp_path / "prefix.kvc", tmp_path / "target.kvc"
    target.write_bytes(b"precious")
    os.symlink(target, path)
    with pytest.raises(WriteRefusedError, match="symbolic link"):
        cache.save(path, overwrite=True)
    path.unlink()
    os.link(target, path)
    with pytest.raises(WriteRefusedError, match="hard links"):
        cache.save(path, overwrite=True)
    path.unlink()
    path.write_bytes(b"old prefix")
    with pytest.raises(WriteRefusedError, match="already exists; pass overwrite=True"):
        cache.save(path)
    assert path.read_bytes() == b"old prefix" and target.read_bytes() == b"precious"
    cache.save(path, overwrite=True)
    assert CompressedCache.load(path, model).get_seq_length() == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefix.kvc", "target.kvc"]


def test_load_without_a_cap_decodes_lossless_rows_without_one(tmp_path, model, monkeypatch):
    """max_output_bytes=None reaches every row decode (it used to cap each row at 4 GiB)."""
    from kvcodec import CorruptStreamError
    from kvcodec.hf import CompressedCache
    from kvcodec.lossless import api

    cache = tiny_cache(model, 7, method="lossless")
    path = tmp_path / "lossless.kvc"
    cache.save(path)
    caps, decompress = [], api.decompress

    def recording(blob, *args, **kw):
        caps.append(kw.get("max_output_bytes", "default"))
        return decompress(blob, *args, **kw)

    monkeypatch.setattr(api, "decompress", recording)
    loaded = CompressedCache.load(path, model, max_output_bytes=None)
    assert loaded.get_seq_length() == 7 and caps and set(caps) == {None}
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):  # a cap still binds
        CompressedCache.load(path, model, max_output_bytes=64)


# ------------------------------------------------------------------------------- the command line
def test_cli_refuses_links_and_bad_arguments_in_one_line(tmp_path, capsys):
    src, other = tmp_path / "m.safetensors", tmp_path / "other.bin"
    _model(src)
    other.write_bytes(b"precious")
    link, alias = tmp_path / "link.kvc", tmp_path / "alias.kvc"
    os.symlink(other, link)
    os.link(other, alias)
    assert main(["compress", str(src), str(link), "--force"]) == 2
    assert capsys.readouterr().err.strip() == (f"kvcodec: refusing to write {link}: it is a symbolic link (the write "
                                               "would replace the link, not the file it names); write to the file's own path")
    assert main(["compress", str(src), str(alias), "--force"]) == 2
    assert "hard links" in capsys.readouterr().err and other.read_bytes() == b"precious"
    for bad in (["--threads", "-3"], ["--threads", "two"]):
        proc = subprocess.run([sys.executable, "-m", "kvcodec.cli", "compress", str(src), str(tmp_path / "x.kvc"), *bad],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("kvcodec compress: argument --threads: must be 0 (all cores) or a positive")
    assert not (tmp_path / "x.kvc").exists()


# ------------------------------------------------------------------------------- concurrent writers
def _race_threads(write, n=4, rounds=3):
    errors = []

    def run(i):
        try:
            for r in range(rounds):
                write((i + r) % 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, errors


def _snapshots_while(alive, path, every=0.003, limit=40):
    """Copies of ``path`` taken while ``alive()``: what a reader sees during the race."""
    seen = []
    while alive() and len(seen) < limit:
        try:
            seen.append(path.read_bytes())
        except FileNotFoundError:
            pass
        time.sleep(every)
    return seen


def test_concurrent_threads_compress_file(tmp_path):
    srcs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    originals = {_model(srcs[0], 0), _model(srcs[1], 1, n=40)}
    dst = tmp_path / "out.kvc"
    threads, errors = _race_threads(lambda k: files.compress_file(srcs[k], dst, threads=1, progress=False,
                                                                  overwrite=True))
    seen = _snapshots_while(lambda: any(t.is_alive() for t in threads), dst)
    for t in threads:
        t.join()
    assert errors == []
    for blob in {*seen, dst.read_bytes()}:
        (tmp_path / "seen.kvc").write_bytes(blob)
        assert _restores_to(tmp_path / "seen.kvc", originals, tmp_path)
    assert _temporaries(tmp_path) == []


def test_concurrent_threads_compressed_cache_save(tmp_path, model):
    from kvcodec.hf import CompressedCache
    from kvcodec.hf.persist import cache_to_bytes

    caches = [tiny_cache(model, 5), tiny_cache(model, 9)]
    whole = {cache_to_bytes(c) for c in caches}
    dst = tmp_path / "prefix.kvc"
    threads, errors = _race_threads(lambda k: caches[k].save(dst, overwrite=True))
    seen = _snapshots_while(lambda: any(t.is_alive() for t in threads), dst)
    for t in threads:
        t.join()
    assert errors == [] and {*seen, dst.read_bytes()} <= whole
    assert CompressedCache.load(dst, model).get_seq_length() in (5, 9) and _temporaries(tmp_path) == []


def _fork(body):
    """A child process (fork: the parent's imports and compiled functions, no start-up cost) that runs
    ``body()`` and exits 0, or 1 on an exception."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
            body()
            code = 0
        except BaseException:  # noqa: BLE001 - the exit status says it
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _race_processes(write, n=3, rounds=6, timeout=120):
    """``n`` forked writers, ``rounds`` writes each; returns (exit statuses, what a reader saw)."""
    pids = [_fork(lambda i=i: [write((i + r) % 2) for r in range(rounds)]) for i in range(n)]
    status, deadline = {}, time.monotonic() + timeout

    def alive():
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(code)
        if time.monotonic() > deadline:
            for pid in set(pids) - set(status):
                os.kill(pid, signal.SIGKILL)
        return len(status) < len(pids)

    return status, alive


def test_concurrent_processes_compress_file_and_save(tmp_path, model):
    from kvcodec.hf import CompressedCache
    from kvcodec.hf.persist import cache_to_bytes

    srcs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    originals = {_model(srcs[0], 0), _model(srcs[1], 1, n=40)}
    dst = tmp_path / "out.kvc"
    files.compress_file(srcs[0], tmp_path / "warm.kvc", threads=1, progress=False)  # compiled before the fork
    (tmp_path / "warm.kvc").unlink()
    status, alive = _race_processes(lambda k: files.compress_file(srcs[k], dst, threads=1, progress=False,
                                                                  overwrite=True))
    seen = _snapshots_while(alive, dst, limit=10**6)
    assert sorted(status.values()) == [0, 0, 0], "a writer failed or hung (its traceback is above)"
    for blob in {*seen, dst.read_bytes()}:
        (tmp_path / "seen.kvc").write_bytes(blob)
        assert _restores_to(tmp_path / "seen.kvc", originals, tmp_path)

    caches = [tiny_cache(model, 5), tiny_cache(model, 9)]
    whole = {cache_to_bytes(c) for c in caches}
    path = tmp_path / "prefix.kvc"
    status, alive = _race_processes(lambda k: caches[k].save(path, overwrite=True))
    seen = _snapshots_while(alive, path, limit=10**6)
    assert sorted(status.values()) == [0, 0, 0]
    assert {*seen, path.read_bytes()} <= whole
    assert CompressedCache.load(path, model).get_seq_length() in (5, 9)
    assert _temporaries(tmp_path) == []


def _killed_writer(srcs, dst, warm, ready):
    """A writer process: two writes to ``warm`` (the first loads or compiles the codec), then it sends the
    second's time (the cost of one write) and rewrites ``dst`` from ``srcs`` in turn until it is killed."""
    files.compress_file(srcs[1], warm, threads=1, progress=False, overwrite=True)
    t0 = time.perf_counter()
    files.compress_file(srcs[1], warm, threads=1, progress=False, overwrite=True)
    ready.send(time.perf_counter() - t0)
    for i in range(10**9):
        files.compress_file(srcs[i % 2], dst, threads=1, progress=False, overwrite=True)


def test_kill_9_at_random_moments_leaves_the_old_or_the_new_file(tmp_path):
    """20 writer processes, each rewriting one path in a loop once warmed up, killed with SIGKILL at a
    random moment: the path always holds a whole file (none before the first write finished), the
    killed writer's temporary is the only leftover, and the next write removes it. The writers fork from
    a fresh single-threaded server that has imported kvcodec (multiprocessing's forkserver: a fork of this
    multi-threaded test process could deadlock in the child, and a fresh interpreter per writer spends
    seconds importing torch); four run at a time, each with a folder of its own."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "safetensors.torch", "kvcodec.cli", "kvcodec.lossless.files", "pytest"])
    srcs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    originals = {_model(srcs[0], 0), _model(srcs[1], 1, n=40)}
    rng = random.Random(1234)
    seen, leftovers, folders = [], [], []
    for first in range(0, 20, 4):
        procs = []
        for trial in range(first, first + 4):
            folder = tmp_path / f"trial{trial}"
            folder.mkdir()
            folders.append(folder)
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_killed_writer, args=(srcs, folder / "out.kvc", folder / "warm.kvc", theirs))
            proc.start()
            theirs.close()
            procs.append((folder, proc, ours))
        for folder, proc, ready in procs:  # each killed at its own random moment after it is ready
            assert ready.poll(120), "a writer sent no ready message"
            one_write = ready.recv()
            time.sleep(rng.uniform(0, 6 * one_write))  # before, during or after a write to the path
            proc.kill()
        for folder, proc, ready in procs:
            proc.join()
            ready.close()
            assert proc.exitcode == -signal.SIGKILL
            (folder / "warm.kvc").unlink()
            if (folder / "out.kvc").exists():
                seen.append((folder / "out.kvc").read_bytes())
            leftovers.append(len(_temporaries(folder)))
    assert len(seen) >= 5, f"only {len(seen)} of 20 writers finished a write: the kill window is too short"
    assert max(leftovers) <= 1 and sum(leftovers) > 0, leftovers
    for blob in set(seen):
        (tmp_path / "seen.kvc").write_bytes(blob)
        assert _restores_to(tmp_path / "seen.kvc", originals, tmp_path)
    for folder in folders:  # the next write to a folder removes the killed writer's temporary
        files.compress_file(srcs[0], folder / "out.kvc", threads=1, progress=False, overwrite=True)
        assert _temporaries(folder) == [] and _restores_to(folder / "out.kvc", originals, tmp_path)


# ------------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_tmpfs():
    """A 64 KiB tmpfs, unmounted afterwards."""
    if not shutil.which("mount"):
        pytest.skip("no mount command")
    folder = Path(tempfile.mkdtemp(prefix="kvcodec-tmpfs-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        folder.rmdir()
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
        folder.rmdir()


def test_a_full_disk_leaves_the_old_file_and_no_temporary(small_tmpfs, tmp_path, capsys):
    dst = small_tmpfs / "out.bin"
    dst.write_bytes(b"old")
    with pytest.raises(OSError) as e:
        safe_write.write_bytes(dst, os.urandom(200_000), overwrite=True)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(dst)
    assert dst.read_bytes() == b"old" and sorted(os.listdir(small_tmpfs)) == ["out.bin"]

    src = tmp_path / "noise.safetensors"  # random bytes do not compress: the .kvc needs ~200 kB
    save_file({"noise": torch.randint(0, 256, (200_000,), dtype=torch.uint8)}, str(src))
    kvc = small_tmpfs / "noise.kvc"
    with pytest.raises(OSError) as e:
        files.compress_file(src, kvc, progress=False)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(kvc)
    assert sorted(os.listdir(small_tmpfs)) == ["out.bin"]
    assert main(["compress", str(src), str(kvc), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"kvcodec: cannot write {kvc}: No space left on device"
    assert sorted(os.listdir(small_tmpfs)) == ["out.bin"]


# ------------------------------------------------------------------------------- a read-only install
def _readonly_copy(root: Path) -> Path:
    """The installed package copied under ``root``/site, without caches, every file read-only."""
    site = root / "site"
    shutil.copytree(Path(kvcodec.__file__).parent, site / "kvcodec", ignore=shutil.ignore_patterns("__pycache__"))
    for folder, dirs, names in os.walk(site):
        for n in names:
            os.chmod(os.path.join(folder, n), 0o444)
        os.chmod(folder, 0o555)
    return site


def _first_run(run, site: Path, work: Path, env: dict, python: str = sys.executable, packages: str = "") -> Path:
    """``import kvcodec`` and ``kvcodec compress`` through ``run`` with only ``site`` (then
    ``packages``, the dependencies, when given) on the path; returns the numba cache folder the
    import chose."""
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, (str(site), packages))), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    proc = run([python, "-c", "import os, kvcodec; print(kvcodec.__file__); print(os.environ['NUMBA_CACHE_DIR'])"],
               env=env)
    assert proc.returncode == 0, proc.stderr
    module, cache_dir = proc.stdout.split()
    assert module == str(site / "kvcodec" / "__init__.py")
    src, dst = work / "m.safetensors", work / "m.kvc"
    original = _model(src)
    os.chmod(src, 0o644)
    proc = run([python, "-m", "kvcodec.cli", "compress", str(src), str(dst), "--quiet"], env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert _restores_to(dst, {original}, work)
    return Path(cache_dir)


def _require_root():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root (to add a user or mount a folder read-only)")


def test_first_run_as_another_user_on_a_read_only_install(tmp_path):
    """A non-root user with no writable home runs the package from a read-only folder: the import
    picks a private temporary cache folder and the CLI compresses."""
    _require_root()
    if not shutil.which("useradd"):
        pytest.skip("no useradd")
    name = "kvcodec-readonly"
    if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", name],
                       check=True, capture_output=True)
    import pwd

    uid, gid = pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid

    def probe(python, packages=""):
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": packages}
        try:
            proc = subprocess.run([python, "-c", "import torch"], user=uid, group=gid, extra_groups=[], env=env,
                                  capture_output=True, text=True, timeout=300, cwd="/")
            return proc.stderr.strip().splitlines()[-1][:200] if proc.returncode else ""
        except OSError as exc:  # the interpreter itself cannot be executed by that user
            return str(exc)

    python, mounted, packages = sys.executable, None, ""
    failure = probe(python)
    if failure and sys.prefix == sys.base_prefix:  # an installation under a private home (pyenv in /root):
        # the same installation bind-mounted where every user can reach it, as a system Python would be
        mounted = Path(tempfile.mkdtemp(prefix="kvcodec-python-"))
        os.chmod(mounted, 0o755)
        if subprocess.run(["mount", "--bind", sys.base_prefix, str(mounted)], capture_output=True).returncode:
            mounted.rmdir()
            mounted = None
        else:
            base = os.path.realpath(sys.base_prefix)
            python = str(mounted / Path(os.path.realpath(sys.executable)).relative_to(base))
            # the mounted interpreter's site module does not list the installation's site-packages
            packages = str(mounted / Path(os.path.realpath(sysconfig.get_paths()["purelib"])).relative_to(base))
            failure = probe(python, packages)
    if failure:
        if mounted:
            subprocess.run(["umount", str(mounted)], check=False)
            mounted.rmdir()
        pytest.skip(f"{sys.executable} or its packages cannot be used by another user here ({failure}); "
                    "test_first_run_on_a_read_only_mount covers the read-only install as root")
    root = Path(tempfile.mkdtemp(prefix="kvcodec-ro-"))
    try:
        os.chmod(root, 0o755)
        site = _readonly_copy(root)
        work = root / "work"
        work.mkdir()
        os.chown(work, uid, gid)
        tmp = root / "tmp"
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent", "TMPDIR": str(tmp)}

        def as_user(cmd, env):
            return subprocess.run(cmd, env=env, user=uid, group=gid, extra_groups=[], cwd=work,
                                  capture_output=True, text=True, timeout=300)

        cache_dir = _first_run(as_user, site, work, env, python, packages)
        assert cache_dir == tmp / f"kvcodec-numba-{uid}" and cache_dir.stat().st_uid == uid
        assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)
        if mounted:
            subprocess.run(["umount", str(mounted)], check=False)
            mounted.rmdir()


def test_first_run_on_a_read_only_mount(tmp_path):
    """The package and the home folder on a read-only mount (read-only even for root): without
    kvcodec._numba_cache the CLI dies with numba's "cannot cache function ...: no locator available"."""
    _require_root()
    root = Path(tempfile.mkdtemp(prefix="kvcodec-ro-"))
    mounted = False
    try:
        site = _readonly_copy(root)
        proc = subprocess.run(["mount", "--bind", str(site), str(site)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"bind mounts are not permitted here: {proc.stderr.strip()}")
        mounted = True
        proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(site)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"read-only remounts are not permitted here: {proc.stderr.strip()}")
        work, tmp = root / "work", root / "tmp"
        work.mkdir()
        tmp.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(site / "kvcodec"), "TMPDIR": str(tmp)}

        def as_root(cmd, env):
            return subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=300)

        cache_dir = _first_run(as_root, site, work, env)
        # numba made its per-module cache folders there when the @njit(cache=True) decorators ran
        assert cache_dir == tmp / "kvcodec-numba-0" and any(p.is_dir() for p in cache_dir.iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", str(site)], check=False)
        subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_numba_cache_folder_choice(tmp_path, monkeypatch):
    """XDG_CACHE_HOME, then ~/.cache, then a private folder in the temporary directory; an existing
    NUMBA_CACHE_DIR or a writable package folder is left alone."""
    from kvcodec import _numba_cache as nc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nc.user_cache_dir() == tmp_path / "xdg" / "kvcodec" / "numba" and nc.user_cache_dir().is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert nc.user_cache_dir() == tmp_path / "home" / ".cache" / "kvcodec" / "numba"
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path / "file"))  # no folder can be made under a file, even by root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    private = nc.user_cache_dir()
    assert private == tmp_path / "tmp" / f"kvcodec-numba-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    private.chmod(0o777)  # open to others: anyone could plant pickled code there, so a fresh folder
    fresh = nc.user_cache_dir()
    assert fresh != private and fresh.parent == tmp_path / "tmp" and stat.S_IMODE(fresh.stat().st_mode) == 0o700

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")
    monkeypatch.setattr(nc, "PACKAGE_DIR", tmp_path / "file" / "pkg")  # not writable
    assert nc.configure() is None and os.environ["NUMBA_CACHE_DIR"] == "/somewhere"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    import numba.core.config

    monkeypatch.setattr(numba.core.config, "CACHE_DIR", numba.core.config.CACHE_DIR)
    assert nc.configure() == str(tmp_path / "xdg" / "kvcodec" / "numba")
    assert os.environ["NUMBA_CACHE_DIR"] == numba.core.config.CACHE_DIR  # numba already imported: told too
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setattr(nc, "PACKAGE_DIR", tmp_path)  # writable: numba's own __pycache__ works
    assert nc.configure() is None and "NUMBA_CACHE_DIR" not in os.environ
