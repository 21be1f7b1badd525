"""REFRAG decoder layouts: where each decoder slot reads its embedding from (notes §2.5-2.7, R7).

A row of a batch is ``[prefix tokens][context][prompt tokens][target tokens]``; the context's
chunks stay in order and each is either **compressed** (one slot, its projected chunk
embedding) or **expanded** (its own decoder tokens, one slot each). For k = 4, chunks c0..c3,
c2 expanded::

    tokens     : p0 p1 | x0 x1 x2 x3 | x4 x5 x6 x7 | x8 x9 x10 x11 | x12 x13 | q0 q1 | y0 y1
    slots      : p0 p1 |     [c0]    |     [c1]    | x8 x9 x10 x11 | [c3]    | q0 q1 | y0 y1
    position_ids: 0  1 |      2      |      3      |  4  5  6  7   |   8     |  9 10 | 11 12
    slot_src   : 0  1  |     -1      |     -2      |  10 11 12 13  |  -3     | 16 17 | 18 19

(``slot_src``: ``>= 0`` an index into the packed ``token_ids``, ``-(j + 1)`` row ``j`` of the
compressed-chunk embeddings, numbered over the batch in order.) Positions are one per slot, a
contiguous ``arange`` over the *compressed* row (notes §2.7): a compressed chunk takes one
position, an expanded chunk ``len`` positions. The layouts of the paper are special cases:
RAG ``[question][chunks]`` (prefix = question), CPT/next-paragraph ``[chunks][target]``,
reconstruction ``[chunks][target = the context tokens]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ragattn.methods.refrag.chunking import ChunkLayout, Ids


def _ids(x, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(list(x), dtype=torch.int64)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"ragattn.refrag.build_layout: {what} must be 1-D integer token ids, got "
                         f"{tuple(t.shape)} {t.dtype}")
    return t.to(torch.int64).cpu()


@dataclass
class RefragExample:
    """One row: ``[prefix][context chunks][prompt][target]`` (token id lists or 1-D int tensors;
    ``context`` a :class:`ChunkLayout`). ``target`` tokens are the ones the loss is taken on."""
    context: ChunkLayout
    prompt: Ids = ()
    target: Ids = ()
    prefix: Ids = ()


@dataclass
class RefragLayout:
    """Packed layout of a batch of ``B`` rows (every tensor int64 on the CPU unless noted).

    ``token_ids [T_tok]``: every row's tokens packed (prefix, context, prompt, target);
    ``slot_src [T]``: the source of each decoder slot (module docstring);
    ``position_ids [T]``: compact ``arange`` per row; ``cu_seqlens`` int32 ``[B + 1]``: row
    offsets in the slots; ``labels [T]``: the token id at target slots, -100 elsewhere (aligned to
    slots: slot ``t`` predicts ``labels[t + 1]`` of the same row);
    ``chunk_token_ids``: the decoder tokens of every chunk of the batch (rows in order, ``L_tot``
    tensors); ``cu_chunks [B + 1]``: chunk offsets per row; ``expand_mask`` bool ``[L_tot]``;
    ``compressed [N]``: the batch chunk index of each compressed chunk, in slot order (row ``j``
    of the chunk embeddings the op reads); ``chunk_slot [L_tot]``: the first slot of each chunk."""
    token_ids: torch.Tensor
    slot_src: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    chunk_token_ids: list
    cu_chunks: torch.Tensor
    expand_mask: torch.Tensor
    compressed: torch.Tensor
    chunk_slot: torch.Tensor
    k: int = 0
    seq_lens: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_slots(self) -> int:
        return self.slot_src.numel()


def build_layout(examples: Sequence[RefragExample],
                 expand_masks: Optional[Sequence[Optional[torch.Tensor]]] = None) -> RefragLayout:
    """The packed :class:`RefragLayout` of ``examples`` with ``expand_masks[b]`` (bool ``[L_b]``,
    True = expanded; None = all compressed) selecting the expanded chunks of row ``b``."""
    if len(examples) == 0:
        raise ValueError("ragattn.refrag.build_layout: empty batch")
    if expand_masks is None:
        expand_masks = [None] * len(examples)
    if len(expand_masks) != len(examples):
        raise ValueError(f"ragattn.refrag.build_layout: {len(expand_masks)} expand masks for "
                         f"{len(examples)} examples")
    toks, srcs, pos, labels, lens, chunk_ids, masks, comp, chunk_slot, cu_chunks = \
        [], [], [], [], [], [], [], [], [], [0]
    tok_base = slot_base = chunk_base = 0
    n_comp = 0
    for b, (ex, m) in enumerate(zip(examples, expand_masks)):
        lay = ex.context
        if not isinstance(lay, ChunkLayout):
            raise TypeError(f"ragattn.refrag.build_layout: example {b}'s context must be a ChunkLayout "
                            f"(from chunk_context), got {type(lay).__name__}")
        L = lay.num_chunks
        m = torch.zeros(L, dtype=torch.bool) if m is None else torch.as_tensor(m).cpu()
        if m.dtype != torch.bool or m.shape != (L,):
            raise ValueError(f"ragattn.refrag.build_layout: expand mask {b} must be bool [{L}] (one per "
                             f"chunk), got {m.dtype} {tuple(m.shape)}")
        prefix, prompt, target = _ids(ex.prefix, "prefix"), _ids(ex.prompt, "prompt"), _ids(ex.target, "target")
        row_tok = torch.cat([prefix, lay.token_ids, prompt, target])
        n_pre, n_ctx = prefix.numel(), lay.num_tokens
        # context slots: a compressed chunk gives one slot -(j+1); an expanded one its token indices
        slot_len = torch.where(m, lay.lens, 1)
        ctx_src = torch.repeat_interleave(torch.where(m, tok_base + n_pre + lay.starts, 0), slot_len)
        within = torch.arange(int(slot_len.sum())) - torch.repeat_interleave(torch.cumsum(slot_len, 0) - slot_len, slot_len)
        ctx_src = ctx_src + within
        comp_rank = torch.cumsum((~m).long(), 0) - 1 + n_comp         # rank among compressed chunks
        ctx_src = torch.where(torch.repeat_interleave(m, slot_len), ctx_src,
                              -(torch.repeat_interleave(comp_rank, slot_len) + 1))
        after = torch.arange(n_pre + n_ctx, row_tok.numel()) + tok_base
        row_src = torch.cat([torch.arange(n_pre) + tok_base, ctx_src, after])
        n_slots = row_src.numel()
        row_lab = torch.full((n_slots,), -100, dtype=torch.int64)
        if target.numel():
            row_lab[n_slots - target.numel():] = target
        toks.append(row_tok)
        srcs.append(row_src)
        pos.append(torch.arange(n_slots))
        labels.append(row_lab)
        lens.append(n_slots)
        chunk_ids.extend(lay.chunk_token_ids())
        masks.append(m)
        comp.append(torch.nonzero(~m).squeeze(1) + chunk_base)
        chunk_slot.append(slot_base + n_pre + torch.cumsum(slot_len, 0) - slot_len)
        n_comp += int((~m).sum())
        tok_base += row_tok.numel()
        slot_base += n_slots
        chunk_base += L
        cu_chunks.append(chunk_base)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    k = examples[0].context.k
    return RefragLayout(torch.cat(toks), torch.cat(srcs), torch.cat(pos), cu, torch.cat(labels), chunk_ids,
                        torch.tensor(cu_chunks, dtype=torch.int64), torch.cat(masks), torch.cat(comp),
                        torch.cat(chunk_slot), k, lens)
