"""float8 e4m3fn in the Triton kernels: codes read and written as plain bytes, and the
blockwise FP8 linear layer (model/quantized.py `fp8_linear`) as one GEMM over the codes.

Codes travel as uint8 and are decoded and encoded with integer arithmetic, exactly, rather
than through Triton's float8 types: Triton's interpreter (the CPU tests) loads float8e4nv
right but rounds a float32 -> float8e4nv cast toward zero without saturating (500.0
became 256.0, 1.0625 became 1.125 when probed), and GPUs before sm89 have no e4m3
conversions at all. The arithmetic is the same on every device, so what the interpreter
tests is what a GPU runs.

- `e4m3_values`: a code's value, exact in float32 (and in bf16/fp16: 4 significant bits).
- `e4m3_codes`: float32 -> code, saturated to +-448 and rounded to nearest even, as
  torch's cast after model/kv_fp8.py's clamp (the FP8 KV cache's writes).
- `e5m2_values`, `e5m2_codes`: the same for e5m2 (an FP8 KV cache of
  --kv-cache-dtype fp8_e5m2): a code is its float16's high byte; writes saturate to
  +-57344 and round to nearest even.
- `kv_values`, `kv_codes`: either format, by the kernels' `FP8` constant (`E4M3`, `E5M2`;
  0: not an FP8 cache).
- `fp8_gemm_kernel`: out [M, N] = x [M, K] @ (codes x block scales)^T, float32 sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 0.015625  # 2^-6: below it, codes are subnormal steps of 2^-9
E5M2_MAX = 57344.0
E5M2_MIN_NORMAL = 2.0**-14  # below it, codes are subnormal steps of 2^-16
E4M3, E5M2 = 1, 2  # the kernels' FP8 constant: the cache's code format (0: none)


@triton.jit
def e4m3_values(codes):
    """uint8 codes -> float32 values. The 7 magnitude bits placed at bits 13..7 of a
    float16 become its exponent and top mantissa bits, the sign its bit 15: that float16
    is the code's value x 2^-8 exactly, subnormals included (both formats' subnormals
    scale alike; fp8_codes.h of the CPU kernels does the same). NaN codes (0x7F, 0xFF)
    are never written: writes saturate."""
    wide = codes.to(tl.uint16)
    bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _fp8_codes(x, MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
               MIN_NORMAL: tl.constexpr, STEPPER: tl.constexpr,
               STEPPER_BITS: tl.constexpr):  # fmt: skip
    """float32 -> uint8 codes of a float8 format (MANTISSA bits, exponent BIAS), saturated
    to +-MAX, rounded to nearest even. Normal: float32's 23 mantissa bits rounded to
    MANTISSA (ties to even), then the exponent rebiased from 127 to BIAS (a carry out of
    the mantissa rounds up to the next binade). Subnormal (below MIN_NORMAL): adding
    STEPPER, whose float32 ulp is the format's subnormal step, rounds the magnitude to a
    multiple of that step (the hardware's ties-to-even); the low bits of the sum
    (STEPPER_BITS: STEPPER's own bits, taken off) then count those steps, and 1 << MANTISSA
    of them is the smallest normal's code."""
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.uint8)  # -0.0 keeps its sign
    mag = tl.minimum(tl.abs(x), MAX)
    bits = mag.to(tl.uint32, bitcast=True)
    shift: tl.constexpr = 23 - MANTISSA
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((127 - BIAS) << MANTISSA)
    steps = (mag + STEPPER).to(tl.uint32, bitcast=True) - STEPPER_BITS
    code = tl.where(mag < MIN_NORMAL, steps, normal).to(tl.uint8)
    return code | (sign << 7)


@triton.jit
def e4m3_codes(x):
    """float32 -> uint8 codes: saturated to +-448, rounded to nearest even (subnormal
    steps of 2^-9: 2^14's ulp)."""
    return _fp8_codes(x, E4M3_MAX, 3, 7, E4M3_MIN_NORMAL, 16384.0, 0x46800000)


@triton.jit
def e5m2_values(codes):
    """uint8 codes -> float32 values: a code is the high byte of its float16, exactly."""
    return (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e5m2_codes(x):
    """float32 -> uint8 e5m2 codes: saturated to +-57344, rounded to nearest even
    (subnormal steps of 2^-16: 2^7's ulp)."""
    return _fp8_codes(x, E5M2_MAX, 2, 15, E5M2_MIN_NORMAL, 128.0, 0x43000000)


@triton.jit
def kv_values(codes, FP8: tl.constexpr):
    """An FP8 cache's codes (bytes) as float32 values, in the format FP8 names."""
    if FP8 == E5M2:
        return e5m2_values(codes)
    return e4m3_values(codes)


@triton.jit
def kv_codes(x, FP8: tl.constexpr):
    """float32 values as an FP8 cache's codes, in the format FP8 names."""
    if FP8 == E5M2:
        return e5m2_codes(x)
    return e4m3_codes(x)


@triton.jit
def fp8_gemm_kernel(
    x_ptr, codes_ptr, scale_ptr, rows_ptr, out_ptr, M, N, K, x_stride, codes_stride,
    scale_stride, out_stride, block_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program: a [BLOCK_M, BLOCK_N] tile of out. Output row n's scale row is rows[n] and
    input column k's scale column k // block_k; BLOCK_K divides block_k, so one K tile
    has one scale per output row, applied to the tile's float32 sums of code x input
    (codes are exact in x's dtype)."""
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rows_m < M, cols_n < N
    # codes load as [BLOCK_K, BLOCK_N] tiles (tl.dot's right operand, untransposed)
    scale_rows = tl.load(rows_ptr + cols_n, mask=n_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * x_stride + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        codes = tl.load(codes_ptr + cols_n[None, :] * codes_stride + ks[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)  # fmt: skip
        weights = e4m3_values(codes).to(x.dtype)
        if UPCAST:  # Triton's interpreter multiplies bf16 as its raw bits: not for a GPU
            x, weights = x.to(tl.float32), weights.to(tl.float32)
        part = tl.dot(x, weights, input_precision="ieee") if IEEE else tl.dot(x, weights)
        scales = tl.load(scale_ptr + scale_rows * scale_stride + k_start // block_k,
                         mask=n_ok, other=0.0)  # fmt: skip
        acc += part * scales[None, :]
    tl.store(out_ptr + rows_m[:, None].to(tl.int64) * out_stride + cols_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def gemm_blocks(rows: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for `rows` input rows: M tiles of 16 (tl.dot's least)
    to 64; K tiles the largest power of two that divides block_k, up to 128 (block_k is
    a multiple of 16, quantization/fp8.py)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return block_m, 64, min(128, block_k & -block_k)
