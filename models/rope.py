"""Rotary position embeddings (HF `rotate_half` layout, over the first `partial_rotary_factor` of each head):
default / linear / llama3 / yarn / longrope (short and long factors) frequencies, yarn's and longrope's attention
factor, and which longrope factor set each token of a ragged batch rotates by."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading values of each head are rotated (HF: int(head_dim * partial_rotary_factor))."""
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> np.ndarray:
    """Host-side. The `rotary_dim // 2` inverse frequencies, scaled as `rope.rope_type` says (`long`: longrope's
    long factors, for sequences past the original context)."""
    dim = rotary_dim(rope, head_dim)
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv = _yarn(rope, dim, inv)
    elif rope.rope_type == "longrope":
        inv = inv / np.asarray(rope.long_factor if long else rope.short_factor, np.float64)
    return inv.astype(np.float32)


def _yarn(rope: RopeConfig, dim: int, inv: np.ndarray) -> np.ndarray:
    """YaRN (HF `_compute_yarn_parameters`): the interpolated frequencies (inv / factor) below the dimension where a
    wavelength fits `beta_slow` rotations in the original context, the extrapolated ones (inv) above the one where it
    fits `beta_fast`, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp
    return inv / rope.factor * (1.0 - extrapolated) + inv * extrapolated


def longrope_long_tokens(kv_lens: jax.Array, cu_q_lens: jax.Array, num_tokens: int, original: int) -> jax.Array:
    """Pure. [T] bool: the tokens whose sequence is longer than `original` positions once this step is in its
    cache (`kv_lens[S]`, tokens laid out by `cu_q_lens[S + 1]`): HF's longrope picks long factors for a forward
    whose last position is past the original context, short ones otherwise."""
    seq = jnp.searchsorted(cu_q_lens, jnp.arange(num_tokens, dtype=cu_q_lens.dtype), side="right") - 1
    seq = jnp.clip(seq, 0, kv_lens.shape[0] - 1)
    return kv_lens[seq] > original


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, attention_factor: float = 1.0, long_inv_freq=None,
               use_long: jax.Array | None = None) -> jax.Array:
    """Pure. Rotates the first `2 * len(inv_freq)` values of each head of `x[T, H, D]` by `positions[T]` (the rest
    pass through), cos and sin scaled by `attention_factor` as HF does; computed in float32, returned in x's
    dtype. With `long_inv_freq` (longrope), the tokens where `use_long[T]` is set rotate by those instead."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    per_token = inv_freq[None, :]
    if long_inv_freq is not None:
        per_token = jnp.where(use_long[:, None], jnp.asarray(long_inv_freq, jnp.float32)[None, :], per_token)
    freqs = positions.astype(jnp.float32)[:, None] * per_token  # [T, R/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    xf = x.astype(jnp.float32)
    rot = 2 * inv_freq.shape[0]
    x1, x2 = jnp.split(xf[..., :rot], 2, axis=-1)
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < x.shape[-1]:
        out.append(xf[..., rot:])
    return jnp.concatenate(out, axis=-1).astype(x.dtype)
