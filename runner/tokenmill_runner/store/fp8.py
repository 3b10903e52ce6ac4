"""FP8 hidden states as hs-connectors 0.9.0 writes them, in numpy: float8_e4m3fn values with one float32 scale per
token. Pure.

hs-connectors' `fp8` backend (`HS` = hs_connectors 0.9.0): `quantize_tensor_to_fp8` (HS fp8_utils.py:29-51) takes the
states in float32, scale = max |value| of the token over every layer and hidden unit / 448 (float8_e4m3fn's largest
value), clamped to at least 1e-12, and stores value / scale as float8_e4m3fn; the file holds `hidden_states` (fp8,
[n, layers, hidden]), `hidden_states_scales` (float32, [n, 1, 1]) and `token_ids` (HS
fp8_hidden_states_connector.py:30-56). `FP8Transfer` reads it back as `fp8.to(bf16) * scale.to(bf16)` (HS
fp8_utils.py:54-60, transfer.py:212-248), which speculators' training then sees unchanged.

The float32 -> float8_e4m3fn conversion is torch's (c10/util/Float8_e4m3fn.h, `fp8e4m3fn_from_fp32_value`): round to
nearest even, values below 2^-6 to multiples of 2^-9, and 480 or more (or NaN) to NaN (0x7f): it does not
saturate, and no scaled value reaches it. The arithmetic is IEEE float32 as torch's is, so the bytes written here are
the bytes hs-connectors writes for the same served states (tests/integration/test_hidden_states.py checks it against
hs-connectors itself).
"""

from __future__ import annotations

import numpy as np

FP8_MAX = np.float32(448.0)
SCALE_FLOOR = np.float32(1e-12)
SCALES = "hidden_states_scales"  # the scales' tensor name (HS fp8_utils.py:15)


def _e4m3fn_from_f32(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    out = np.empty(magnitude.shape, dtype=np.uint8)
    big = magnitude >= np.uint32(1087 << 20)  # 480.0 and above, inf and NaN
    small = ~big & (magnitude < np.uint32(121 << 23))  # below 2^-6: multiples of 2^-9, ties to even
    normal = ~big & ~small
    out[big] = 0x7F
    subnormal = np.rint(magnitude[small].view(np.float32) * np.float32(512.0))
    out[small] = subnormal.astype(np.uint8)
    m = magnitude[normal].astype(np.int64)
    odd = (m >> 20) & 1
    out[normal] = ((m - ((127 - 7) << 23) + 0x7FFFF + odd) >> 20).astype(np.uint8)
    return out | sign


def _decode_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    values = np.where(exponent == 0, mantissa / 512.0, (1 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    values[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -values, values).astype(np.float32)


_VALUES = _decode_table()


def quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 codes [rows, values] uint8, scales [rows] float32) of `rows` (one row per token, every layer's values of
    that token), as hs-connectors quantizes them."""
    states = np.asarray(rows, dtype=np.float32)
    amax = np.abs(states).max(axis=1) if states.shape[1] else np.zeros(states.shape[0], dtype=np.float32)
    scales = np.maximum(amax / FP8_MAX, SCALE_FLOOR).astype(np.float32)
    return _e4m3fn_from_f32(states / scales[:, None]), scales


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), back as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What FP8Transfer hands the trainer, as float64: fp8 -> bf16 (exact) times the scale in bf16, rounded to bf16
    (a bf16 product is exact in float32 before that rounding)."""
    values = _VALUES[np.asarray(codes, dtype=np.uint8)]
    scale = _bf16(np.asarray(scales, dtype=np.float32)).reshape((-1,) + (1,) * (values.ndim - 1))
    return _bf16(values * scale).astype(np.float64)
