"""Per-class symbol frequency tables of the fast (format 2) predictive coder: fitted, stored, read.

Each of the ``N_CLASSES`` classes of :mod:`bins` has its own table of 256 frequencies summing to
``2**12`` (the 32-lane rANS of :mod:`kvcodec.entropy.rans_lanes`), fitted per tensor on the exact
symbol counts (so every symbol that occurs has a frequency; an unused class has none). Stored
compactly: per class the range of nonzero frequencies below ESC, the frequencies in it and ESC's,
as one uint16 stream coded with :func:`kvcodec.entropy.encode`.
"""

from __future__ import annotations

import numpy as np

from kvcodec import entropy
from kvcodec.entropy import rans_lanes
from kvcodec.entropy.freq import quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.bins import ESC, N_CLASSES

TOTAL = rans_lanes.M


def fit_tables(counts: np.ndarray) -> np.ndarray:
    """int64 [N_CLASSES, 256] frequencies (rows sum to 2**12, or all 0 for an unused class)."""
    freq = np.zeros((N_CLASSES, 256), np.int64)
    for k in np.flatnonzero(counts.sum(axis=1)):
        freq[k] = quantize_frequencies(counts[k], rans_lanes.PRECISION)
    return freq


def pack_tables(freq: np.ndarray) -> np.ndarray:
    """The tables as bytes: per class ``n`` (0 = unused), then ``lo``, ``n`` frequencies of symbols
    lo .. lo+n-1 and ESC's frequency."""
    out = []
    for row in freq:
        nz = np.flatnonzero(row[:ESC])
        if not row.any():
            out.append([0])
            continue
        lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
        out.append([hi - lo, lo, *row[lo:hi].tolist(), int(row[ESC])] if nz.size else [0xFFFF, int(row[ESC])])
    flat = np.array([v for part in out for v in part], np.uint16)
    return np.frombuffer(entropy.encode(flat, coder="rans"), np.uint8)


def unpack_tables(blob: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_tables`; CorruptStreamError unless every used row sums to 2**12."""
    flat = entropy.decode(blob.tobytes(), max_symbols=N_CLASSES * 260, max_output_bytes=None)
    if flat.dtype != np.uint16:
        raise CorruptStreamError("predictive stream has malformed frequency tables")
    flat = flat.astype(np.int64)
    freq = np.zeros((N_CLASSES, 256), np.int64)
    pos = 0
    for k in range(N_CLASSES):
        if pos >= flat.size:
            raise CorruptStreamError("predictive stream frequency tables end early")
        n = int(flat[pos])
        pos += 1
        if n == 0:
            continue
        if n == 0xFFFF:  # only ESC
            lo, n = 0, 0
        else:
            if pos >= flat.size:
                raise CorruptStreamError("predictive stream frequency tables end early")
            lo = int(flat[pos])
            pos += 1
        if lo + n > ESC or pos + n + 1 > flat.size:
            raise CorruptStreamError("predictive stream has malformed frequency tables")
        freq[k, lo:lo + n] = flat[pos:pos + n]
        freq[k, ESC] = flat[pos + n]
        pos += n + 1
        if int(freq[k].sum()) != TOTAL:
            raise CorruptStreamError("predictive stream frequency table does not sum to 2**12")
    if pos != flat.size:
        raise CorruptStreamError("predictive stream has trailing frequency table data")
    return freq


def decode_tables(freq: np.ndarray) -> np.ndarray:
    """uint32 [N_CLASSES * 4096] rANS decode tables (an unused class decodes everything as ESC)."""
    full = freq.copy()
    full[~full.any(axis=1), ESC] = TOTAL
    return rans_lanes.decode_tables(full)
