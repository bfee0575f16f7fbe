"""Device runtime shared by every kernel owner (quant, lossless, entropy, transform, weights).

- ``build``: compiling the ``.cu`` sources each owner ships beside its launchers (CuPy NVRTC at run
  time, ``nvcc`` for the compile checks) and caching the compiled modules; torch <-> CuPy streams,
  multiprocessor counts, per-tensor derived constants.
- ``transfer``: host <-> device copies (pinned one-copy uploads, the pinned ring for big blobs).
- ``crc32``: CRC-32 of device buffers (``crc32.cu``).
- ``is_available``: whether a CUDA device and CuPy are both usable.

A leaf package: it imports only kvcodec's base modules (``safe_write``), torch and numpy; CuPy is
loaded on the first CUDA launch.
"""


def is_available() -> bool:
    """True when a CUDA device and CuPy are both usable (the kernels can run)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


__all__ = ["is_available"]
