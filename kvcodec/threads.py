"""Worker counts: the one place a ``threads`` argument is read (0 = every core we may use).

A base module (imports only the standard library) so every codec, the registry, the file reader,
the quantizers, the weights and the device transfers can share it without importing each other.
"""

from __future__ import annotations

import os


def resolve_threads(threads: int) -> int:
    """Worker count for a ``threads`` argument: 0 means every core this process may use."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"threads must be a non-negative integer, got {threads!r}")
    if threads:
        return threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
