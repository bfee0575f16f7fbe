"""Arrays as the compiled (numba) kernels receive them.

Numba compiles a kernel once per argument type, and a read-only array (``np.frombuffer`` of
``bytes``) is another type than a writable one (of a ``bytearray``, or a fresh array). Decoders pass
their byte and word inputs through :func:`readonly`, so each kernel compiles once whatever buffer
the caller gave (a compile costs seconds; ``tests/test_numba_signatures.py`` checks it).
"""

from __future__ import annotations

import numpy as np


def readonly(a: np.ndarray) -> np.ndarray:
    """``a`` read-only: itself when it already is, else a read-only view (no copy)."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view
