"""Explicit 8-lane vector code for the ``mixed`` kernels, where numba's auto-vectorizer falls short.

numba compiles each helper here from LLVM IR (``@intrinsic``) or inlines it (``@inline``) into the
calling kernel; every one takes 1-D contiguous arrays (row views) and an index. The vectors are
``<8 x float>`` / ``i64`` values, lowered by LLVM to whatever the CPU has (AVX-512, AVX2, NEON).

* ``ld64`` / ``st64``: unaligned 8-byte loads and stores of packed K codes (one instead of up to 8
  byte loops per channel and chunk).
* ``wht`` (``wht8``, ``wht_fixed``, ``bfly8``): the unnormalized Walsh-Hadamard transform of a row,
  in the textbook butterfly order (distance 1, 2, 4, ... with ``p + q, p - q``), so its rounding is
  that of the plain scalar loops; the scalar form was 3/4 of the rotation's cost.
* ``row_minmax``: (min, max) of a row on two vector accumulators (the eight-scalar-lane form does
  not vectorize here and took half of ``vmid_encode``). Exact: min and max do not round.
"""

from __future__ import annotations

from typing import Any

from kvport.extras import require

try:
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import types  # type: ignore[import-untyped]
    from numba.core import cgutils  # type: ignore[import-untyped]
except ImportError:
    require("codecs", "the mixed codec")  # not installed: one line naming the extra
    raise  # installed but broken: the original error

from kvport.codec._kernels import _intrinsic, inline


def _byte_row(arr: Any) -> bool:
    return (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
            and arr.dtype == types.uint8)


