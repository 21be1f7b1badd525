"""``ragattn.refrag_assemble``: REFRAG's decoder input, token embeddings and projected chunk
embeddings interleaved in one pass, with autograd.

Registers the CPU impl (the plain-torch gather, or the Triton kernel under the interpreter with
``RAGATTN_CPU_BACKEND=triton``), the CUDA impl (Triton), the fake impl and the autograd formula
against the schema declared in csrc/torch_bindings.cpp.
"""
from __future__ import annotations

import torch

from ragattn.ops import backend
from ragattn.ops._validate import INDEX_DTYPES, check_same_device, check_tensor, device_guard
from ragattn.reference.refrag_assemble import refrag_assemble as _reference

_OP = "refrag_assemble"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate(embed_weight, token_ids, chunk_embeds, slot_src, *, check_values: bool) -> None:
    """Shape/dtype/device checks; ``check_values`` also reads the (CPU) index values."""
    check_tensor(_OP, "embed_weight", embed_weight, dtypes=_DTYPES, ndim=2)
    check_tensor(_OP, "token_ids", token_ids, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor(_OP, "chunk_embeds", chunk_embeds, ndim=2)
    check_tensor(_OP, "slot_src", slot_src, dtypes=INDEX_DTYPES, ndim=1)
    check_same_device(_OP, embed_weight=embed_weight, token_ids=token_ids, chunk_embeds=chunk_embeds,
                      slot_src=slot_src)
    vocab, d = embed_weight.shape
    if vocab == 0 or d == 0:
        raise ValueError(f"ragattn.{_OP}: embed_weight must be a non-empty [vocab, d] table, got shape "
                         f"{tuple(embed_weight.shape)}")
    if chunk_embeds.dtype != embed_weight.dtype:
        raise TypeError(f"ragattn.{_OP}: chunk_embeds must have embed_weight's dtype "
                        f"{str(embed_weight.dtype).replace('torch.', '')}, got "
                        f"{str(chunk_embeds.dtype).replace('torch.', '')} (cast the projector output)")
    if chunk_embeds.shape[1] != d:
        raise ValueError(f"ragattn.{_OP}: chunk_embeds must have the decoder's embedding size d = {d} "
                         f"(embed_weight's), got shape {tuple(chunk_embeds.shape)}")
    if slot_src.numel() == 0:
        raise ValueError(f"ragattn.{_OP}: slot_src is empty: nothing to assemble (an empty context and "
                         "prompt?)")
    if not (check_values and slot_src.device.type == "cpu"):
        return  # CUDA: a documented precondition (checking would sync); fake tensors have no values
    n_tok, n_chunks = token_ids.numel(), chunk_embeds.shape[0]
    lo, hi = int(slot_src.min()), int(slot_src.max())
    if lo < -n_chunks or hi >= n_tok:
        raise ValueError(f"ragattn.{_OP}: slot_src values must lie in [-{n_chunks}, {n_tok - 1}] "
                         f"(-(chunk+1) for one of {n_chunks} chunk rows, else a token_ids index), got "
                         f"{lo} .. {hi}")
    if n_tok and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        raise ValueError(f"ragattn.{_OP}: token_ids must lie in [0, {vocab - 1}] (embed_weight's "
                         f"vocab), got {int(token_ids.min())} .. {int(token_ids.max())}")


def _use_triton(t: torch.Tensor) -> bool:
    return backend.choose(_OP, t.device.type, t.dtype) == backend.TRITON


def _forward(embed_weight, token_ids, chunk_embeds, slot_src):
    _validate(embed_weight, token_ids, chunk_embeds, slot_src, check_values=True)
    if _use_triton(embed_weight):
        from ragattn.triton_kernels.refrag_assemble import refrag_assemble as _kernel

        w = embed_weight if embed_weight.stride(1) == 1 else embed_weight.contiguous()
        c = chunk_embeds if chunk_embeds.stride(1) == 1 else chunk_embeds.contiguous()
        with device_guard(embed_weight):
            return _kernel(w, token_ids, c, slot_src)
    with torch.no_grad():
        return _reference(embed_weight, token_ids, chunk_embeds, slot_src).contiguous()


@torch.library.impl(f"ragattn::{_OP}", ("CPU", "CUDA"))
def _impl(embed_weight, token_ids, chunk_embeds, slot_src):
    return _forward(embed_weight, token_ids, chunk_embeds, slot_src)


@torch.library.register_fake(f"ragattn::{_OP}")
def _fake(embed_weight, token_ids, chunk_embeds, slot_src):
    _validate(embed_weight, token_ids, chunk_embeds, slot_src, check_values=False)
    return embed_weight.new_empty((slot_src.shape[0], embed_weight.shape[1]))


def _setup_context(ctx, inputs, output):
    embed_weight, token_ids, chunk_embeds, slot_src = inputs
    ctx.save_for_backward(token_ids, slot_src)
    ctx.vocab, ctx.n_chunks = embed_weight.shape[0], chunk_embeds.shape[0]


def _backward(ctx, grad_out):
    """Embedding-backward semantics: each slot's gradient row is added (``index_add``) to the
    ``embed_weight`` row of its token or to its chunk's row. Slots of the other kind add an exact
    0 taken with ``where`` (never ``0 * grad``: a NaN there would leak)."""
    token_ids, slot_src = ctx.saved_tensors
    src = slot_src.long()
    is_tok = (src >= 0)[:, None]
    zero = grad_out.new_zeros(())
    grad_w = grad_c = None
    if ctx.needs_input_grad[0]:
        rows = token_ids.long()[src.clamp_min(0)] if token_ids.numel() else src.new_zeros(src.shape)
        rows = torch.where(src >= 0, rows, 0)
        grad_w = grad_out.new_zeros((ctx.vocab, grad_out.shape[1]))
        grad_w.index_add_(0, rows, torch.where(is_tok, grad_out, zero))
    if ctx.needs_input_grad[2]:
        grad_c = grad_out.new_zeros((ctx.n_chunks, grad_out.shape[1]))
        if ctx.n_chunks:
            grad_c.index_add_(0, torch.where(src < 0, -src - 1, 0), torch.where(is_tok, zero, grad_out))
    return grad_w, None, grad_c, None


torch.library.register_autograd(f"ragattn::{_OP}", _backward, setup_context=_setup_context)


def refrag_assemble(
    embed_weight: torch.Tensor, token_ids: torch.Tensor, chunk_embeds: torch.Tensor, slot_src: torch.Tensor
) -> torch.Tensor:
    """REFRAG's decoder input: decoder token embeddings and projected chunk embeddings, interleaved.

    Args:
        embed_weight: ``[V, d]`` fp16/bf16/fp32/fp64, the decoder's token-embedding table ``W_E``
            (``model.get_input_embeddings().weight``).
        token_ids: int32/int64 ``[T_tok]``, packed token ids of the batch (every row's prompt,
            context and target tokens; the tokens of compressed chunks may stay in it unread).
            Every value must lie in ``[0, V)``.
        chunk_embeds: ``[N, d]`` in embed_weight's dtype, projected chunk embeddings ``e^cnk``
            (``N`` may be 0).
        slot_src: int32/int64 ``[T_out]`` (``T_out >= 1``), the source of each output slot:
            ``s >= 0`` reads the token embedding of ``token_ids[s]``; ``s < 0`` reads chunk row
            ``-s - 1``. Values in ``[-N, T_tok)``. A row/chunk may be read by several slots.

    Returns:
        inputs_embeds: ``[T_out, d]``, embed_weight's dtype, contiguous. Rows are copies, so with
        ``slot_src = arange(T_tok)`` (nothing compressed) the result equals
        ``F.embedding(token_ids, embed_weight)`` bit for bit.

    Autograd: gradients flow to ``embed_weight`` (``index_add`` of each token slot's gradient
    into its vocab row, as the embedding backward) and to ``chunk_embeds`` (summed over the slots
    that read a chunk). Position ids, ``cu_seqlens`` and labels of a layout come from
    :func:`ragattn.methods.refrag.layout.build_layout` (not from this op: they are index math
    on the host-side layout, needed before the encoder runs).

    Validation: dtype, shape, device, ``d`` match, non-empty ``slot_src``; on CPU also every
    index range (ValueError naming the argument). On CUDA out-of-range indices are a
    precondition (checking would sync). Backends: CPU runs the plain-torch gather (or the Triton
    kernel in the interpreter with ``RAGATTN_CPU_BACKEND=triton``), CUDA the Triton kernel (one
    program per output row); float64 always runs the plain-torch path.
    """
    return torch.ops.ragattn.refrag_assemble(embed_weight, token_ids, chunk_embeds, slot_src)
