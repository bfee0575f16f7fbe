"""Format 2's parallel chunk kernels: the model (``cdf.location``) + bins (``bins``) feed the 32-lane
rANS (``kvcodec.entropy.rans_lanes``) and a raw bit stream.

A chunk is a block of consecutive leading indices ``g`` x a block of tokens (about 65536 values;
``layout`` lists them). Inside a chunk the values go in order (g, t, d); value ``i`` is coded by
rANS lane ``i % lanes`` with the table of its class, and its raw bits go, in the same order, to
the chunk's bit stream (little-endian uint32 words, least significant bit first). The
previous-token term restarts at every (g, chunk) start. Chunks are independent: coded in parallel
(numba ``prange``) and any one decodes alone.

Encoding is two passes: ``symbolise`` (symbols, classes and raw codes of every value, and the
per-chunk class histograms the tables are fitted on), then ``write_chunks`` (raw bits, and the
rANS of each chunk through ``rans_lanes.encode`` with one context per value).

Decoding (``decode_chunks``) is one pass of four loops per token (see its docstring), written for
the CPU: the loops over a token's channels that can vectorise do (the raw-bit layout; the patterns,
residuals and the next token's model in one loop), the two serial ones (rANS symbols, raw-bit
positions) are short;
hot loops index with unsigned ints and take no array-argument helpers (numba adds wrap-around
code and reference counting there); kernels for the common dtypes have their bit layout compiled
in. Same streams and values as the plain per-value decoder it replaced (~2x faster).
"""

from __future__ import annotations

import math
from functools import lru_cache

import llvmlite.ir as ir
import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kvcodec._numba_cache import stable_closure_cache
from kvcodec.entropy import rans_lanes
from kvcodec.kernel_inputs import readonly
from kvcodec.lossless.predictive.bins import (
    CENTRE, DEPTH_MAX, ESC, MU_MAX, N_CLASSES, bin_grid, encode_value, float64_bits, locate, magnitude_symbol, pow2,
    value_of,
)
from kvcodec.lossless.predictive.cdf import location
from kvcodec.lossless.predictive.tables import COMPACT_STRIDE

_M = rans_lanes.M
_UNARY = DEPTH_MAX + 1  # bits peeked to read a unary depth


@njit(inline="always", cache=True)
def _mu_v(m, c, a, p, dev, inv_unit):
    """(base, mu in V units) with a non-finite location replaced by 0."""
    base, mu = location(m, c, p, a, dev)
    mv = mu * inv_unit
    if not (abs(mv) < MU_MAX):
        mv = 0.0
    return base, mv


