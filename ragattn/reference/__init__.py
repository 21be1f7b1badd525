"""Plain-torch references of every ragattn op (float64-capable): the tests' ground truth and
the CPU fallback. Depends on torch only."""

__all__: list[str] = []

from ragattn.reference import kv_cache  # noqa: E402

__all__ += ["kv_cache"]
