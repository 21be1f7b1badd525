"""Plain-torch references of the KV-cache ops (``rerotate_keys_``, ``copy_kv_``) and the RoPE
helpers the methods layer reuses. Float64-capable: angles are always taken in float64; the
rotation runs in ``compute_dtype`` (default float64, the ground truth of the tests).

float8_e4m3fn caches carry a per-tensor scale per layer (vLLM's ``kv_cache_dtype="fp8"``): a stored
element ``x`` means ``x * scale``; a value ``v`` is stored as ``clamp(v / scale, -448, 448)`` rounded to
nearest even (:func:`dequantize`, :func:`quantize`).

RoPE layouts (``rotary_dim`` = r, only dims ``< r`` rotate, the rest pass through):
  interleaved=False (NeoX / HF ``rotate_half``): pair ``(i, i + r/2)`` uses ``inv_freq[i]``
  interleaved=True  (GPT-J ``rotate_every_two``): pair ``(2i, 2i + 1)`` uses ``inv_freq[i]``
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

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


class RowLayout(NamedTuple):
    """How a cache layer ``[..., H, D]`` is addressed as ``[num_rows, H, D]`` (csrc/kv_cache/row_layout.h):
    row ``r`` starts ``(r // inner_rows) * outer_stride + (r % inner_rows) * inner_stride`` elements
    after the layer's first element."""

    num_rows: int
    outer_rows: int
    inner_rows: int
    inner_stride: int
    outer_stride: int
    heads: int
    head_dim: int


def row_layout(layer: torch.Tensor) -> RowLayout:
    """The row layout of ``layer`` ``[..., H, D]``, or ValueError (message without the op's name).

    The rule (one for every backend): the ``[H, D]`` block of a row is contiguous, and the leading
    dims collapse (size-1 dims dropped, a dim whose stride spans the next one merged into it) into
    at most two levels whose rows never overlap. Contiguous caches, vLLM's ``kv_cache[0]`` /
    ``kv_cache[1]`` of ``[2, blocks, block_size, H, D]`` and FlashInfer's ``cache[:, 0]`` /
    ``cache[:, 1]`` of ``[pages, 2, page_size, H, D]`` qualify; head-major (HND) pages do not.
    """
    heads, head_dim = layer.shape[-2], layer.shape[-1]
    w = heads * head_dim
    st = layer.stride()
    if not ((head_dim <= 1 or st[-1] == 1) and (heads <= 1 or st[-2] == head_dim)):
        raise ValueError(
            f"must have contiguous [num_kv_heads, head_dim] rows (strides [..., head_dim, 1]), got shape "
            f"{tuple(layer.shape)} with strides {st}"
        )
    if layer.numel() == 0:
        return RowLayout(0, 1, 1, w, w, heads, head_dim)
    levels = []  # (size, stride), inner to outer
    for i in range(layer.dim() - 3, -1, -1):
        size, stride = layer.shape[i], st[i]
        if size == 1:
            continue
        if levels and stride == levels[-1][0] * levels[-1][1]:
            levels[-1] = (levels[-1][0] * size, levels[-1][1])
        else:
            levels.append((size, stride))
    if len(levels) > 2:
        raise ValueError(
            f"(shape {tuple(layer.shape)}, strides {st}) must be addressable as [rows, num_kv_heads, head_dim] with at "
            "most two row strides (e.g. [pages, page_size, H, D] viewed out of [pages, 2, page_size, H, D]); its "
            f"leading dims need {len(levels)}"
        )
    inner_rows, inner_stride = levels[0] if levels else (1, w)
    outer_rows, outer_stride = levels[1] if len(levels) == 2 else (1, inner_rows * inner_stride)
    inner_span = w if inner_rows == 1 else inner_rows * inner_stride
    if (inner_rows > 1 and inner_stride < w) or (outer_rows > 1 and outer_stride < inner_span):
        raise ValueError(
            f"(shape {tuple(layer.shape)}, strides {st}) has rows that overlap in memory; every row must be its own memory"
        )
    return RowLayout(outer_rows * inner_rows, outer_rows, inner_rows, inner_stride, outer_stride, heads, head_dim)


def layers_overlap(a: torch.Tensor, ga: RowLayout, b: torch.Tensor, gb: RowLayout) -> bool:
    """Whether two cache layers share memory: exact for two layers of one layout (e.g. the K and V
    views of one FlashInfer cache), conservative (intersecting spans in one storage) otherwise."""
    if ga.num_rows == 0 or gb.num_rows == 0:
        return False
    if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False

    def span(t, g):
        last = (g.num_rows - 1) // g.inner_rows * g.outer_stride + (g.num_rows - 1) % g.inner_rows * g.inner_stride
        return t.storage_offset(), t.storage_offset() + last + g.heads * g.head_dim - 1

    (a0, a1), (b0, b1) = span(a, ga), span(b, gb)
    if a1 < b0 or b1 < a0:
        return False
    if ga[:5] != gb[:5] or ga.heads * ga.head_dim != gb.heads * gb.head_dim:
        return True
    # d = i * outer + j * inner + t with |i| < outer_rows, |j| < inner_rows, |t| < row width: the
    # layout rule leaves two candidates per level.
    d, w = abs(b0 - a0), ga.heads * ga.head_dim
    s = ga.inner_stride if ga.inner_rows > 1 else w
    i0 = d // ga.outer_stride if ga.outer_rows > 1 else 0
    for i in range(i0, i0 + (2 if ga.outer_rows > 1 else 1)):
        if abs(i) >= ga.outer_rows:
            continue
        rem = d - i * ga.outer_stride
        j0 = rem // s if ga.inner_rows > 1 else 0
        for j in range(j0, j0 + (2 if ga.inner_rows > 1 else 1)):
            if abs(j) < ga.inner_rows and abs(rem - j * s) < w:
                return True
    return False


def rows_view(layer: torch.Tensor) -> Tuple[torch.Tensor, RowLayout]:
    """``layer`` as a writable ``[outer_rows, inner_rows, H, D]`` view of its memory (no copy)."""
    g = row_layout(layer)
    v = layer.as_strided(
        (g.outer_rows, g.inner_rows, g.heads, g.head_dim),
        (g.outer_stride, g.inner_stride, g.head_dim, 1),
        layer.storage_offset(),
    )
    return v, g


def _row_index(rows: torch.Tensor, g: RowLayout):
    rows = rows.long()
    return rows // g.inner_rows, rows % g.inner_rows


def gather_rows(layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int32/int64 ``[N]``) of ``layer`` as a new ``[N, H, D]`` tensor."""
    v, g = rows_view(layer)
    return v[_row_index(rows, g)]


def scatter_rows_(layer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, raw: bool = False) -> None:
    """In place: rows ``rows`` of ``layer`` = ``values`` ``[N, H, D]`` (cast to the layer's dtype;
    ``raw``: already of it)."""
    v, g = rows_view(layer)
    v[_row_index(rows, g)] = values if raw else values.to(layer.dtype)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def layer_scale(scale: Optional[torch.Tensor], layer: int) -> Optional[torch.Tensor]:
    """Layer ``layer``'s scale out of a ``[]`` / ``[1]`` (every layer) or ``[L]`` scale tensor."""
    if scale is None:
        return None
    flat = scale.reshape(-1)
    return flat[0 if flat.numel() == 1 else layer]


def dequantize(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``x`` as ``dtype`` values: ``x * scale`` for float8_e4m3fn, a cast otherwise.
    The product is exact in float64 and, for fp8, in float32 too (4-bit significands)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return x.to(dtype) * scale.to(dtype)


def quantize(v: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Values ``v`` stored as ``dtype``: float8_e4m3fn as ``clamp(v / scale)`` rounded to nearest even
    (the division in float32, as the kernels do it), a cast otherwise."""
    if dtype != FP8:
        return v.to(dtype)
    q = v.to(torch.float32) / scale.to(torch.float32)
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def rerotate_keys_(
    k_layers: Sequence[torch.Tensor],
    rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    compute_dtype: Optional[torch.dtype] = torch.float64,
    num_kv_heads: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> None:
    """In place: row ``rows[n]`` of every layer (addressed as ``[rows, heads, head_dim]``, see
    :func:`row_layout`) is rotated by ``delta[n]`` positions. rows int32/int64 ``[N]`` (distinct),
    delta int32/int64 ``[N]``. The layers must not share memory (the op refuses it).
    float8_e4m3fn layers: dequantised with ``k_scale`` (``[]``/``[1]``/``[L]``), rotated in
    ``compute_dtype`` (float32 when None), requantised. ``num_kv_heads`` is checked by the op."""
    for l, layer in enumerate(k_layers):
        x = gather_rows(layer, rows)
        if layer.dtype != FP8:
            scatter_rows_(layer, rows, rope_rotate(x, delta, inv_freq, rotary_dim, interleaved, compute_dtype))
            continue
        sc = layer_scale(k_scale, l)
        cd = compute_dtype or torch.float32
        y = rope_rotate(dequantize(x, sc, cd), delta, inv_freq, rotary_dim, interleaved, cd)
        scatter_rows_(layer, rows, quantize(y, sc, FP8), raw=True)


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
    num_kv_heads: Optional[int] = None,
    src_k_scale: Optional[torch.Tensor] = None,
    src_v_scale: Optional[torch.Tensor] = None,
    dst_k_scale: Optional[torch.Tensor] = None,
    dst_v_scale: Optional[torch.Tensor] = None,
) -> None:
    """In place: for every layer ``l`` and ``n``, ``dst_k[l][dst_rows[n]] = R(delta[n]) src_k[l][src_rows[n]]``
    (no rotation when ``delta`` is None) and ``dst_v[l][dst_rows[n]] = src_v[l][src_rows[n]]``.
    Rows are int32/int64 ``[N]``, delta int32/int64; layers are addressed as in :func:`row_layout`.
    Every source row is read before any destination row is written (gather, then scatter), so
    sources may share memory with destinations; destinations must not share memory with each other
    (the op refuses it). A float8_e4m3fn side is dequantised / quantised with its scales
    (``[]``/``[1]``/``[L]``); with an fp8 side the values pass through ``compute_dtype`` (float32
    when None) once. ``num_kv_heads`` is checked by the op."""
    fp8 = bool(len(dst_k)) and FP8 in (dst_k[0].dtype, src_k[0].dtype)
    if not fp8:
        k_new = []
        for s in src_k:
            g = gather_rows(s, src_rows)
            if delta is not None:
                g = rope_rotate(g, delta, inv_freq, rotary_dim, interleaved, compute_dtype)
            k_new.append(g)
        v_new = [gather_rows(s, src_rows) for s in src_v]
        for d, g in zip(dst_k, k_new):
            scatter_rows_(d, dst_rows, g)
        for d, g in zip(dst_v, v_new):
            scatter_rows_(d, dst_rows, g)
        return
    cd = compute_dtype or torch.float32

    def moved(src, dst, s_scale, d_scale, rotate):
        out = []
        for l, (s, d) in enumerate(zip(src, dst)):
            x = dequantize(gather_rows(s, src_rows), layer_scale(s_scale, l), cd)
            if rotate:
                x = rope_rotate(x, delta, inv_freq, rotary_dim, interleaved, cd)
            out.append(quantize(x, layer_scale(d_scale, l), d.dtype))
        return out

    k_new = moved(src_k, dst_k, src_k_scale, dst_k_scale, delta is not None)
    v_new = moved(src_v, dst_v, src_v_scale, dst_v_scale, False)
    for d, g in zip(dst_k, k_new):
        scatter_rows_(d, dst_rows, g, raw=True)
    for d, g in zip(dst_v, v_new):
        scatter_rows_(d, dst_rows, g, raw=True)


__all__ = ["rope_cos_sin", "rope_rotate", "FP8", "FP8_MAX", "layer_scale", "dequantize", "quantize", "RowLayout", "row_layout", "layers_overlap", "rows_view", "gather_rows",
           "scatter_rows_", "rerotate_keys_", "copy_kv_"]
