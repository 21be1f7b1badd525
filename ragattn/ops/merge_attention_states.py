"""``ragattn.merge_attention_states``: exact merge of two partial attentions."""
from __future__ import annotations

from typing import Tuple

import torch

from ragattn import _extension
from ragattn.ops._validate import FLOAT_DTYPES, check_same_device, check_tensor, device_guard
from ragattn.reference.merge_attention_states import merge_attention_states as _reference

_OP = "merge_attention_states"


def _validate(out_a, lse_a, out_b, lse_b) -> None:
    check_tensor(_OP, "out_a", out_a, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(_OP, "out_b", out_b, dtypes=(out_a.dtype,), shape=tuple(out_a.shape))
    check_tensor(_OP, "lse_a", lse_a, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_tensor(_OP, "lse_b", lse_b, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_same_device(_OP, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions of the same queries over disjoint key sets.

    Args:
        out_a, out_b: ``[N, num_heads, head_dim]`` fp16/bf16/fp32 (same dtype), each normalised over its own keys.
        lse_a, lse_b: float32 ``[N, num_heads]``, natural-log sum of exp of the scores over each key set.

    Returns:
        out ``[N, num_heads, head_dim]`` in out_a's dtype and lse float32 ``[N, num_heads]`` with
        ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)``:
        attention over the union of the key sets (cascade attention: shared chunk pages + private
        pages). A side whose lse is ``-inf`` saw no key and contributes nothing (its out is
        ignored); both ``-inf`` gives out 0 and lse ``-inf``, never NaN.

    Backends: CUDA runs the Triton kernel; CPU the reference, or the Triton kernel under the
    interpreter with ``RAGATTN_CPU_BACKEND=triton``.
    """
    return torch.ops.ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)


def _triton(out_a, lse_a, out_b, lse_b):
    from ragattn.triton_kernels.merge_attention_states import merge_two_states

    return merge_two_states(out_a, lse_a, out_b, lse_b)


@torch.library.impl("ragattn::merge_attention_states", "CPU")
def _merge_cpu(out_a, lse_a, out_b, lse_b):
    _validate(out_a, lse_a, out_b, lse_b)
    if _extension.cpu_backend() == "triton":
        return _triton(out_a, lse_a, out_b, lse_b)
    return _reference(out_a, lse_a, out_b, lse_b)


@torch.library.impl("ragattn::merge_attention_states", "CUDA")
def _merge_cuda(out_a, lse_a, out_b, lse_b):
    _validate(out_a, lse_a, out_b, lse_b)
    with device_guard(out_a):
        return _triton(out_a, lse_a, out_b, lse_b)


@torch.library.register_fake("ragattn::merge_attention_states")
def _merge_fake(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)  # contiguous, like the kernels
