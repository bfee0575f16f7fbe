"""Range coder, numba: the same bytes as the reference ``range_coder`` at compiled speed.

The coder arithmetic mirrors ``range_coder.RangeEncoder``/``RangeDecoder`` line for line;
the models' integer functions (``models._qmath``) are the very ones the reference calls.
numba has no bounds checks, so every input is validated in Python before a kernel runs,
the output buffer is sized from a proven bound (a step out of ``total`` shrinks the
range by less than ``2*total``), and the decoder reads past the payload's end as zero
bytes. Kernels report corruption with a status code that becomes ``CorruptStreamError``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import CorruptStreamError
from .models import _qmath as q
from .models.base import CumulativeTables, Model, QuantizedFamily
from .models.categorical import symbol_dtype
from .models.quantized import MEAN_CLIP, mean_to_q, scale_bits_to_idx
from .range_coder import static_model
from ..kernel_inputs import readonly

TOP = 1 << 24
MASK32 = (1 << 32) - 1
OK, BAD_TARGET, BAD_SYMBOL = 0, 1, 2
_WHY = {BAD_TARGET: "target beyond the total frequency", BAD_SYMBOL: "a symbol decodes outside the model's support"}


# ---------------------------------------------------------------- coder primitives
@njit(inline="always")
def _udiv(a, b):
    """a // b for 0 <= a < 2**32, 0 < b < 2**32 (code, range and r always are): a 32-bit
    unsigned divide, cheaper than int64 // with its floor-sign fix-ups."""
    return np.int64(np.uint32(a) // np.uint32(b))


@njit(inline="always")
def _shift_low(low, cache, pending, out, pos):
    if low < 0xFF000000 or low > MASK32:
        carry = low >> 32
        out[pos] = (cache + carry) & 0xFF
        pos += 1
        fill = (0xFF + carry) & 0xFF
        while pending > 0:
            out[pos] = fill
            pos += 1
            pending -= 1
        cache = (low >> 24) & 0xFF
    else:
        pending += 1
    return (low & 0x00FFFFFF) << 8, cache, pending, pos


@njit(inline="always")
def _enc_narrow(low, rng, cache, pending, out, pos, r, cum, freq):
    """Narrow the interval to [cum, cum + freq) in units of r, then renormalise bytewise."""
    low += r * cum
    rng = r * freq
    while rng < TOP:
        rng <<= 8
        low, cache, pending, pos = _shift_low(low, cache, pending, out, pos)
    return low, rng, cache, pending, pos


@njit(inline="always")
def _enc_step(low, rng, cache, pending, out, pos, cum, freq, total):
    return _enc_narrow(low, rng, cache, pending, out, pos, _udiv(rng, total), cum, freq)


@njit(inline="always")
def _enc_step_pow2(low, rng, cache, pending, out, pos, cum, freq, bits):
    """_enc_step with total = 2**bits (range >> bits == range // 2**bits)."""
    return _enc_narrow(low, rng, cache, pending, out, pos, rng >> bits, cum, freq)


@njit(inline="always")
def _enc_uniform(low, rng, cache, pending, out, pos, value, count, j):
    """models.base.uniform_steps: one step, or (high, low 16 bits) when count > 2**16.

    ``count == 2**j`` (a full bucket, the common case) takes the shift instead of a division.
    """
    if count == (1 << j) and j <= 16:
        if j > 0:
            low, rng, cache, pending, pos = _enc_step_pow2(low, rng, cache, pending, out, pos, value, 1, j)
    elif count > 65536:
        high = value >> 16
        low, rng, cache, pending, pos = _enc_step(low, rng, cache, pending, out, pos, high, 1, (count + 65535) >> 16)
        rest = count - (high << 16)
        low, rng, cache, pending, pos = _enc_step(
            low, rng, cache, pending, out, pos, value & 0xFFFF, 1, 65536 if rest > 65536 else rest
        )
    elif count > 1:
        low, rng, cache, pending, pos = _enc_step(low, rng, cache, pending, out, pos, value, 1, count)
    return low, rng, cache, pending, pos


@njit(inline="always")
def _enc_finish(low, rng, cache, pending, out, pos):
    hi = low + rng - 1
    for k in range(32, -1, -1):
        v = ((low + (1 << k) - 1) >> k) << k
        if v <= hi:
            low = v
            break
    for _ in range(5):
        low, cache, pending, pos = _shift_low(low, cache, pending, out, pos)
    while pos > 1 and out[pos - 1] == 0:
        pos -= 1
    return pos  # out[0] is LZMA's always-zero first byte: the payload is out[1:pos]


@njit(inline="always")
def _read(buf, pos):
    return (np.int64(buf[pos]) if pos < buf.shape[0] else np.int64(0)), pos + 1


@njit(inline="always")
def _dec_init(buf):
    code, pos = np.int64(0), 0
    for _ in range(4):
        b, pos = _read(buf, pos)
        code = (code << 8) | b
    return code, np.int64(MASK32), pos


@njit(inline="always")
def _dec_advance(buf, pos, code, rng, r, cum, freq):
    """Consume [cum, cum+freq) and renormalise without a data-dependent loop.

    Every step leaves range >= 2**8 (r >= 2**8 because range >= 2**24 and total <= 2**16),
    so 0, 1 or 2 bytes come in: k = (range < 2**24) + (range < 2**16).
    """
    code -= r * cum
    rng = r * freq
    k = np.int64(rng < TOP) + np.int64(rng < (1 << 16))
    if pos + 2 <= buf.shape[0]:
        word = (np.int64(buf[pos]) << 8) | np.int64(buf[pos + 1])
    else:
        b0, _ = _read(buf, pos)
        b1, _ = _read(buf, pos + 1)
        word = (b0 << 8) | b1
    code = (code << (8 * k)) | (word >> (8 * (2 - k)))
    rng <<= 8 * k
    return code, rng, pos + k


@njit(inline="always")
def _dec_uniform_step(buf, pos, code, rng, total):
    """One uniform step; value -1 when the target lies beyond ``total`` (corrupt)."""
    r = _udiv(rng, total)
    v = _udiv(code, r)
    if v >= total:
        return np.int64(-1), code, rng, pos
    code, rng, pos = _dec_advance(buf, pos, code, rng, r, v, 1)
    return v, code, rng, pos


@njit(inline="always")
def _dec_uniform(buf, pos, code, rng, count, j):
    """Inverse of _enc_uniform; value -1 on corruption."""
    if count == (1 << j) and j <= 16:
        if j == 0:
            return np.int64(0), code, rng, pos
        r = rng >> j
        v = _udiv(code, r)
        if v >= count:
            return np.int64(-1), code, rng, pos
        code, rng, pos = _dec_advance(buf, pos, code, rng, r, v, 1)
        return v, code, rng, pos
    if count > 65536:
        high, code, rng, pos = _dec_uniform_step(buf, pos, code, rng, (count + 65535) >> 16)
        if high < 0:
            return high, code, rng, pos
        rest = count - (high << 16)
        v, code, rng, pos = _dec_uniform_step(buf, pos, code, rng, 65536 if rest > 65536 else rest)
        if v < 0:
            return v, code, rng, pos
        return (high << 16) | v, code, rng, pos
    if count > 1:
        return _dec_uniform_step(buf, pos, code, rng, count)
    return np.int64(0), code, rng, pos


# ---------------------------------------------------------------- categorical / static
@njit(cache=True)
def _encode_cum(sym, cum, bits, out):
    """Returns the end position, or -1 when a symbol is outside the table or has zero frequency."""
    low, rng, cache, pending, pos = np.int64(0), np.int64(MASK32), np.int64(0), np.int64(0), 0
    shared = cum.shape[0] == 1
    alpha = cum.shape[1] - 1
    for i in range(sym.shape[0]):
        row = 0 if shared else i
        x = np.int64(sym[i])
        if x < 0 or x >= alpha:
            return -1
        c = np.int64(cum[row, x])
        f = np.int64(cum[row, x + 1]) - c
        if f == 0:
            return -1
        low, rng, cache, pending, pos = _enc_step_pow2(low, rng, cache, pending, out, pos, c, f, bits)
    return _enc_finish(low, rng, cache, pending, out, pos)


@njit(cache=True)
def _decode_cum(buf, cum, bits, out):
    code, rng, pos = _dec_init(buf)
    total = np.int64(1) << bits
    alpha = cum.shape[1] - 1
    for i in range(out.shape[0]):
        r = rng >> bits
        v = _udiv(code, r)
        if v >= total:
            return BAD_TARGET, pos
        a, b = 0, alpha  # cum[a] <= v < cum[b]
        while b - a > 1:
            m = (a + b) >> 1
            if cum[i, m] <= v:
                a = m
            else:
                b = m
        c = np.int64(cum[i, a])
        code, rng, pos = _dec_advance(buf, pos, code, rng, r, c, np.int64(cum[i, a + 1]) - c)
        out[i] = a
    return OK, pos


@njit(cache=True)
def _decode_lut(buf, cum, lut, bits, out):
    """Shared table: the symbol of target v is lut[v] (one 2**bits table for all symbols)."""
    code, rng, pos = _dec_init(buf)
    total = np.int64(1) << bits
    for i in range(out.shape[0]):
        r = rng >> bits
        v = _udiv(code, r)
        if v >= total:
            return BAD_TARGET, pos
        x = lut[v]
        c = np.int64(cum[x])
        code, rng, pos = _dec_advance(buf, pos, code, rng, r, c, np.int64(cum[x + 1]) - c)
        out[i] = x
    return OK, pos


# ---------------------------------------------------------------- quantized Gaussian / Laplace
_GUESS_BITS = 12  # the token guess reads a 2**12-entry inverse-CDF table per family


def _inverse_cdf_tables() -> np.ndarray:
    """z(a) with P(Z < z) = a at the centres of 2**12 mass bins, per family (a search hint only:
    floats are fine here, the token is confirmed with integer CDF points)."""
    n = 1 << _GUESS_BITS
    a = (np.arange(n) + 0.5) / n
    tail = np.minimum(a, 1.0 - a) * q.ONE  # mass in the nearer tail
    out = np.empty((2, n))
    for fam, tab in ((q.GAUSSIAN, q._GAUSS), (q.LAPLACE, q._LAPLACE)):
        u = np.arange(tab.shape[0]) / float(1 << (q.Z_BITS - q._INTERP_BITS))
        z = np.interp(tail, tab[::-1].astype(np.float64), u[::-1])
        out[fam] = np.where(a < 0.5, -z, z)
    return out


_Z_OF_MASS = _inverse_cdf_tables()
_SCALE_F = 2.0 ** (np.arange(q.SIDX_MIN, q.SIDX_MAX + 1) / 32.0)


@njit(inline="always")
def _guess_token(v, fr, lo, mean_q, sidx, fam):
    """Token whose mass holds target v, from the inverse CDF: exactness comes from the search after.

    On the decoder's serial path only an integer multiply-shift (removing the floor of one
    count per token), one table load, one multiply-add and a conversion; the bucket-scaled
    mean and scale come from per-symbol parameters.
    """
    j, nsym, nb, wl, wh, el, er, ntok = fr
    inv_bucket = 1.0 / (1 << j)
    base = (mean_q * (1.0 / (1 << q.MEAN_FRAC_BITS)) + 0.5 - lo) * inv_bucket
    scale = _SCALE_F[sidx - q.SIDX_MIN] * inv_bucket
    mult = (np.int64(1) << (16 + _GUESS_BITS)) // ((1 << q.PRECISION) - ntok)
    k = ((v - (ntok >> 1)) * mult) >> 16
    k = 0 if k < 0 else ((1 << _GUESS_BITS) - 1 if k >= (1 << _GUESS_BITS) else k)
    b = base + _Z_OF_MASS[fam, k] * scale
    if b < wl:
        return 0
    if b >= wh + 1:
        return ntok - 1
    return el + int(b) - wl


@njit(inline="always")
def _find_token_guided(v, fr, lo, mean_q, sidx, wq, fam):
    """(t, cum(t), cum(t+1)) with cum(t) <= v < cum(t+1): guess, gallop, then bisect."""
    ntok = fr[7]
    t = _guess_token(v, fr, lo, mean_q, sidx, fam)
    c = q.token_cum(t, fr, lo, mean_q, sidx, wq, fam)
    if c <= v:
        a, ca = t, c
        step = 1
        while True:  # find b > a with cum(b) > v
            b = a + step
            if b >= ntok:
                b, cb = ntok, np.int64(1) << q.PRECISION
                break
            cb = q.token_cum(b, fr, lo, mean_q, sidx, wq, fam)
            if cb > v:
                break
            a, ca = b, cb
            step <<= 1
    else:
        b, cb = t, c
        step = 1
        while True:  # find a < b with cum(a) <= v
            a = b - step
            if a <= 0:
                a, ca = 0, np.int64(0)
                break
            ca = q.token_cum(a, fr, lo, mean_q, sidx, wq, fam)
            if ca <= v:
                break
            b, cb = a, ca
            step <<= 1
    while b - a > 1:
        m = (a + b) >> 1
        cm = q.token_cum(m, fr, lo, mean_q, sidx, wq, fam)
        if cm <= v:
            a, ca = m, cm
        else:
            b, cb = m, cm
    return a, ca, cb


@njit(inline="always")
def _symbol_params(i, mean_f, scale_bits, wq, lo, hi, fam):
    """Symbol i's quantized (mean, scale index, wide weight) and its frame (one entry or one per symbol)."""
    m = mean_to_q(mean_f[i if mean_f.shape[0] > 1 else 0], lo - MEAN_CLIP, hi + MEAN_CLIP)
    s = scale_bits_to_idx(scale_bits[i if scale_bits.shape[0] > 1 else 0])
    w = np.int64(wq[i if wq.shape[0] > 1 else 0])
    return m, s, w, q.symbol_frame(lo, hi, m, s, fam)


@njit(cache=True)
def _encode_quant(sym, mean_f, scale_bits, wq, lo, hi, fam, out):
    low, rng, cache, pending, pos = np.int64(0), np.int64(MASK32), np.int64(0), np.int64(0), 0
    for i in range(sym.shape[0]):
        m, s, w, fr = _symbol_params(i, mean_f, scale_bits, wq, lo, hi, fam)
        t, idx, count = q.split_symbol(np.int64(sym[i]), fr, lo)
        c0 = q.token_cum(t, fr, lo, m, s, w, fam)
        c1 = q.token_cum(t + 1, fr, lo, m, s, w, fam)
        low, rng, cache, pending, pos = _enc_step_pow2(low, rng, cache, pending, out, pos, c0, c1 - c0, q.PRECISION)
        low, rng, cache, pending, pos = _enc_uniform(low, rng, cache, pending, out, pos, idx, count, fr[0])
    return _enc_finish(low, rng, cache, pending, out, pos)


@njit(cache=True)
def _decode_quant(buf, mean_f, scale_bits, wq, lo, hi, fam, out):
    code, rng, pos = _dec_init(buf)
    total = np.int64(1) << q.PRECISION
    for i in range(out.shape[0]):
        m, s, w, fr = _symbol_params(i, mean_f, scale_bits, wq, lo, hi, fam)
        r = rng >> q.PRECISION
        v = _udiv(code, r)
        if v >= total:
            return BAD_TARGET, pos
        t, c0, c1 = _find_token_guided(v, fr, lo, m, s, w, fam)
        code, rng, pos = _dec_advance(buf, pos, code, rng, r, c0, c1 - c0)
        raw, code, rng, pos = _dec_uniform(buf, pos, code, rng, q.raw_count(t, fr), fr[0])
        if raw < 0:
            return BAD_TARGET, pos
        x = q.join_symbol(t, raw, fr, lo)
        if x < lo:
            return BAD_SYMBOL, pos
        out[i] = x
    return OK, pos


# ---------------------------------------------------------------- Python entry points
def _payload_array(payload) -> np.ndarray:
    """The payload as read-only uint8 (one compiled decoder for bytes, bytearray and arrays alike)."""
    if isinstance(payload, np.ndarray):
        return readonly(np.ascontiguousarray(payload.reshape(-1).view(np.uint8)))
    buf = bytes(payload) if not isinstance(payload, (bytes, bytearray, memoryview)) else payload
    return readonly(np.frombuffer(buf, dtype=np.uint8))


def _finish_decode(status: int, pos: int, nbytes: int) -> None:
    if status != OK:
        raise CorruptStreamError(f"range coder payload is corrupt: {_WHY[status]}")
    if pos < nbytes:
        raise CorruptStreamError(f"range coder payload is corrupt: {nbytes - pos} bytes left after the last symbol")


def _capacity(n: int, bits_per_symbol: int) -> int:
    return (n * bits_per_symbol + 7) // 8 + 16


def _check_symbols(sym: np.ndarray, lo: int, hi: int) -> np.ndarray:
    if sym.size and not np.issubdtype(sym.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got {sym.dtype}")
    if sym.size and (int(sym.min()) < lo or int(sym.max()) > hi):
        raise ValueError(f"symbols must lie in [{lo}, {hi}]")
    return sym


def _as_int64(sym: np.ndarray) -> np.ndarray:
    """Checked integer symbols as int64: one compiled encoder whatever the caller's integer type (each
    type would compile its own, seconds each; the copy is small next to the coding). A uint64 symbol past
    int64's range wraps negative, which the encoders reject as outside the alphabet."""
    return sym.astype(np.int64, copy=False)


def _encode_tables(sym: np.ndarray, model: CumulativeTables) -> bytes:
    if sym.size and not np.issubdtype(sym.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got {sym.dtype}")
    out = np.empty(_capacity(sym.shape[0], model.precision + 1), dtype=np.uint8)
    pos = _encode_cum(_as_int64(sym), model.cum, model.precision, out)
    if pos < 0:
        raise ValueError(f"a symbol is outside [0, {model.alphabet}) or has zero probability under the model")
    return out[1:pos].tobytes()


def _decode_tables(buf: np.ndarray, model: CumulativeTables, n: int) -> np.ndarray:
    out = np.empty(n, dtype=model.dtype)
    if model.freqs.shape[0] == 1:
        lut = np.repeat(np.arange(model.alphabet, dtype=np.int32), model.freqs[0]).astype(model.dtype)
        status, pos = _decode_lut(buf, model.cum[0], lut, model.precision, out)
    else:
        status, pos = _decode_cum(buf, model.cum, model.precision, out)
    _finish_decode(status, pos, buf.shape[0])
    return out


def _quant_args(model: QuantizedFamily):
    """Float parameters: the kernels quantize them per symbol with the models' own functions."""
    return model.mean_f, model.scale_bits, model.weight_q, model.lo, model.hi, model.family


def _encode_quantized(sym: np.ndarray, model: QuantizedFamily) -> bytes:
    _check_symbols(sym, model.lo, model.hi)
    # a step of total T shrinks the range by less than 2*T: token <= 17 bits, uniform index <= 15 + 17
    out = np.empty(_capacity(sym.shape[0], 17 + 32), dtype=np.uint8)
    pos = _encode_quant(_as_int64(sym), *_quant_args(model), out)
    return out[1:pos].tobytes()


def _decode_quantized(buf: np.ndarray, model: QuantizedFamily, n: int) -> np.ndarray:
    out = np.empty(n, dtype=model.dtype)
    status, pos = _decode_quant(buf, *_quant_args(model), out)
    _finish_decode(status, pos, buf.shape[0])
    return out


# the kernels for each form a model can take (Model.fast_form): (encode, decode)
_KERNELS = {CumulativeTables: (_encode_tables, _decode_tables), QuantizedFamily: (_encode_quantized, _decode_quantized)}


def _kernels(model: Model):
    """(form, encode, decode) of a model; ValueError when it has no form this coder runs."""
    try:
        form = model.fast_form()
    except NotImplementedError:
        form = None
    if type(form) not in _KERNELS:
        raise ValueError(f"no fast coder for {type(model).__name__}; use kvcodec.entropy.range_coder")
    return (form, *_KERNELS[type(form)])


def encode(symbols, model: Model) -> bytes:
    """Code ``symbols`` (1-D integers), symbol i under the model's distribution i. Same bytes as range_coder.encode."""
    sym = np.ascontiguousarray(np.asarray(symbols).reshape(-1))
    model.check_count(sym.shape[0])
    form, enc, _ = _kernels(model)
    return enc(sym, form)


def decode(payload, model: Model, n: int) -> np.ndarray:
    """Decode ``n`` symbols; CorruptStreamError if the payload cannot come from ``encode``."""
    model.check_count(n)
    buf = _payload_array(payload)
    form, _, dec = _kernels(model)
    return dec(buf, form, n)


def encode_static(symbols, freqs, precision_bits: int) -> bytes:
    """Code all symbols with one shared frequency table (the front door's coder="arith")."""
    return encode(symbols, static_model(freqs, precision_bits))


def decode_static(payload, freqs, precision_bits: int, n: int) -> np.ndarray:
    """Inverse of encode_static; uint8 output for alphabets <= 256, else uint16."""
    model = static_model(freqs, precision_bits)
    out = decode(payload, model, n)
    return out.astype(symbol_dtype(model.alphabet), copy=False)
