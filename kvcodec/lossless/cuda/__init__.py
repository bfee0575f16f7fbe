"""GPU kernels of the lossless codecs and their launchers, each ``.py`` beside its ``.cu``.

- ``kvctx_decode`` / ``kvctx_encode`` / ``kvctx_plan``: the kvctx / predictive format 2 decoder,
  encoder and the decode's plan on the device (driven by ``kvcodec.lossless.kvctx_device`` and
  ``kvctx_device_encode``).
- ``planes_codec``: the ``planes`` codec's split + histograms, rANS chunk encoder, compaction and
  merge (driven by ``kvcodec.lossless.planes_device``).

Compiling and caching the kernels, transfers and the device CRC-32 are ``kvcodec.device``'s.
Importing a launcher needs only torch and numpy; CuPy is loaded on the first CUDA launch.
"""
