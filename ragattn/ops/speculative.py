"""Deprecated import path (documented in earlier releases as ``ragattn.ops.speculative.verify_draft_vllm``):
the op's module is :mod:`ragattn.ops.verify_draft`, named after its op."""
from ragattn.ops.verify_draft import verify_draft, verify_draft_vllm  # noqa: F401

__all__ = ["verify_draft", "verify_draft_vllm"]
