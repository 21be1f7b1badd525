"""Plain-torch references of the KV-cache ops (``rerotate_keys_``, ``copy_kv_``) and the RoPE
helpers the methods layer reuses. Float64-capable: angles are always taken in float64; the
rotation runs in ``compute_dtype`` (default float64, the ground truth of the tests).

RoPE layouts (``rotary_dim`` = r, only dims ``< r`` rotate, the rest pass through):
  interleaved=False (NeoX / HF ``rotate_half``): pair ``(i, i + r/2)`` uses ``inv_freq[i]``
  interleaved=True  (GPT-J ``rotate_every_two``): pair ``(2i, 2i + 1)`` uses ``inv_freq[i]``
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float64):
    """cos/sin of ``positions[n] * inv_freq[i]`` taken in float64, returned as ``dtype`` ``[N, r/2]``.

    positions: integer ``[N]`` (absolute positions or signed deltas); inv_freq: float ``[r/2]``.
    """
    theta = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)


def rope_rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
    compute_dtype: Optional[torch.dtype] = torch.float64,
) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` (any float dtype) by ``positions`` ``[N]`` (integer).

    Returns a new tensor of ``x``'s dtype. Dims ``>= rotary_dim`` are copied unchanged.
    ``compute_dtype=None`` does the products in ``x``'s own dtype (the low-precision baseline of
    the precision rule); the angles themselves are always taken in float64.
    """
    cd = x.dtype if compute_dtype is None else compute_dtype
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, inv_freq[:half], cd)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = x.clone()
    xr = x[..., :rotary_dim].to(cd)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out[..., :rotary_dim] = y.to(x.dtype)
    return out


def _rows_view(layer: torch.Tensor) -> torch.Tensor:
    """A cache layer ``[..., heads, head_dim]`` viewed as ``[rows, heads, head_dim]``."""
    return layer.view(-1, layer.shape[-2], layer.shape[-1])


def rerotate_keys_(
    k_layers: Sequence[torch.Tensor],
    rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    compute_dtype: Optional[torch.dtype] = torch.float64,
) -> None:
    """In place: row ``rows[n]`` of every layer (viewed ``[rows, heads, head_dim]``) is rotated
    by ``delta[n]`` positions. rows int64 ``[N]`` (distinct), delta int32 ``[N]``."""
    for layer in k_layers:
        v = _rows_view(layer)
        v[rows] = rope_rotate(v[rows], delta, inv_freq, rotary_dim, interleaved, compute_dtype)


def copy_kv_(
    dst_k: Sequence[torch.Tensor],
    dst_v: Sequence[torch.Tensor],
    src_k: Sequence[torch.Tensor],
    src_v: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: int = 0,
    interleaved: bool = False,
    compute_dtype: Optional[torch.dtype] = torch.float64,
) -> None:
    """In place: for every layer ``l`` and ``n``, ``dst_k[l][dst_rows[n]] = R(delta[n]) src_k[l][src_rows[n]]``
    (no rotation when ``delta`` is None) and ``dst_v[l][dst_rows[n]] = src_v[l][src_rows[n]]``.
    All sources are read before any destination is written."""
    k_new = []
    for s in src_k:
        g = _rows_view(s)[src_rows]
        if delta is not None:
            g = rope_rotate(g, delta, inv_freq, rotary_dim, interleaved, compute_dtype)
        k_new.append(g)
    v_new = [_rows_view(s)[src_rows] for s in src_v]
    for d, g in zip(dst_k, k_new):
        _rows_view(d)[dst_rows] = g
    for d, g in zip(dst_v, v_new):
        _rows_view(d)[dst_rows] = g


__all__ = ["rope_cos_sin", "rope_rotate", "rerotate_keys_", "copy_kv_"]
