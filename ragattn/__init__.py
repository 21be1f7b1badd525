"""ragattn: attention and KV-cache operators for retrieval-augmented generation inference.

    import ragattn
    ragattn.rerotate_keys_(...)          # == torch.ops.ragattn.rerotate_keys_(...)

See README.md for the op table and docs/ops.md for the op reference.
"""
from ragattn import _extension  # noqa: F401  (loads torch.ops.ragattn)
from ragattn.ops import *  # noqa: F401,F403
from ragattn.ops import __all__ as _ops_all

__version__ = "0.1.0"
__all__ = list(_ops_all)
