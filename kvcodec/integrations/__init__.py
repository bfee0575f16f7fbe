"""kvcodec plugged into other systems. Each submodule imports its host package itself, so importing
``kvcodec`` (or this package) never needs them:

- ``kvcodec.integrations.lmcache``: LMCache L2 serdes ``kvcodec_lossless``, ``kvcodec_turboquant`` and
  ``kvcodec_transform``
  (``pip install "kvcodec[lmcache]"``; see docs/lmcache.md).
"""
