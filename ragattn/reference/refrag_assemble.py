"""Plain-torch reference of ``refrag_assemble`` (REFRAG's mixed token / chunk decoder input)."""
from __future__ import annotations

import torch


def refrag_assemble(
    embed_weight: torch.Tensor, token_ids: torch.Tensor, chunk_embeds: torch.Tensor, slot_src: torch.Tensor
) -> torch.Tensor:
    """Row ``t`` of the output is ``embed_weight[token_ids[slot_src[t]]]`` when ``slot_src[t] >= 0``
    and ``chunk_embeds[-slot_src[t] - 1]`` otherwise.

    embed_weight ``[V, d]``, token_ids int ``[T_tok]``, chunk_embeds ``[N, d]`` (embed_weight's
    dtype), slot_src int ``[T_out]``. Returns ``[T_out, d]`` in embed_weight's dtype, contiguous.
    Rows are copied (no arithmetic), so token rows equal ``F.embedding`` bit for bit. Differentiable
    (index_put / gather autograd): the ground truth of the op's forward and backward. No validation.
    """
    src = slot_src.long()
    is_tok = src >= 0
    tok, chk = is_tok.nonzero().squeeze(1), (~is_tok).nonzero().squeeze(1)
    out = embed_weight.new_empty((src.numel(), embed_weight.shape[1]))
    # index_select / index_copy_: the fastest torch gather-scatter on CPU (advanced-index
    # assignment is several times slower at these sizes); both are differentiable
    out.index_copy_(0, tok, embed_weight.index_select(0, token_ids.long().index_select(0, src[tok])))
    out.index_copy_(0, chk, chunk_embeds.index_select(0, -src[chk] - 1))
    return out