@njit(parallel=True, cache=True)
def symbolise(pats, pred, has_pred, m, c, a, es, level, shared, mag, cg0, cng, ct0, cnt, coff,
              width, sign, mb, maxmag, escape, unit, inv_unit, packed, chunk_bits, hist):
    """Pass 1: every value (flat, chunk after chunk from ``coff``) as one int64 ``code << 24 |
    nbits << 16 | class << 8 | symbol`` (one store per value); per chunk the raw bit total and the
    [class, symbol] histogram. Per token three loops as the decoder's (the model and the residuals
    vectorise; unsigned indices: no wrap-around code). ``mag`` (0 / 1): the stream's "mag" flag
    (classes and symbols counted by magnitude: ``bins.magnitude_symbol``)."""
    d_n, t_n = pats.shape[2], pats.shape[1]
    eoff = 1023 - ((float64_bits(inv_unit) >> 52) & 0x7FF)  # inv_unit = 2**-eoff
    pf, prf = pats.reshape(-1), pred.reshape(-1)
    mf, cf, af, esf, lvf = m.reshape(-1), c.reshape(-1), a.reshape(-1), es.reshape(-1), level.reshape(-1)
    for ci in prange(cg0.size):
        dev = np.zeros(d_n, np.float64)
        base = np.empty(d_n, np.float64)
        t_ep = np.empty(d_n, np.int64)
        t_centre = np.empty(d_n, np.int64)
        t_cls = np.empty(d_n, np.int64)
        i = coff[ci]
        total = np.int64(0)
        for g in range(cg0[ci], cg0[ci] + cng[ci]):
            mo = (0 if shared else g) * d_n
            dev[:] = 0.0
            for t in range(ct0[ci], ct0[ci] + cnt[ci]):  # per token: model, bins, residuals (as the decoder)
                o = (g * t_n + t) * d_n
                for d in range(d_n):
                    k, di = np.uint64(mo + d), np.uint64(d)
                    p = np.float64(prf[np.uint64(o + d)]) if has_pred else 0.0
                    base[di], mv = _mu_v(mf[k], cf[k], af[k], p if np.isfinite(p) else 0.0, dev[di], inv_unit)
                    t_ep[di], t_centre[di], t_cls[di] = locate(mv, esf[k], lvf[k], mb, mag)
                for d in range(d_n):
                    pat = np.int64(pf[np.uint64(o + d)])
                    s, cd, nb = encode_value(pat, t_ep[d], t_centre[d], width, sign, mb, escape[pat])
                    s = magnitude_symbol(s, t_centre[d], mag)
                    packed[i + d] = (cd << 24) | (nb << 16) | (t_cls[d] << 8) | s
                    total += nb
                for d in range(d_n):  # an escaped value (NaN, Inf, outlier) leaves no residual
                    di = np.uint64(d)
                    v = value_of(np.int64(pf[np.uint64(o + d)]), sign, mb, eoff) - base[di]
                    dev[di] = 0.0 if (packed[np.uint64(i + d)] & 0xFF) == ESC else v
                i += d_n
        chunk_bits[ci] = total
        for i in range(coff[ci], coff[ci + 1]):
            hist[ci, (packed[i] >> 8) & 0xFF, packed[i] & 0xFF] += 1


@njit(parallel=True, cache=True)
def write_chunks(packed, coff, freq, cum, lanes, wcap, words, wstart, bstart, bits):
    """Pass 2: chunk ``ci``'s raw bits to ``bits[bstart[ci]:bstart[ci + 1]]`` and its rANS words to
    ``words[wcap[ci]:wcap[ci + 1]]`` (filled from the end; ``wstart[ci]`` = where they begin)."""
    for ci in prange(coff.size - 1):
        a, b = coff[ci], coff[ci + 1]
        sym = np.empty(b - a, np.uint8)
        cls = np.empty(b - a, np.uint8)
        acc = np.int64(0)
        have = 0
        wp = bstart[ci]
        for i in range(a, b):
            v = packed[i]
            sym[i - a] = v & 0xFF
            cls[i - a] = (v >> 8) & 0xFF
            n = (v >> 16) & 0xFF
            acc |= (v >> 24) << have
            have += n
            if have >= 32:
                bits[wp] = acc & 0xFFFFFFFF
                wp += 1
                acc >>= 32
                have -= 32
        if have > 0:
            bits[wp] = acc & 0xFFFFFFFF
        seg = words[wcap[ci]:wcap[ci + 1]]
        wstart[ci] = wcap[ci] + rans_lanes.encode(sym, 0, 1, cls, freq, cum, lanes, seg)


@njit(parallel=True, cache=True)
def gather_words(words, wstart, wcap):
    """The chunks' rANS words ``words[wstart[i]:wcap[i + 1]]`` back to back (the payload section)."""
    wlen = wcap[1:] - wstart
    off = np.zeros(wlen.size + 1, np.int64)
    off[1:] = np.cumsum(wlen)
    out = np.empty(off[-1], words.dtype)
    for ci in prange(wlen.size):
        out[off[ci]:off[ci + 1]] = words[wstart[ci]:wcap[ci + 1]]
    return out


def _bit_count_intrinsic(name: str):
    """An LLVM bit-count intrinsic (``llvm.ctlz`` / ``llvm.cttz``) on int64; 64 for x == 0."""

    @intrinsic
    def count(typingctx, x):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(1)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"{name}.i64")
            return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])
        return types.int64(types.int64), codegen

    return count


leading_zeros = _bit_count_intrinsic("llvm.ctlz")
trailing_zeros = _bit_count_intrinsic("llvm.cttz")


