"""MXFP4 expert weights (OCP microscaling, as GPT-OSS checkpoints ship their experts: `quant_method: mxfp4`),
dequantised at load (`dequantize_mxfp4`): meshserve serves them in the model's float dtype, not 4-bit."""
from __future__ import annotations

import numpy as np

# E2M1: sign, 2 exponent bits, 1 mantissa bit; the code's low 3 bits index the magnitude, bit 3 is the sign
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
BLOCK = 32  # values per shared E8M0 scale
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 `[..., K, N]` of a checkpoint's `<name>_blocks` (uint8 `[..., N, K / 32, 16]`: two E2M1 codes a byte,
    the low nibble first) and `<name>_scales` (uint8 `[..., N, K / 32]`: E8M0, 2^(s - 127) for each block of 32
    values along K), transposed to `x @ W` order as HF's GptOssExperts holds gate_up_proj [E, H, 2I] and down_proj
    [E, I, H]."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks / scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks of shape {blocks.shape} do not fit scales of shape {scales.shape} (expected "
                         f"blocks [..., N, G, {BLOCK // 2}] beside scales [..., N, G])")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., N, G, 16, 2]: low nibble, then high
    values = E2M1_VALUES[codes].reshape(*scales.shape, BLOCK)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - E8M0_BIAS)
    out = values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)  # [..., N, K]
    return np.ascontiguousarray(np.swapaxes(out, -1, -2))
