"""The public op layer: Python wrappers, validation, fake impls and CPU/CUDA dispatch.

Every op is a ``torch.ops.ragattn.<name>`` custom op (schemas in csrc/torch_bindings.cpp) and
is mirrored here as ``ragattn.ops.<name>`` / ``ragattn.<name>`` with a docstring giving every
tensor's shape and dtype. One module per op family.
"""
from ragattn import _extension  # noqa: F401  (loads the schemas first)
from ragattn.ops.key_attention_scores import key_attention_scores
from ragattn.ops.kv_cache import copy_kv_, rerotate_keys_
from ragattn.ops.merge_attention_states import merge_attention_states, merge_attention_states_, merge_attention_states_n
from ragattn.ops.page_table import PageTable
from ragattn.ops.paged_attention import paged_attention
from ragattn.ops.paged_attention_run import (
    PagedAttentionPlan,
    plan_paged_attention,
    run_paged_attention,
)
from ragattn.ops.paged_attention_step import PagedAttentionStep
from ragattn.ops.refrag_assemble import refrag_assemble
from ragattn.ops.verify_draft import verify_draft, verify_draft_vllm  # noqa: F401  (ragattn.ops.verify_draft_vllm)
from ragattn.ops.varlen_attention import varlen_attention
from ragattn.ops import _cuda_fallback  # noqa: F401,E402  (CUDA impls where ragattn._C has no CUDA kernels)

# In the order of design.md's op surface.
__all__ = [
    "varlen_attention",
    "paged_attention",
    "merge_attention_states",
    "merge_attention_states_",
    "merge_attention_states_n",
    "rerotate_keys_",
    "copy_kv_",
    "key_attention_scores",
    "verify_draft",
    "refrag_assemble",
]
# The engine-facing plan/run pair of paged_attention (torch.ops.ragattn.paged_attention_run).
__all__ += ["PageTable", "PagedAttentionPlan", "plan_paged_attention", "run_paged_attention"]
# (PagedAttentionStep, the per-forward call of request caches, is ragattn.ops.PagedAttentionStep.)
