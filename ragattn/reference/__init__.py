"""Plain-torch references of every ragattn op (float64-capable): the tests' ground truth and
the CPU fallback. Depends on torch only."""

__all__: list[str] = []

from ragattn.reference.key_attention_scores import key_attention_scores  # noqa: E402

__all__ += ["key_attention_scores"]
