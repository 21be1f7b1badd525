"""The one list of RAG methods: names (canonical spelling and accepted aliases), how each is
called, its fixed options, whether it takes a recompute ratio (and the default one), and the
checks of a method name and a ratio. Imports no model library: demo, eval, the benchmarks and
the vLLM request parameters all read it.

    from ragattn.methods import registry
    m = registry.get("block_attention")     # a Method; aliases give the canonical entry
    m.name, m.ratio, m.served                # "block-attention", False, True
    registry.names(), registry.names(served=True), registry.BASELINE, registry.DEFAULT_RATIO,
    registry.SERVED_DEFAULT
    registry.check_ratio(0.15)               # None, or why the ratio is refused
    m.answer(model, tokenizer, chunks, question, max_new_tokens=32, store=store)   # an Answer

What a reader does with a method follows from its entry's flags (``positions``, ``fused``,
``selection``, ``serves_as``, ...), never from its name.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, Optional, Sequence

BASELINE = "full-prefill"
DEFAULT_RATIO = 0.15   # fraction of the chunk tokens that CacheBlend and FusionRAG recompute by default
SERVED_DEFAULT = "block-attention"   # the method of a served request that names none


@dataclasses.dataclass(frozen=True)
class Method:
    """One method: ``module.attr(model, tokenizer, chunks, question, max_new_tokens=, store=,
    **options[, ratio=])`` returning a ``ragattn.methods.generate.Answer``.

    ``ratio``: the function takes ``ratio=`` (fraction of chunk tokens recomputed). ``fused``:
    FusionRAG's offline fused chunk caches are built for it. ``ablation``: a variant of a method
    above, run only when named. ``demo``: a row of ``python -m ragattn demo``. ``served``: a
    request to the vLLM connector may ask for it (``kv_transfer_params.ragattn_method``).
    ``decode``: it speeds up decoding, not the first token. ``aliases``: other accepted spellings
    (the underscore one is always accepted). ``adapter``: the shipped adapter
    (``ragattn.hf.adapters``) whose tuned model the apps run it on unless ``--untuned``; None: the
    model as loaded. ``store``: it reads chunk KV from a ``ChunkStore`` (passed as ``store=``; full
    prefill, RAPID and REFRAG do not). ``selection``: how a ratio method picks the chunk rows it
    recomputes: ``"query"`` (the final block's attention to the cached keys) or ``"deviation"``
    (every chunk row through the first layers, kept by K/V deviation), ``ragattn.methods.selection``.
    ``serves_as``: a served request for it runs that entry's computation (the keys placed the
    same way; only the model differs). ``demo_options``: the demo's extra keyword arguments."""
    name: str
    module: str
    attr: str
    options: tuple = ()  # (key, value) pairs, fixed keyword arguments
    ratio: bool = False
    fused: bool = False
    ablation: bool = False
    demo: bool = False
    served: bool = False
    decode: bool = False
    aliases: tuple = ()
    adapter: Optional[str] = None
    store: bool = True
    selection: Optional[str] = None
    serves_as: Optional[str] = None
    demo_options: tuple = ()

    @property
    def snake(self) -> str:
        """The underscore spelling (``block_attention``), as benchmark rows name the method."""
        return self.name.replace("-", "_")

    @property
    def spellings(self) -> tuple:
        return tuple(dict.fromkeys((self.name, self.snake, *self.aliases)))

    @property
    def positions(self) -> str:
        """The position scheme its chunks are placed in (``ragattn.store.Positions``' names)."""
        return dict(self.options).get("positions", "reordered")

    def answer(self, model, tokenizer, chunks, question, *, max_new_tokens: int, store=None,
               ratio: Optional[float] = None, **extra):
        """Its answer (``ragattn.methods.generate.Answer``) with its fixed options and ``extra``;
        ``ratio``: for a ratio method (None: :data:`DEFAULT_RATIO`), refused for the others."""
        fn = self.resolve()
        if fn is None:
            raise ValueError(f"method {self.name!r} has no answer function in this checkout")
        kw = dict(self.options)
        if self.ratio:
            kw["ratio"] = DEFAULT_RATIO if ratio is None else ratio
        elif ratio is not None:
            raise ValueError(f"method {self.name!r} takes no recompute ratio, got {ratio!r}")
        return fn(model, tokenizer, chunks, question, max_new_tokens=max_new_tokens,
                  store=store if self.store else None, **kw, **extra)

    def resolve(self) -> Optional[Callable]:
        """The answer function, or None when its module is not part of this checkout (a module
        that exists but fails to import raises: a broken method is not silently skipped)."""
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name == self.module:
                return None
            raise
        return getattr(mod, self.attr, None)