@intrinsic
def load_u64(typingctx, arr, i):
    """The 8 bytes of a uint8 array from byte ``i`` as a little-endian int64 (one unaligned load,
    no bounds check: the caller keeps ``i + 8 <= arr.size``)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    return types.int64(arr, types.int64), codegen


@intrinsic
def load_u32(typingctx, arr, i):
    """The 4 bytes of a uint8 array from byte ``i`` as a little-endian uint32, widened to int64 (one
    unaligned load, no bounds check)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        value = builder.load(builder.bitcast(ptr, ir.IntType(32).as_pointer()), align=1)
        return builder.zext(value, ir.IntType(64))
    return types.int64(arr, types.int64), codegen


def _vector_gep(builder, base, offsets, width: int):
    """``<width x i8*>``: ``base`` (an i8 pointer) + each of the int ``offsets`` (a vector GEP, which
    llvmlite's IR builder types as one pointer: the type is set here; an llvmlite without
    ``source_etype`` (typed pointers) refuses a vector index, so its operands are set here too)."""
    try:
        ptrs = builder.gep(base, [offsets], source_etype=ir.IntType(8))
    except TypeError:
        ptrs = builder.gep(base, [ir.Constant(ir.IntType(32), 0)])
        ptrs.indices = [offsets]
        ptrs.operands = [base, offsets]
    ptrs.type = ir.VectorType(base.type, width)
    return ptrs


def _rans_step(width: int):
    """An intrinsic ``step(xs, lane, tbase, d, compact, words, ptr, sym) -> ptr``: the rANS symbols
    of values ``d .. d + width - 1`` of a token, whose lanes ``lane .. lane + width - 1`` (uint32
    states ``xs``) are distinct, as ``width``-wide vector operations: the slot's symbol and its
    ``freq | cum << 16`` by two gathers from the two-level tables (:func:`tables.compact_tables`,
    class offsets ``tbase[d:]``), the state update, and the renormalisation as one expanding load of
    the next words into the lanes that need one (in lane order: the words the scalar loop reads),
    ``ptr`` advanced by their count; the symbols to ``sym[d:]`` (int64). No bounds checks: the caller
    keeps ``ptr + width <= words.size`` and ``d + width`` inside the token. The same values as the
    scalar loop in :func:`_chunk_decoder` (checked against it in the tests). LLVM emits AVX-512 gathers
    and ``vpexpandw`` where the CPU has them; the decoder uses the steps only there (:data:`VECTOR_STEPS`)."""

    @intrinsic
    def step(typingctx, xs, lane, tbase, d, compact, words, ptr, sym):
        sig = types.int64(xs, types.int64, tbase, types.int64, compact, words, types.int64, sym)

        def codegen(context, builder, signature, args):
            a_xs, a_lane, a_tb, a_d, a_cp, a_w, a_ptr, a_sym = args
            t_xs, _, t_tb, _, t_cp, t_w, _, t_sym = signature.args
            i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
            v16, v32, v64 = (ir.VectorType(t, width) for t in (i16, i32, i64))
            vbool, vptr = ir.VectorType(ir.IntType(1), width), ir.VectorType(i32.as_pointer(), width)

            def data(ty, val):
                return context.make_array(ty)(context, builder, val).data

            def splat(c, ty=v32):
                return ir.Constant(ty, [ir.Constant(ty.element, c)] * width)

            def intrinsic_fn(name, ret, argtys):
                return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)

            table = data(t_cp, a_cp)

            def gather_u32(offsets):  # the 4 bytes at table + offset, per lane
                ptrs = builder.bitcast(_vector_gep(builder, table, offsets, width), vptr)
                # (typed-pointer mangling: LLVM renames it where pointers are opaque)
                fn = intrinsic_fn(f"llvm.masked.gather.v{width}i32.v{width}p0i32", v32, [vptr, i32, vbool, v32])
                return builder.call(fn, [ptrs, ir.Constant(i32, 1), splat(1, vbool), ir.Constant(v32, ir.Undefined)])

            x_ptr = builder.bitcast(builder.gep(data(t_xs, a_xs), [a_lane]), v32.as_pointer())
            x = builder.load(x_ptr, align=4)
            tb_ptr = builder.bitcast(builder.gep(data(t_tb, a_tb), [a_d]), v64.as_pointer())
            tb = builder.trunc(builder.load(tb_ptr, align=8), v32)
            slot = builder.and_(x, splat(_M - 1))
            s = builder.and_(gather_u32(builder.add(tb, slot)), splat(0xFF))
            e = gather_u32(builder.add(builder.add(tb, splat(_M)), builder.shl(s, splat(2))))
            x = builder.mul(builder.and_(e, splat(0xFFFF)), builder.lshr(x, splat(12)))
            x = builder.sub(builder.add(x, slot), builder.lshr(e, splat(16)))
            need = builder.icmp_unsigned("<", x, splat(rans_lanes.RANS_L))
            expand = intrinsic_fn(f"llvm.masked.expandload.v{width}i16", v16, [i16.as_pointer(), vbool, v16])
            w = builder.call(expand, [builder.gep(data(t_w, a_w), [a_ptr]), need, ir.Constant(v16, ir.Undefined)])
            renormed = builder.or_(builder.shl(x, splat(16)), builder.zext(w, v32))
            builder.store(builder.select(need, renormed, x), x_ptr, align=4)
            sym_ptr = builder.bitcast(builder.gep(data(t_sym, a_sym), [a_d]), v64.as_pointer())
            builder.store(builder.zext(s, v64), sym_ptr, align=8)
            mask = ir.IntType(width)
            count = builder.call(intrinsic_fn(f"llvm.ctpop.i{width}", mask, [mask]), [builder.bitcast(need, mask)])
            return builder.add(a_ptr, builder.zext(count, i64))

        return sig, codegen

    return step


