"""Processes sharing one numba cache folder never cross-link its entries (``kvcodec._numba_cache.lock_saves``).

Numba saves an entry by reading the function's index, picking the first free data-file number, then
writing the index and the data file. Each writer here is slowed inside that save (a sleep before the
index write, and one writer's data write later still), the interleaving that, unlocked, leaves the index
naming one signature's data file for the other's: a later process then ran float64 machine code on an
int64 array (3e-323 for 6). With kvcodec imported, the saves take turns and a fresh process loads both
signatures right.
"""

import os
import subprocess
import sys
import textwrap

KERNEL = """
from numba import njit


@njit(cache=True)
def double_first(x):
    return x[0] * 2
"""

WRITER = """
import sys, time
import numpy as np
import numba.core.caching as caching
import kvcodec.lossless  # noqa: F401  (its package locks numba's cache saves)

kind = sys.argv[1]
save_index, save_data = caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data

def slow_index(self, overloads):
    time.sleep(1.2 if kind == "int" else 1.0)
    return save_index(self, overloads)

def slow_data(self, name, data):
    time.sleep(0.0 if kind == "int" else 0.5)
    return save_data(self, name, data)

caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data = slow_index, slow_data
import kernel
print(kernel.double_first(np.array([3], np.int64) if kind == "int" else np.array([3.5], np.float64)))
"""

READER = """
import numpy as np
import kernel
print(kernel.double_first(np.array([3], np.int64)), kernel.double_first(np.array([3.5], np.float64)))
print(sorted(map(str, kernel.double_first.stats.cache_hits)))
"""


def test_two_processes_saving_two_signatures_at_once_keep_both(tmp_path):
    (tmp_path / "kernel.py").write_text(KERNEL)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    writers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), kind], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind in ("int", "float")]
    outs = [w.communicate(timeout=120) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outs
    assert [o[0].split() for o in outs] == [["6"], ["7.0"]]
    read = subprocess.run([sys.executable, "-c", READER], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert read.returncode == 0, read.stderr
    values, hits = read.stdout.splitlines()
    assert values.split() == ["6", "7.0"]
    assert "int64" in hits and "float64" in hits  # both loaded from the cache, none compiled again