@_intrinsic
def ld64(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Unaligned little-endian uint64 load of ``arr[idx:idx + 8]`` (1-D contiguous uint8; the caller
    keeps ``idx + 8 <= len(arr)``)."""
    if not _byte_row(arr) or not isinstance(idx, types.Integer):
        return None
    sig = types.uint64(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(ary.data, [i]), ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)

    return sig, codegen


@_intrinsic
def st64(typingctx: Any, arr: Any, idx: Any, val: Any) -> Any:
    """Unaligned little-endian uint64 store into ``arr[idx:idx + 8]`` (as :func:`ld64`)."""
    if not _byte_row(arr) or not isinstance(idx, types.Integer) or val != types.uint64:
        return None
    sig = types.void(arr, idx, val)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(ary.data, [i]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


def _f32_row(arr: Any) -> bool:
    return (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
            and arr.dtype == types.float32)


_V8 = ir.VectorType(ir.FloatType(), 8)


def _v8_ptr(context: Any, builder: Any, aryty: Any, ary: Any, idxty: Any, idx: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(data, [i]), _V8.as_pointer())


def _wht8_ir(builder: Any, v: Any) -> Any:
    """IR: the unnormalized 8-point Walsh-Hadamard transform of one 8-lane vector: butterflies of
    distance 1, 2, 4, each one shuffle, an add, a subtract and a blend."""
    lanes = ir.VectorType(ir.IntType(32), 8)
    for h in (1, 2, 4):  # lane j: v[j] + v[j + h] (bit h clear), v[j - h] - v[j] (set)
        other = builder.shuffle_vector(v, v, ir.Constant(lanes, [j ^ h for j in range(8)]))
        add = builder.fadd(v, other)
        sub = builder.fsub(other, v)
        v = builder.shuffle_vector(add, sub, ir.Constant(lanes, [8 + j if j & h else j for j in range(8)]))
    return v


@_intrinsic
def wht8(typingctx: Any, y: Any, a: Any) -> Any:
    """In place, the unnormalized 8-point Walsh-Hadamard transform of ``y[a:a + 8]`` (1-D contiguous
    fp32), on one vector (numba does not vectorize the scalar form)."""
    if not _f32_row(y) or not isinstance(a, types.Integer):
        return None
    sig = types.void(y, a)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _v8_ptr(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        builder.store(_wht8_ir(builder, builder.load(ptr, align=4)), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


WHT_IN_REGISTERS = (8, 16, 32, 64, 128)


@_intrinsic
def wht_fixed(typingctx: Any, y: Any) -> Any:
    """In place, the unnormalized Walsh-Hadamard transform of a 1-D contiguous fp32 row whose length
    is one of :data:`WHT_IN_REGISTERS`, fully unrolled on 8-lane vectors held in registers (one
    load and one store per vector, 2x faster than the same butterflies through memory); returns
    whether the length was one of those. Same butterflies in the same order as :func:`wht`'s loop."""
    if not _f32_row(y):
        return None
    sig = types.boolean(y)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(ary.shape, 0)
        done = cgutils.alloca_once_value(builder, cgutils.false_bit)
        end = builder.append_basic_block("wht.end")
        switch = builder.switch(n, end)
        for size in WHT_IN_REGISTERS:
            block = builder.append_basic_block(f"wht.{size}")
            switch.add_case(ir.Constant(n.type, size), block)
            builder.position_at_end(block)
            ptrs = [builder.bitcast(builder.gep(ary.data, [ir.Constant(n.type, 8 * i)]), _V8.as_pointer())
                    for i in range(size // 8)]
            vs = [_wht8_ir(builder, builder.load(p, align=4)) for p in ptrs]
            hv = 1  # then distances 8, 16, ...: whole vectors
            while hv < size // 8:
                for i in range(size // 8):
                    if not i & hv:
                        vs[i], vs[i + hv] = builder.fadd(vs[i], vs[i + hv]), builder.fsub(vs[i], vs[i + hv])
                hv *= 2
            for p, v in zip(ptrs, vs, strict=True):
                builder.store(v, p, align=4)
            builder.store(cgutils.true_bit, done)
            builder.branch(end)
        builder.position_at_end(end)
        return builder.load(done)

    return sig, codegen


@_intrinsic
def bfly8(typingctx: Any, y: Any, j: Any, h: Any) -> Any:
    """``y[j:j+8], y[j+h:j+h+8] = p + q, p - q`` on 8-lane vectors (1-D contiguous fp32)."""
    if not _f32_row(y) or not isinstance(j, types.Integer) or not isinstance(h, types.Integer):
        return None
    sig = types.void(y, j, h)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pp = _v8_ptr(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        jh = builder.add(context.cast(builder, args[1], signature.args[1], types.intp),
                         context.cast(builder, args[2], signature.args[2], types.intp))
        qp = _v8_ptr(context, builder, signature.args[0], args[0], types.intp, jh)
        p = builder.load(pp, align=4)
        q = builder.load(qp, align=4)
        builder.store(builder.fadd(p, q), pp, align=4)
        builder.store(builder.fsub(p, q), qp, align=4)
        return context.get_dummy_value()

    return sig, codegen


@_intrinsic
def range8(typingctx: Any, y: Any) -> Any:
    """(min, max) over the first ``8 * (len(y) // 8)`` values of a 1-D contiguous fp32 row, on two
    8-lane vector accumulators; (inf, -inf) for a row shorter than 8 (:func:`row_minmax` does the
    tail)."""
    if not _f32_row(y):
        return None
    sig = types.UniTuple(types.float32, 2)(y)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(ary.shape, 0)
        lo = cgutils.alloca_once_value(builder, ir.Constant(_V8, [float("inf")] * 8))
        hi = cgutils.alloca_once_value(builder, ir.Constant(_V8, [float("-inf")] * 8))
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(n.type, 8))) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
            v = builder.load(builder.bitcast(builder.gep(ary.data, [i]), _V8.as_pointer()), align=4)
            a, b = builder.load(lo), builder.load(hi)
            builder.store(builder.select(builder.fcmp_ordered("<", a, v), a, v), lo)
            builder.store(builder.select(builder.fcmp_ordered(">", b, v), b, v), hi)
        a, b = builder.load(lo), builder.load(hi)
        lanes = ir.VectorType(ir.IntType(32), 8)
        for w in (4, 2, 1):  # fold the lanes: exact, min and max do not round
            m = ir.Constant(lanes, [(j + w) % 8 for j in range(8)])
            sa, sb = builder.shuffle_vector(a, a, m), builder.shuffle_vector(b, b, m)
            a = builder.select(builder.fcmp_ordered("<", a, sa), a, sa)
            b = builder.select(builder.fcmp_ordered(">", b, sb), b, sb)
        zero = ir.Constant(ir.IntType(32), 0)
        return context.make_tuple(builder, signature.return_type,
                                  (builder.extract_element(a, zero), builder.extract_element(b, zero)))

    return sig, codegen


@inline
def row_minmax(y: Any) -> Any:
    """(min, max) of a 1-D contiguous fp32 row."""
    a, b = range8(y)
    nd = y.shape[0]
    for d in range(nd - nd % 8, nd):
        val = y[d]
        a = a if a < val else val
        b = b if b > val else val
    return a, b


@inline
def wht(y: Any) -> None:
    """In place, unnormalized Walsh-Hadamard transform (Sylvester order) of a row of 8 * 2^k fp32
    values: butterflies of distance 1, 2, 4 inside each chunk of 8, then 8, 16, ... across chunks
    (the textbook order, so the rounding is that of the plain scalar loops)."""
    if wht_fixed(y):
        return
    nd = y.shape[0]
    for a in range(0, nd, 8):
        wht8(y, a)
    h = 8
    while h < nd:
        for i in range(0, nd, 2 * h):
            for j in range(i, i + h, 8):
                bfly8(y, j, h)
        h *= 2
