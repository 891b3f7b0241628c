#!/usr/bin/env python3
"""Writes the GGUF test files of tests/test_gguf.cpp into tests/data/gguf/ (a few tens of KB).

quant.gguf           one [3][512] tensor per ggml type lfserve dequantizes, named t.<TYPE>: values
                     quantized by gguf.quants.quantize where the package can quantize the type,
                     and random (valid) block bytes with finite fp16 scales for the K-quants,
                     which it can only dequantize.
quant_expected.gguf  the same names as F32 tensors: gguf.quants.dequantize of each, the reference
                     that lfserve's dequantization must match bit for bit.
meta.gguf            metadata of every value type (scalars and arrays, strings included),
                     general.alignment = 64, small F32 tensors (1-, 2- and 3-D) and a q/k
                     weight and bias in llama.cpp's rotary row order.

Needs the python `gguf` package and numpy (pip install gguf numpy). Deterministic (fixed seed).
Run from anywhere: python3 tools/make_gguf_testdata.py
"""
import os
import sys

import numpy as np

from gguflib import rotary_permute, write_out

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V
except ImportError:
    sys.exit("make_gguf_testdata.py needs the python gguf package: pip install gguf numpy")

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "gguf")
ROWS, COLS = 3, 512

# Types the package quantizes itself, and the K-quants it only dequantizes (random blocks).
QUANTIZED = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0]
RANDOM_BLOCKS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_kquant_blocks(rng, qtype, n_blocks):
    """Random block bytes whose fp16 d (and dmin) are finite, modest numbers."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    def f16_bytes(lo, hi):
        v = rng.uniform(lo, hi, size=n_blocks).astype(np.float16)
        return v.view(np.uint8).reshape(n_blocks, 2)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        b[:, 0:2] = f16_bytes(-0.05, 0.05)
        b[:, 2:4] = f16_bytes(-0.02, 0.02)
    elif qtype == Q.Q6_K:  # d last
        b[:, type_size - 2:] = f16_bytes(-0.05, 0.05)
    return b


def write_quant(rng):
    w = gguf.GGUFWriter(os.path.join(OUT, "quant.gguf"), "lftest")
    e = gguf.GGUFWriter(os.path.join(OUT, "quant_expected.gguf"), "lftest")
    for qtype in QUANTIZED + RANDOM_BLOCKS:
        name = "t." + qtype.name
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in QUANTIZED:
            x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
            x[0, :5] = [0.0, -0.0, 1e-6, 65504.0 if qtype != Q.F16 else 1.0, -3.5]
            data = gguf.quants.quantize(x, qtype)
        else:
            data = random_kquant_blocks(rng, qtype, ROWS * COLS // block)
            data = data.reshape(ROWS, COLS // block * type_size)
        ref = gguf.quants.dequantize(data, qtype).astype(np.float32)
        assert ref.shape == (ROWS, COLS), (qtype.name, ref.shape)
        assert np.all(np.isfinite(ref)), qtype.name
        if qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
        e.add_tensor(name, ref)
    write_out(w)
    write_out(e)


def write_meta():
    w = gguf.GGUFWriter(os.path.join(OUT, "meta.gguf"), "lftest")
    w.add_custom_alignment(64)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.15625)
    w.add_bool("test.bool_t", True)
    w.add_bool("test.bool_f", False)
    w.add_string("test.str", "hello, GGUF \u2713")
    w.add_key_value("test.empty_str", "", V.STRING)  # add_string skips empty strings
    w.add_uint64("test.u64_small", 12345)
    w.add_uint64("test.u64_big", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 2.718281828459045)
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, -1.25])
    w.add_array("test.arr_str", ["", "a", "<0x0A>", "\u00fcn\u00ef", "with space"])
    w.add_array("test.arr_bool", [True, False, True])
    w.add_key_value("test.arr_u8", [0, 1, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("test.arr_i64", [-(2**40), 7], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("test.arr_f64", [1.5, -0.1], V.ARRAY, sub_type=V.FLOAT64)
    w.add_tensor("mat", np.arange(12, dtype=np.float32).reshape(3, 4))  # ne = {4, 3}
    w.add_tensor("cube", np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    w.add_tensor("vec", np.arange(8, dtype=np.float32) * -0.5)
    # Q/K rows as llama.cpp's converter stores them (rotary halves interleaved per head): reading
    # with row_perm_heads = 2 must give back the plain aranges.
    w.add_tensor("perm.weight", rotary_permute(np.arange(24, dtype=np.float32).reshape(8, 3), 2))
    w.add_tensor("perm.bias", rotary_permute(np.arange(8, dtype=np.float32), 2))
    write_out(w)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20240607)
    write_quant(rng)
    write_meta()
    for f in sorted(os.listdir(OUT)):
        print(f"{f}: {os.path.getsize(os.path.join(OUT, f))} bytes")


if __name__ == "__main__":
    main()
