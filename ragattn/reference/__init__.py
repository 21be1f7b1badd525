"""Plain-torch references of every ragattn op (float64-capable): the tests' ground truth and
the CPU fallback. Depends on torch only.

``kv_cache`` is exported as a module: besides the two ops' references it holds the RoPE helpers
(``rope_rotate`` ...) that the methods reuse.
"""
from ragattn.reference import kv_cache
from ragattn.reference.key_attention_scores import key_attention_scores
from ragattn.reference.kv_cache import copy_kv_, rerotate_keys_
from ragattn.reference.merge_attention_states import merge_attention_states
from ragattn.reference.paged_attention import paged_attention
from ragattn.reference.refrag_assemble import refrag_assemble
from ragattn.reference.speculative import verify_draft
from ragattn.reference.varlen_attention import varlen_attention

__all__ = [
    "varlen_attention",
    "paged_attention",
    "merge_attention_states",
    "rerotate_keys_",
    "copy_kv_",
    "kv_cache",
    "key_attention_scores",
    "verify_draft",
    "refrag_assemble",
]
