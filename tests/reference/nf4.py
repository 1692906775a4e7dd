"""QLoRA's NF4 blocks (Dettmers et al. 2023; bitsandbytes' quantize_4bit,
quant_type "nf4", blocksize 64), written from the definition in
docs/layout.md §Frozen base: each block of 64 consecutive values of a row
keeps absmax = max |x| (float32, a NaN propagating) and 64 4-bit codes,
the index of the nearest of the 16 NF4 levels to t = x * (1 / max(absmax,
1e-38)) in float32 -- the number of float32 midpoints between neighbouring
levels lying strictly below t, so a t on a midpoint takes the lower level
and a NaN code 0. Stored: absmax's 4 bytes (little-endian), then 32 bytes,
byte i holding value 2i's code in its high nibble and 2i + 1's in its low;
a value decodes as level[q] * absmax in float32."""
import numpy as np

BLOCK, BYTES = 64, 36
# bitsandbytes' functional.get_4bit_type("nf4"), rounded to float32
LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                   -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                   0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                   0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                   0.7229568362236023, 1.0], np.float32)
MIDPOINTS = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)
MIN_ABSMAX = np.float32(1e-38)


def codes(t):
    """float32 t -> its NF4 codes (uint8): the midpoints strictly below."""
    return (t[..., None] > MIDPOINTS).sum(-1).astype(np.uint8)


def quantize(rows):
    """rows [n, k] (k a multiple of 64) -> uint8 [n, k / 64 * 36]."""
    x = np.asarray(rows, np.float32).reshape(len(rows), -1, BLOCK)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.abs(x).max(axis=-1)
        t = x * (np.float32(1) / np.maximum(amax, MIN_ABSMAX))[..., None]
    q = codes(t)
    packed = (q[..., 0::2] << 4) | q[..., 1::2]
    head = amax.astype("<f4")[..., None].view(np.uint8)
    return np.concatenate([head, packed], axis=-1).reshape(len(rows), -1)


def dequantize(blocks):
    """uint8 [n, k / 64 * 36] -> float32 [n, k]: level[q] * absmax."""
    b = np.asarray(blocks, np.uint8).reshape(len(blocks), -1, BYTES)
    amax = np.ascontiguousarray(b[..., :4]).view("<f4")
    q = np.stack([b[..., 4:] >> 4, b[..., 4:] & 15], axis=-1).reshape(*b.shape[:2], BLOCK)
    with np.errstate(invalid="ignore"):
        return (LEVELS[q] * amax).reshape(len(blocks), -1)
