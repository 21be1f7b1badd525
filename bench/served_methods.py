"""The methods of the served benchmark (``bench.served``, ``bench.served_memory``): each row's
label (the registry's underscore spelling; ``full`` for the baseline) and the
``kv_transfer_params`` its requests send, from :mod:`ragattn.methods.registry`.

    from bench.served_methods import METHODS, RAGATTN_ONLY, RECOMPUTE_RATIO, label
    METHODS["cacheblend"](spans)   # {"ragattn_spans": spans, "ragattn_method": "cacheblend", "ragattn_ratio": 0.15}
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ragattn.methods import registry

RECOMPUTE_RATIO = registry.DEFAULT_RATIO
# the methods measured, in row order: the baseline, the served default, then every other served method
# that is a computation of its own (one that serves as another, as turborag-reordered, is measured by it)
MEASURED = (registry.BASELINE,) + tuple(sorted(
    (n for n in registry.names(served=True) if registry.get(n).serves_as is None),
    key=lambda n: n != registry.SERVED_DEFAULT))


def label(name: str) -> str:
    """The row label of a method spelling: ``full`` for the baseline, else the underscore spelling."""
    m = registry.get(name)
    return "full" if m.name == registry.BASELINE else m.snake


def _params(m: registry.Method) -> Callable[[List[List[int]]], Optional[dict]]:
    """A method's request parameters from the prompt's chunk spans (None: none sent, so the
    connector claims nothing and the server prefills the whole prompt)."""
    if m.name == registry.BASELINE:
        return lambda spans: None
    extra = {} if m.name == registry.SERVED_DEFAULT else {"ragattn_method": m.name}
    if m.ratio:
        extra["ragattn_ratio"] = RECOMPUTE_RATIO
    return lambda spans: {"ragattn_spans": spans, **extra}


METHODS: Dict[str, Callable[[List[List[int]]], Optional[dict]]] = {
    label(n): _params(registry.get(n)) for n in MEASURED}
RAGATTN_ONLY = tuple(label(n) for n in MEASURED if registry.get(n).ratio)   # recomputed on ragattn's backend only
