"""Deprecated import path: its pieces live in modules named for what they hold. Importing this module
warns (DeprecationWarning) and gives the public names:
:mod:`ragattn.methods.prompt` (``prompt_parts``, ``SYSTEM``), :mod:`ragattn.methods.generate`
(``Answer``, ``paged_forward``, ``generate_paged``), :mod:`ragattn.methods.cached_answer`
(``cached_answer``), :mod:`ragattn.methods.baseline` (``full_prefill``)."""
import warnings

from ragattn.methods.baseline import full_prefill
from ragattn.methods.cached_answer import cached_answer
from ragattn.methods.generate import Answer, generate_paged, paged_forward
from ragattn.methods.prompt import SYSTEM, prompt_parts

__all__ = ["Answer", "SYSTEM", "cached_answer", "full_prefill", "generate_paged", "paged_forward", "prompt_parts"]

warnings.warn("ragattn.methods.common is deprecated: import from ragattn.methods.prompt, .generate, "
              ".cached_answer or .baseline", DeprecationWarning, stacklevel=2)
