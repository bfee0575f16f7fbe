"""Every magic number kvcodec writes, in one place (a leaf module: it imports nothing).

Each on-disk object starts with four ASCII bytes, so a reader (and ``kvcodec inspect``) can tell
them apart from their first bytes:

=============  ===========  ===============================================================
constant       bytes        where
=============  ===========  ===============================================================
CONTAINER      ``b"KVCC"``  offset 0 of a ``kvcodec.container`` (the one container format:
                            quantized tensors, HF cache files, lossless tensors, file indexes)
STREAM         ``b"KVCE"``  offset 0 of a ``kvcodec.entropy`` stream (one entropy-coded array)
FILE           ``b"KVCF"``  offset 0 of a ``.kvc`` file (``kvcodec.lossless.files``)
FILE_FOOTER    ``b"KVCE"``  the last 24 bytes of a ``.kvc`` file (index offset and length)
LMCACHE_FRAME  ``b"KVLC"``  offset 0 of an object a kvcodec serde stores in LMCache's L2
                            (``kvcodec.integrations.lmcache``); a container follows the frame
=============  ===========  ===============================================================

FILE_FOOTER has the same bytes as STREAM for historical reasons. It is never ambiguous: readers
only look for it at ``size - 24`` of a file that starts with FILE, and nothing searches for a
STREAM anywhere but at offset 0. Changing it would change the ``.kvc`` format, so it stays; a
new footer would need a new ``.kvc`` version whose reader still accepts this one.
"""

CONTAINER = b"KVCC"
STREAM = b"KVCE"
FILE = b"KVCF"
FILE_FOOTER = b"KVCE"
LMCACHE_FRAME = b"KVLC"

#: the magics that start an object, by what they start
LEADING = {CONTAINER: "container", STREAM: "entropy stream", FILE: ".kvc file"}
