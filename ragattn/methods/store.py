"""Deprecated import path of the chunk store: it is :mod:`ragattn.store` (``from ragattn.store
import ChunkStore``; ``from ragattn.methods import ChunkStore`` stays). Importing this module warns
(DeprecationWarning) and gives the same names."""
import warnings

import ragattn.hf  # noqa: F401  (ChunkStore(hf_model) as before: ragattn.hf describes HF models to the store)
from ragattn.store import *  # noqa: F401,F403
from ragattn.store import __all__  # noqa: F401

warnings.warn("ragattn.methods.store is deprecated: import from ragattn.store", DeprecationWarning,
              stacklevel=2)