REGISTRY = (
    Method(BASELINE, "ragattn.methods.baseline", "full_prefill", demo=True, aliases=("full",), store=False),
    Method("no-context", "ragattn.methods.baseline", "no_context", store=False),   # the floor: no passages at all
    Method("turborag-composite", "ragattn.methods.turborag", "answer", (("positions", "composite"),),
           demo=True, served=True, adapter="block-attention"),
    Method("turborag-reordered", "ragattn.methods.turborag", "answer", (("positions", "reordered"),),
           demo=True, served=True, adapter="block-attention", serves_as="block-attention"),
    Method("block-attention", "ragattn.methods.block_attention", "answer", demo=True, served=True,
           adapter="block-attention"),
    Method("full-reuse", "ragattn.methods.fusionrag", "full_reuse"),
    Method("cacheblend", "ragattn.methods.fusionrag", "cacheblend", ratio=True, demo=True, served=True,
           selection="deviation"),
    Method("fusionrag", "ragattn.methods.fusionrag", "answer", ratio=True, fused=True, demo=True, served=True,
           selection="query"),
    # greedy, eta 0: the target's own greedy answer (RAPID speeds up decoding, not the first token); the
    # demo's: the drafter reads the MiniLM-retrieved third of the passages, eta 10 biases the target to it
    Method("rapid", "ragattn.methods.rapid", "answer", demo=True, decode=True, store=False,
           demo_options=(("gamma", 4), ("eta", 10.0))),
    # compressed chunks (k = 16) on the shipped REFRAG weights; with a quarter of the chunks as tokens
    Method("refrag", "ragattn.methods.refrag.model", "answer", demo=True, adapter="refrag", store=False),
    Method("refrag-expand25", "ragattn.methods.refrag.model", "answer", (("expand_fraction", 0.25),),
           adapter="refrag", store=False),
    # FusionRAG selecting with the final block alone (the authors' code) instead of over the context
    Method("fusionrag-standalone", "ragattn.methods.fusionrag", "answer", (("question_mode", "standalone"),),
           ratio=True, fused=True, ablation=True, selection="query"),
    # full attention on the block-tuned weights: does the adapter change ordinary answers?
    Method("full-prefill-tuned", "ragattn.methods.baseline", "full_prefill", ablation=True,
           adapter="block-attention", store=False),
)
_BY_SPELLING: Dict[str, Method] = {s: m for m in REGISTRY for s in m.spellings}


def names(*, demo: Optional[bool] = None, served: Optional[bool] = None, ratio: Optional[bool] = None,
          registry: Sequence[Method] = REGISTRY) -> tuple:
    """Canonical names in registry order, of the entries whose given flags have the given values."""
    want = {k: v for k, v in dict(demo=demo, served=served, ratio=ratio).items()
            if v is not None}
    return tuple(m.name for m in registry if all(getattr(m, k) == v for k, v in want.items()))


def find(name: object) -> Optional[Method]:
    """The entry a spelling names (canonical or alias), or None."""
    return _BY_SPELLING.get(name) if isinstance(name, str) else None


def get(name: object, among: Optional[Sequence[str]] = None) -> Method:
    """The entry ``name`` spells, or ValueError naming the known methods (of ``among``, canonical
    names, when given)."""
    m = find(name)
    if m is None or (among is not None and m.name not in among):
        known = list(among) if among is not None else [m.name for m in REGISTRY]
        raise ValueError(f"unknown method {name!r}; known: {', '.join(known)}")
    return m


def canonical(name: object, among: Optional[Sequence[str]] = None) -> str:
    """The canonical name of ``name`` (see :func:`get`)."""
    return get(name, among).name


def check_ratio(ratio: object) -> Optional[str]:
    """None for a recompute ratio in [0, 1] (int or float, not bool, not NaN), else what is wrong."""
    # compared as it is: float() of an int beyond float range raises OverflowError (an HTTP 500)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        return f"must be a number in [0, 1] (the fraction of chunk tokens recomputed), got {ratio!r}"
    return None
