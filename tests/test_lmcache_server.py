"""The real LMCache server path: ``python -m kvcodec.integrations.lmcache server`` started as a process
with an fs L2 that stores through ``kvcodec_lossless``, driven by LMCache's own client
(``lmcache bench server --mode cpu``: it registers a KV cache, stores, looks up, retrieves and
checksums the KV through the server). The server is then killed (SIGKILL) while a client stores more
sequences. A second server on the same L2 folder, with an empty L1, serves the chunks from the kvcodec
objects alone, bit for bit; a damaged object is never served, and what the killed server left is
served as the KV that was stored or not at all.
127.0.0.1 only; each process is stopped when the test ends."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_service import free_port, redis_server  # noqa: F401  (redis_server: a fixture)

pytest.importorskip("lmcache")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LMCache's server: Linux")]

SHAPE = "(2,64,16,2,64):bfloat16:4"  # kv, blocks, tokens a block, heads, head size: dtype: layers
CHUNKS_PER_SEQ = 2  # 512 tokens of LMCache's 256-token chunks


def _env() -> dict:
    return dict(os.environ, LMCACHE_DISABLE_BANNER="1", PYTHONUNBUFFERED="1")


LOSSLESS = {"type": "kvcodec_lossless", "slot_ratio": 1.0}


def fs_adapter(folder: Path) -> dict:
    return {"type": "fs", "base_path": str(folder), "serde": LOSSLESS}


class Server:
    """One LMCache server process with the kvcodec serdes registered and the L2 ``adapter`` (an fs folder:
    :func:`fs_adapter`; or a RESP server)."""

    def __init__(self, adapter: dict, log: Path):
        self.port, self.http = free_port(), free_port()
        cmd = [sys.executable, "-m", "kvcodec.integrations.lmcache", "server", "--host", "127.0.0.1",
               "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http),
               "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
               "--l2-adapter", json.dumps(adapter)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.http), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("the server did not come up in 120 s")

    def client_cmd(self, start: int, end: int) -> list[str]:
        return [sys.executable, "-m", "kvcodec.integrations.lmcache", "bench", "server", "--mode", "cpu",
               "--rpc-url", f"tcp://127.0.0.1:{self.port}", "--url", f"http://127.0.0.1:{self.http}",
               "--start", str(start), "--end", str(end), "--interval", "0", "--num-tokens", "512",
               "--kvcache-shape-spec", SHAPE, "--num-blocks", "64"]

    def client(self, start: int, end: int) -> str:
        """LMCache's own client over sequences [start, end): its report."""
        proc = subprocess.run(self.client_cmd(start, end), capture_output=True, text=True, timeout=240, env=_env())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _checksums(report: str, phase: str) -> dict[int, str]:
    return {int(seq): value for seq, value in re.findall(rf"\[seq (\d+)/{phase}\] CHECKSUM: (\w+)", report)}


def _whole_checksums(report: str) -> dict[int, str]:
    """The cold checksums that cover a whole sequence. LMCache's client checksums only the chunks it is
    about to store (those after a cold lookup's hits), so a cold lookup that hit a prefix gives the
    checksum of the rest, and the client's own cold/warm verdict for that sequence compares unlike lists."""
    cold = _checksums(report, "cold")
    hits = {int(s): int(h) for s, h in re.findall(r"\[seq (\d+)/cold\] LOOKUP: (\d+)/", report)}
    return {s: value for s, value in cold.items() if hits.get(s) == 0}


def _objects(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def test_a_server_stores_through_kvcodec_and_a_fresh_one_serves_the_same_bytes(tmp_path):
    from kvcodec import magics

    l2 = tmp_path / "l2"
    l2.mkdir()
    first = Server(fs_adapter(l2), tmp_path / "server1.log")
    try:
        report = first.client(0, 3)
        objects = _objects(l2)
        # then killed (SIGKILL) while a client stores sequences 3..5: no object it leaves loads as wrong KV
        busy_log = tmp_path / "killed_client.log"
        busy = subprocess.Popen(first.client_cmd(3, 6), stdout=busy_log.open("w"), stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 60
        while len(_objects(l2)) < len(objects) + 1 and time.monotonic() < deadline and busy.poll() is None:
            time.sleep(0.05)
        first.proc.kill()
        first.proc.wait()
        busy.kill()
        busy.wait()
    finally:
        first.stop()
    assert report.count("CHECKSUM MATCH OK") == 3, report
    stored = _checksums(report, "cold")
    assert len(objects) == 3 * CHUNKS_PER_SEQ
    assert all(p.read_bytes()[:4] == magics.LMCACHE_FRAME for p in objects)  # kvcodec's frames, not raw KV
    assert "Traceback" not in (tmp_path / "server1.log").read_text()

    # one object damaged: whatever the fresh server serves is the stored KV or nothing
    damaged = objects[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))

    second = Server(fs_adapter(l2), tmp_path / "server2.log")  # empty L1: every hit comes from the kvcodec objects
    try:
        report = second.client(0, 3)
        after_kill = second.client(3, 6)  # what the killed server left: served right, or a miss stored again
    finally:
        second.stop()
    served = _checksums(report, "warm")
    assert set(served) == {0, 1, 2} and all(served[s] == stored[s] for s in served), report
    # a sequence the killed server stored whole is served from L2 (no new store, so the client has no cold
    # checksum of its own to match): its KV must be what the killed run's client computed before storing
    # (a sequence the killed server stored in part is served its stored prefix and stores the rest: its
    # whole-sequence truth is the killed run's cold checksum, taken before that run stored anything)
    computed = {**_whole_checksums(busy_log.read_text()), **_whole_checksums(after_kill)}
    served = _checksums(after_kill, "warm")
    assert set(served) == {3, 4, 5} and all(served[s] == computed[s] for s in served), after_kill
    hits = [int(n) for n in re.findall(r"/cold\] LOOKUP: (\d+)/2 chunks hit", report)]
    # the sequences without the damaged object come from L2 whole; the damaged one's lookup stops at it
    # (a prefix match), and its KV was stored again by the client and served right
    assert len(hits) == 3 and sorted(hits)[1:] == [CHUNKS_PER_SEQ] * 2 and sorted(hits)[0] < CHUNKS_PER_SEQ, report


def test_a_server_stores_in_redis_through_kvcodec_and_a_fresh_one_serves_it(redis_server, tmp_path):
    from kvcodec import magics

    port, client = redis_server
    adapter = {"type": "resp", "host": "127.0.0.1", "port": port, "serde": LOSSLESS}
    first = Server(adapter, tmp_path / "server1.log")
    try:
        report = first.client(0, 2)
    finally:
        first.stop()
    assert report.count("CHECKSUM MATCH OK") == 2, report
    stored = _checksums(report, "cold")
    values = [client.get(k) for k in client.keys("*")]
    assert len(values) == 2 * CHUNKS_PER_SEQ and all(v[:4] == magics.LMCACHE_FRAME for v in values)

    second = Server(adapter, tmp_path / "server2.log")  # empty L1: every hit comes from redis
    try:
        report = second.client(0, 2)
    finally:
        second.stop()
    hits = [int(n) for n in re.findall(r"/cold\] LOOKUP: (\d+)/2 chunks hit", report)]
    served = _checksums(report, "warm")
    assert hits == [CHUNKS_PER_SEQ] * 2, report
    assert set(served) == {0, 1} and all(served[s] == stored[s] for s in served), report
