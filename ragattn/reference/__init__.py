"""Plain-torch references of every ragattn op (float64-capable): the tests' ground truth and
the CPU fallback. Depends on torch only."""

__all__: list[str] = []

from ragattn.reference import kv_cache  # noqa: E402

__all__ += ["kv_cache"]

from ragattn.reference.merge_attention_states import merge_attention_states  # noqa: E402
from ragattn.reference.paged_attention import paged_attention  # noqa: E402

__all__ += ["paged_attention", "merge_attention_states"]

from ragattn.reference.key_attention_scores import key_attention_scores  # noqa: E402

__all__ += ["key_attention_scores"]

from ragattn.reference.varlen_attention import varlen_attention  # noqa: E402

__all__ += ["varlen_attention"]

from ragattn.reference.speculative import verify_draft  # noqa: E402

__all__ += ["verify_draft"]
