"""GPU decoding of kvcodec's 32-state interleaved rANS streams: ``rans`` (launcher and host side)
beside ``rans_decode.cu``. Compiling and caching the kernel and transfers are ``kvcodec.device``'s.
"""
