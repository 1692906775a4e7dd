"""GGUF's Q4_K super-blocks decoded from the definition (ggml's block_q4_K,
docs/layout.md §Frozen base), in float64: per 256 values 144 bytes, fp16 d
and dmin (little-endian), 12 bytes of eight 6-bit scales sc and mins m
(sub-block j < 4: the low 6 bits of bytes j and j + 4; j >= 4: the low and
high nibbles of byte j + 4, their top 2 bits the top 2 bits of bytes j - 4
and j), then 128 bytes: run r of 64 values has its first 32 in the low
nibbles of bytes 32r..32r+31, the next 32 in their high nibbles. Value =
d sc q - dmin m, rounded once to float32 (the products are exact in
float32, so the float32 computation rounds the same single difference)."""
import numpy as np

BLOCK, BYTES, SUB = 256, 144, 32


def scales_mins(s):
    """the 12 scale bytes [..., 12] -> (sc, m) [..., 8], as integers"""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def dequantize(rows):
    """uint8 [R, n / 256 * 144] -> float32 [R, n]"""
    R = rows.shape[0]
    b = rows.reshape(R, -1, BYTES)
    d = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float64)
    dmin = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float64)
    sc, m = scales_mins(b[..., 4:16])
    qs = b[..., 16:].reshape(R, -1, 4, 32).astype(np.int64)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(R, -1, 8, SUB)   # run r: low, then high
    with np.errstate(invalid="ignore", over="ignore"):
        v = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]
    return v.reshape(R, -1).astype(np.float32)
