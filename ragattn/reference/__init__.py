"""Plain-torch references of every ragattn op (float64-capable): the tests' ground truth and
the CPU fallback. Depends on torch only."""

from ragattn.reference import merge_attention_states, paged_attention  # noqa: F401

__all__: list[str] = []
__all__ += ["paged_attention", "merge_attention_states"]
