"""The public op layer: Python wrappers, validation, fake impls and CPU/CUDA dispatch.

Every op is a ``torch.ops.ragattn.<name>`` custom op (schemas in csrc/torch_bindings.cpp) and
is mirrored here as ``ragattn.ops.<name>`` / ``ragattn.<name>`` with a docstring giving every
tensor's shape and dtype.
"""
from ragattn import _extension  # noqa: F401  (loads the schemas first)

__all__: list[str] = []

from ragattn.ops.kv_cache import copy_kv_, rerotate_keys_  # noqa: E402

__all__ += ["rerotate_keys_", "copy_kv_"]
