"""When an op's Python CPU impl may be called as a plain function instead of through ``torch.ops``.

A ``torch.ops.ragattn.*`` call of an op implemented in Python goes through the dispatcher, the
Python autograd kernel of ``register_autograd`` (which only redispatches when no input needs a
gradient) and back into Python: ~20 us on an idle core, 50-80 us on this project's loaded CPU
machine, as much as the attention itself at ~100 tokens. For plain CPU tensors that need no
gradient, outside every mechanism that observes or transforms dispatched ops, calling the
registered impl directly computes the same thing with the same checks and errors.
"""
from __future__ import annotations

import torch

_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize


def plain_cpu_call(first: torch.Tensor, *tensors, under_profiler: bool = False) -> bool:
    """True when ``first`` is a CPU tensor, ``first`` and ``tensors`` (None entries ignored) are
    plain ``torch.Tensor`` objects of which none needs a gradient here, and nothing would see the
    dispatched op: not compiling or tracing (dynamo, torch.jit.trace), no torch function or dispatch mode (FakeTensorMode,
    opcheck's modes, FlopCounterMode), no functorch transform (vmap, grad, functionalize), no
    profiler (its trace names the op; ``under_profiler=True``: the caller's direct path calls a
    dispatched C++ op, which the profiler names, so a profile shows the path that runs). The
    other tensors' devices are the op's own check (the impl raises the same error for a
    mixed-device call either way)."""
    C = torch._C
    if torch.compiler.is_compiling():
        return False
    if (C._is_torch_function_mode_enabled() or C._len_torch_dispatch_stack() or C._are_functorch_transforms_active()
            or (not under_profiler and C._autograd._profiler_enabled())
            or C._dispatch_tls_is_dispatch_key_included(_FUNCTIONALIZE)
            or C._get_tracing_state() is not None):
        return False
    if type(first) is not torch.Tensor or not first.is_cpu:
        return False
    present = [t for t in tensors if t is not None]
    if any(type(t) is not torch.Tensor for t in present):
        return False
    return not (C.is_grad_enabled() and C._any_requires_grad(first, *present))
