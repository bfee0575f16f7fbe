"""Launch plans: what a kernel call derives from its invariants, built once and looked up per call.

A plan may hold device tensors (a transposed rotation, lengths, last-block counters). Built inside a
CUDA-graph capture, or during a cudagraph tree's warm-up or recording (``torch.compile(mode=
"reduce-overhead")``, which is what ``model.generate`` compiles), those tensors are allocated in the
graph's private memory pool and outlive the step: torch then refuses the step ("tensors in the
cudagraph pool not tracked as outputs"), and a plan evicted and rebuilt between two generate calls
does exactly that. So:

* code that replays a step from a graph makes its calls once outside any graph inside
  ``with pinned_by(owner):``; the plans those calls used stay cached while ``owner`` lives (a later
  ``pinned_by`` of the same owner replaces its set), whatever else fills the cache;
* a plan that must be built while the current CUDA stream captures raises
  :class:`~kvcodec.errors.PlanBuiltInCaptureError` instead of allocating in the graph's pool.

Unpinned plans are dropped together when a cache reaches its limit (they are rebuilt on demand).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from kvcodec.errors import PlanBuiltInCaptureError

_local = threading.local()  # .recording: the list a pinned_by block collects (cache, key, plan) into
_pins: dict[tuple, set] = {}  # (id(cache), key) -> ids of the owners pinning it
_owned: dict[int, list] = {}  # id(owner) -> [(cache, key)] it pins


class PlanCache:
    """Plans keyed by their call's invariants: ``get(key, build)``. At most ``limit`` unpinned plans."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self._plans: dict = {}
        self._pinned: dict = {}

    def get(self, key, build):
        plan = self._pinned.get(key)
        if plan is None:
            plan = self._plans.get(key)
        if plan is None:
            if _capturing():
                raise PlanBuiltInCaptureError(
                    f"a {self.name} launch plan would be built inside a CUDA graph capture (its device tensors "
                    "would live in the graph's pool): run the step once outside the capture, under "
                    "kvcodec.device.plans.pinned_by(owner)")
            plan = build()
            if len(self._plans) >= self.limit:
                self._plans.clear()
            self._plans[key] = plan
        recording = getattr(_local, "recording", None)
        if recording is not None:
            recording.append((self, key, plan))
        return plan

    def __len__(self) -> int:
        return len(self._plans.keys() | self._pinned.keys())

    def values(self) -> list:
        return [*self._pinned.values(), *(p for k, p in self._plans.items() if k not in self._pinned)]

    def clear(self) -> None:
        """Drop the unpinned plans (pinned ones stay while their owners live)."""
        self._plans.clear()


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def pinned_by(owner):
    """Pin every plan looked up inside the block for as long as ``owner`` lives (replacing the plans
    ``owner`` pinned before). Blocks do not nest."""
    if getattr(_local, "recording", None) is not None:
        raise RuntimeError("pinned_by blocks do not nest")
    _local.recording = recording = []
    try:
        yield
    finally:
        _local.recording = None
    oid = id(owner)
    if oid not in _owned:
        weakref.finalize(owner, _release, oid)
    _release(oid)
    _owned[oid] = [(cache, key) for cache, key, _ in recording]
    for cache, key, plan in recording:
        cache._pinned[key] = plan
        _pins.setdefault((id(cache), key), set()).add(oid)


def _release(oid: int) -> None:
    for cache, key in _owned.pop(oid, ()):
        owners = _pins.get((id(cache), key))
        if owners is None:
            continue
        owners.discard(oid)
        if not owners:
            del _pins[(id(cache), key)]
            cache._pinned.pop(key, None)


def pinned_count(owner) -> int:
    """How many plans ``owner`` pins (tests, diagnostics)."""
    return len(_owned.get(id(owner), ()))