rans_step8, rans_step16 = _rans_step(8), _rans_step(16)


def _target_has_vector_steps() -> bool:
    """Whether numba compiles for a CPU with AVX-512 gathers and ``vpexpandw`` (AVX-512 VBMI2), where
    the vector steps pay. Elsewhere LLVM turns them into scalar code, slower than the scalar loop
    (measured with Haswell's features: the kernel 11.4 -> 13.7 ns a value), so they are not used."""
    try:
        from numba.core import codegen, config

        features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - no feature list: the scalar loop
        return False
    enabled = {f[1:] for f in str(features).split(",") if f.startswith("+")}
    return {"avx512f", "avx512vbmi2"} <= enabled


VECTOR_STEPS = _target_has_vector_steps()  # a compile-time constant of the kernels


@intrinsic
def _bits_float32(typingctx, x):
    """The float32 whose IEEE bits are the int32 ``x`` (a register bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


def prediction_at(pred, i):
    """The prediction ``pred[i]`` as float64; a uint16 ``pred`` holds bf16 bit patterns (the
    caller's bf16 prediction as is: no float32 copy of it)."""
    return np.float64(pred[i])


@overload(prediction_at, inline="always")
def _prediction_at(pred, i):
    if pred.dtype == types.uint16:
        return lambda pred, i: np.float64(_bits_float32(np.int32(pred[i]) << 16))
    return lambda pred, i: np.float64(pred[i])


@njit(inline="always", cache=True)
def raw_layout(sym, cen, ep, mb):
    """(raw bit count, magnitude pattern less its raw bits) of a non-ESC symbol outside bin 0;
    ``cen`` = the centre bin - CENTRE. Bin ``u`` of width 2**ep holds the patterns from V = u * 2**ep:
    ``sh`` = the exponent of their spacing, ``2**nb`` of them (one when the bin is the grid step)."""
    j = cen + sym
    u = j ^ (j >> 63)  # -1 - j or j
    sh = max(63 - leading_zeros(u | 1) + ep - mb, 0)
    nb = ep - sh
    hi = (sh << mb) + (u << (nb & 63))
    if u >= (np.int64(1) << mb):  # one pattern per bin
        nb = 0
        hi = u + (np.int64(ep) << mb)
    return nb, hi


@njit(inline="always", cache=True)
def decode_escape_or_bin0(sym, j, ep, acc, width, sign, mb, maxmag):
    """(pattern, raw bits used, kind) of an ESC symbol (kind 1: the pattern is verbatim) or of bin 0
    (kind 0: unary depth, then the mantissa); kind -1: malformed. ``acc`` holds >= 32 raw bits."""
    if sym == ESC:
        return acc & ((np.int64(1) << width) - 1), width, 1
    neg = j >> 63
    if ep <= mb + 1:
        mag = acc & ((np.int64(1) << ep) - 1)
        n = ep
    else:
        last = ep - mb - 1
        d = min(trailing_zeros(acc), _UNARY)
        if last < DEPTH_MAX and d >= last:
            mag = (acc >> last) & ((np.int64(1) << (mb + 1)) - 1)
            n = last + mb + 1
        elif d >= DEPTH_MAX:
            return 0, 0, -1
        else:
            mag = ((ep - mb - d) << mb) | ((acc >> (d + 1)) & ((np.int64(1) << mb) - 1))
            n = d + 1 + mb
    if mag > maxmag:
        return 0, 0, -1
    return mag | (sign & neg), n, 0


@njit(inline="always", cache=True)
def _pattern(hi, low, nbits, j, base, sign, mb, maxmag, eoff):
    """(bit pattern, residual, malformed) of a decoded value: ``hi + low`` is its magnitude (or, for
    ESC and bin 0, ``nbits < 0``, the whole pattern, bit 20 set for ESC: no residual), ``j`` its bin."""
    mag = hi + low
    slow = nbits < 0
    pat = mag & 0xFFFFF if slow else mag | (sign & (j >> 63))
    dev = 0.0 if mag >> 20 else value_of(pat, sign, mb, eoff) - base
    return pat, dev, (mag > maxmag) & (not slow)


@njit(inline="always", cache=True)
def _model(m, c, a, p, dev, es, level, inv_unit, mb, mag):
    """(base, table offset, centre bin - CENTRE, bin exponent) of the next value of a channel."""
    b, mv = _mu_v(m, c, a, p if np.isfinite(p) else 0.0, dev, inv_unit)
    ep, centre, cls = locate(mv, es, level, mb, mag)
    return b, cls * COMPACT_STRIDE, centre - CENTRE, ep


def _chunk_decoder(consts, mag: int):
    """The one-chunk decoder, with the dtype's (width, sign, mb, maxmag, eoff) compiled in as
    constants (``consts``), or read from its ``grid`` argument (None): the shifts and masks by
    constants make the specialised kernels ~10% faster; the generic one serves rarer dtypes. ``mag``
    (the stream's "mag" flag) is compiled in too: as an argument it cost every decode 13-15%."""
    special = consts is not None
    c_width, c_sign, c_mb, c_maxmag, c_eoff = consts or (0, 0, 0, 0, 0)
    c_mag = np.int64(mag)

    @njit(nogil=True, cache=True)
    def decode_chunk(words, ptr, bits8, pos0, g0, ng, t0, nt, pred, has_pred, pred_g0, pred_t0,
                     m, c, a, es, level, shared, compact, lanes, out, out_g0, out_t0, xs, grid):
        """Decode one chunk (see :func:`decode_chunks`): (error, rANS word position, raw bits used)."""
        if special:
            width, sign, mb, maxmag, eoff = c_width, c_sign, c_mb, c_maxmag, c_eoff
        else:
            width, sign, mb, maxmag, eoff = grid[0], grid[1], grid[2], grid[3], grid[4]
        inv_unit = pow2(-eoff)
        d_n = out.shape[2]
        flat, pflat = out.reshape(-1), pred.reshape(-1)
        mf, cf, af, esf, lvf = m.reshape(-1), c.reshape(-1), a.reshape(-1), es.reshape(-1), level.reshape(-1)
        base = np.empty(d_n, np.float64)
        tbase = np.empty(d_n, np.int64)  # per channel of the token: its table, bins, symbol, raw bits
        cen = np.empty(d_n, np.int64)
        t_ep = np.empty(d_n, np.int64)
        sym = np.empty(d_n, np.int64)
        nbits = np.empty(d_n, np.int64)
        hi = np.empty(d_n, np.int64)
        low = np.empty(d_n, np.int64)
        tail = np.empty(4 * d_n + 16, np.uint8)  # the section's last bytes, zero-padded
        pos = pos0
        lane0 = 0
        lm = lanes - 1
        n8, nw = bits8.size, words.size
        aligned = d_n % lanes == 0  # then every token starts at lane 0
        for g in range(g0, g0 + ng):
            gp = 0 if shared else g
            mo = gp * d_n
            o = ((g - out_g0) * out.shape[1] + (t0 - out_t0)) * d_n
            po = ((g - pred_g0) * pred.shape[1] + (t0 - pred_t0)) * d_n if has_pred else 0
            # np.uint64 indices below: no negative-index wrap-around code in the hot loops
            for d in range(d_n):  # 0. the first token's model (no residual yet)
                i, di = np.uint64(mo + d), np.uint64(d)
                p = prediction_at(pflat, np.uint64(po + d)) if has_pred else 0.0
                base[di], tbase[di], cen[di], t_ep[di] = _model(mf[i], cf[i], af[i], p, 0.0, esf[i], lvf[i], inv_unit,
                                                                mb, c_mag)
            for t in range(t0, t0 + nt):
                if has_pred and t + 1 < t0 + nt:  # the next token's prediction (the last token's: unused)
                    po += d_n
                # 1. the symbols. The common case (lane 0 at every token start, the token's words all
                # inside the section) on an AVX-512 CPU: 8 or 16 lanes at a time as vector operations
                # (:func:`_rans_step`; 7-10% of the kernel against the scalar loop). Else one value at a
                # time, reads clamped (an overrun shows as ptr > end); the renormalisation as a select
                if VECTOR_STEPS and aligned and ptr + d_n <= nw:
                    if lanes == 32:
                        for d in range(0, d_n, 16):
                            ptr = rans_step16(xs, d & lm, tbase, d, compact, words, ptr, sym)
                    else:
                        for d in range(0, d_n, 8):
                            ptr = rans_step8(xs, d & lm, tbase, d, compact, words, ptr, sym)
                else:
                    for d in range(d_n):
                        j = np.uint64((lane0 + d) & lm)
                        x = np.int64(xs[j])
                        tb = tbase[np.uint64(d)]
                        slot = x & (_M - 1)
                        s = np.int64(compact[np.uint64(tb + slot)])
                        e = load_u32(compact, tb + _M + 4 * s)
                        x = (e & 0xFFFF) * (x >> 12) + slot - (e >> 16)
                        need = x < rans_lanes.RANS_L
                        w = np.int64(words[np.uint64(min(ptr, nw - 1))])
                        xs[j] = np.uint32(((x << 16) | w) if need else x)
                        ptr += np.int64(need)
                        sym[np.uint64(d)] = s
                lane0 = (lane0 + d_n) & lm
                for d in range(d_n):  # 2. raw bit counts (vectorises); -1: ESC or bin 0
                    di = np.uint64(d)
                    s = magnitude_symbol(sym[di], cen[di] + CENTRE, c_mag)
                    sym[di] = s
                    nbits[di], hi[di] = raw_layout(s, cen[di], t_ep[di], mb)
                    j = cen[di] + s
                    if (j == 0) | (j == -1) | (s == ESC):
                        nbits[di] = -1
                # 3. the raw bits, in order (ESC and bin 0 whole here), by unaligned 8-byte reads of src: the
                # section, or near its end (< 32 bits a value) a zero-padded copy of its last bytes whose bit 0
                # is the section's bit skip (one loop for both: 3-9% faster than a read that tests for the end)
                src, skip = bits8, 0
                if (pos >> 3) + 4 * d_n + 8 > n8:
                    first = min(pos >> 3, n8)  # (a corrupt stream may have run past the end: zeros there)
                    skip = (pos >> 3) << 3
                    src = tail
                    src[:] = 0
                    for k in range(n8 - first):  # a loop: a slice copy compiles numba's shape-error text (~3 s)
                        src[k] = bits8[first + k]
                    pos -= skip
                for d in range(d_n):
                    di = np.uint64(d)
                    acc = load_u64(src, pos >> 3) >> (pos & 7)
                    n = nbits[di]
                    if n < 0:
                        pat, n, kind = decode_escape_or_bin0(sym[di], cen[di] + sym[di], t_ep[di], acc,
                                                             width, sign, mb, maxmag)
                        if kind < 0:
                            return 5, ptr, 0
                        hi[di] = pat | (kind << 20)  # bit 20: ESC (no residual)
                        low[di] = 0
                    else:
                        low[di] = acc & ((np.int64(1) << n) - 1)
                    pos += n
                pos += skip
                bad = False
                for d in range(d_n):  # 4. patterns, residuals and the next token's model (vectorises)
                    di, i = np.uint64(d), np.uint64(mo + d)
                    pat, dev, bad_d = _pattern(hi[di], low[di], nbits[di], cen[di] + sym[di], base[di], sign, mb,
                                               maxmag, eoff)
                    bad |= bad_d
                    flat[np.uint64(o + d)] = pat
                    p = prediction_at(pflat, np.uint64(po + d)) if has_pred else 0.0
                    base[di], tbase[di], cen[di], t_ep[di] = _model(mf[i], cf[i], af[i], p, dev, esf[i], lvf[i],
                                                                    inv_unit, mb, c_mag)
                if bad:
                    return 5, ptr, 0
                o += d_n
        return 0, ptr, pos - pos0

    @njit(parallel=True, cache=True)
    def decode_chunks(words, wstart, wlen, bits, bstart, blen, cg0, cng, ct0, cnt, pred, has_pred, pred_g0, pred_t0,
                      m, c, a, es, level, shared, compact, lanes, out, out_g0, out_t0, err, grid, rounds, chained):
        bits8 = bits.view(np.uint8)
        for r in range(rounds.size - 1):  # rounds in order (a round stops the rest if it fails)
            use_pred = has_pred and not (chained and r == 0)
            for ci in prange(rounds[r], rounds[r + 1]):
                ptr, end = wstart[ci], wstart[ci] + wlen[ci]
                if wlen[ci] < 2 * lanes:
                    err[ci] = 1
                    continue
                xs = np.empty(lanes, np.uint32)  # the rANS states (32-bit: the vector step's lanes)
                if not rans_lanes.start_states(words, ptr, lanes, xs):
                    err[ci] = 2
                    continue
                bad, ptr, used = decode_chunk(words, ptr + 2 * lanes, bits8, 32 * bstart[ci], cg0[ci], cng[ci],
                                              ct0[ci], cnt[ci], pred, use_pred, pred_g0, pred_t0, m, c, a, es, level,
                                              shared, compact, lanes, out, out_g0, out_t0, xs, grid)
                if bad:
                    err[ci] = bad
                    continue
                for j in range(lanes):
                    if xs[j] != rans_lanes.RANS_L:
                        bad = 4
                if bad or ptr != end or (used + 31) // 32 != blen[ci]:
                    err[ci] = 4
            failed = False
            for ci in range(rounds[r], rounds[r + 1]):
                failed |= err[ci] != 0
            if failed:
                break

    # its closure holds ``decode_chunk`` (a dispatcher): keyed by numba's pickle of it, the disk cache
    # missed in every new process (5-12 s of compiling the first decode) and grew by a file each time
    return stable_closure_cache(decode_chunks)


# (dtype, "mag" flag) of the streams the encoder writes by default: 16-bit without the flag, fp8 e4m3 with it
# (external prediction) and without; each has a kernel of its own (~13 s to compile), other layouts the generic one
_SPECIALISED = ((torch.bfloat16, 0), (torch.float16, 0), (torch.float8_e4m3fn, 0), (torch.float8_e4m3fn, 1))
_DECODERS: dict = {}


def decode_chunks(words, wstart, wlen, bits, bstart, blen, cg0, cng, ct0, cnt, pred, has_pred, pred_g0, pred_t0,
                  m, c, a, es, level, shared, compact, lanes, width, sign, mb, maxmag, escape, unit, inv_unit,
                  out, out_g0, out_t0, err, rounds=None, chained=False, mag=0):
    """Decode the listed chunks into ``out`` (bit patterns; its [0, 0] is (out_g0, out_t0)); the
    prediction's [0, 0] is (pred_g0, pred_t0). ``err[i]`` is set non-zero for a malformed chunk.
    Chunks run in parallel (numba ``prange``, the caller's thread count), in ``rounds`` (chunk index
    boundaries, int64; None: one round) one after the other, stopping after a round with an error.
    ``chained``: round 0 is decoded without the prediction (as by a zero one), the later rounds with
    it: the neighbour-layer predictor passes ``out`` itself as ``pred``, one round per layer, so a
    layer reads the one decoded before it (one call instead of one per layer: ~6 us a layer).
    ``mag`` (0 / 1): the stream's "mag" flag (symbols and classes counted by magnitude).

    The values of one token depend on the previous token only, so each token is four loops over
    its channels: the rANS symbols (two-level tables, :func:`tables.compact_tables`), the raw bit counts,
    the raw bits (a serial bit position), then the patterns and residuals together with the next
    token's model (bins and class: a channel's model needs only its own residual, so it stays in a
    register); loops 1 (lane-aligned tokens), 2 and 4 are vector operations. The raw bits are read
    with unaligned 8-byte loads (near the section's end from a zero-padded copy of its last bytes).
    A uint16 ``pred`` holds bf16 bit patterns (:func:`prediction_at`). Measured alternatives that
    were slower (one core): the raw bit counts inside the rANS loop (-25%), the raw bits as a serial
    position loop plus a gather loop (-10%; again with AVX-512 gathers: fp8 -10%), the raw
    bits 8 at a time with a prefix sum of their counts when none of the 8 is ESC or bin 0 (-6 to -9%).
    """
    del escape, unit  # the grid's tables: the decoder needs neither (values from exponent bits)
    kernel, grid = _decoder(width, sign, mb, maxmag, inv_unit, int(mag))
    # read-only views: one compile whether the stream came as bytes or bytearray
    if rounds is None:
        rounds = np.array([0, cg0.size], np.int64)
    kernel(readonly(words), wstart, wlen, readonly(bits), bstart, blen, cg0, cng, ct0, cnt, pred, has_pred,
           pred_g0, pred_t0, m, c, a, es, level, shared, compact, lanes, out, out_g0, out_t0, err, grid, rounds,
           chained)


@lru_cache(maxsize=None)
def _decoder(width: int, sign: int, mb: int, maxmag: int, inv_unit: float, mag: int = 0) -> tuple:
    """(chunk decoder, its grid argument) of a dtype's bit layout and "mag" flag: its own kernel for the
    layouts the encoder writes by default (``_SPECIALISED``), else the generic one (looked up once per
    layout: the lookups were ~2 us of a small chunk's call)."""
    eoff = 1 - math.frexp(inv_unit)[1]  # inv_unit = 2**-eoff
    consts = (int(width), int(sign), int(mb), int(maxmag), eoff)
    key = (consts if (consts, mag) in _specialised_consts() else None, mag)
    if key not in _DECODERS:
        _DECODERS[key] = _chunk_decoder(*key)
    return _DECODERS[key], readonly(np.array(consts, np.int64))


@lru_cache(maxsize=None)
def _specialised_consts() -> frozenset:
    """(bit layout, "mag" flag) pairs with a kernel of their own: bf16 (also float32's upper halves) and
    fp16 without the flag, fp8 e4m3 with and without it."""
    return frozenset(((g.width, g.sign, g.mb, g.maxmag, g.eoff), mag)
                     for t, mag in _SPECIALISED for g in [bin_grid(t)])


_ = N_CLASSES  # tables are [N_CLASSES * 4096]: one per class of ``bins.locate``
