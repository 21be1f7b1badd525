"""REFRAG's decoder-input assembly: one program per output row copies either a decoder
token-embedding row (``W_E[token_ids[src]]``) or a projected chunk-embedding row
(``chunk_embeds[-src - 1]``). Each output row is written exactly once and each source row read
once per use: one memory-bound pass, no intermediate gather. Offsets in int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _assemble_kernel(
    weight, token_ids, chunks, slot_src, out,
    stride_w, stride_c, stride_o, d,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(slot_src + row).to(tl.int64)
    is_tok = src >= 0
    # the branch not taken reads nothing: its pointer is clamped to row 0 and fully masked
    tok = tl.load(token_ids + tl.where(is_tok, src, 0), mask=is_tok, other=0).to(tl.int64)
    chunk = tl.where(is_tok, 0, -src - 1)
    # each branch's loads end at d or at 0 (a scalar bound: a block mask and-ed with the scalar
    # is_tok fails triton 3.9's interpreter, which keeps a scalar comparison's result as int32)
    d_tok = tl.where(is_tok, d, 0)
    d_chk = d - d_tok
    for d0 in range(0, d, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        in_d = offs < d
        v_tok = tl.load(weight + tok * stride_w + offs, mask=offs < d_tok, other=0.0)
        v_chk = tl.load(chunks + chunk * stride_c + offs, mask=offs < d_chk, other=0.0)
        tl.store(out + row * stride_o + offs, tl.where(is_tok, v_tok, v_chk), mask=in_d)


def refrag_assemble(weight: torch.Tensor, token_ids: torch.Tensor, chunks: torch.Tensor,
                    slot_src: torch.Tensor) -> torch.Tensor:
    """Launch over ``slot_src.numel()`` rows; inputs validated by the op layer (unit last-dim strides)."""
    t_out, d = slot_src.numel(), weight.shape[1]
    out = torch.empty((t_out, d), dtype=weight.dtype, device=weight.device)
    if t_out == 0:
        return out
    if token_ids.numel() == 0:   # a valid pointer for the (masked) token loads
        token_ids = torch.zeros(1, dtype=torch.int64, device=weight.device)
    if chunks.shape[0] == 0:
        chunks = weight[:1]
    block_d = min(triton.next_power_of_2(d), 1024)
    _assemble_kernel[(t_out,)](
        weight, token_ids.contiguous(), chunks, slot_src.contiguous(), out,
        weight.stride(0), chunks.stride(0), out.stride(0), d, BLOCK_D=block_d,
    )
    return out
