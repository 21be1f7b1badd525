"""What a :class:`~ragattn.store.ChunkStore` needs of its model: a description, not the model.

    from ragattn.store import ChunkModel, ChunkStore
    spec = ChunkModel(fingerprint="...", num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16,
                      device=torch.device("cpu"), rope=Rope(inv_freq, 64, False), prefill=my_prefill)
    store = ChunkStore(spec, "kv/")

The HF side describes a transformers model (:mod:`ragattn.hf.store_model`, registered here when
``ragattn.hf`` is imported, so ``ChunkStore(hf_model)`` keeps working); the vLLM connector
describes the served checkpoint without holding its weights (:mod:`ragattn.vllm.store`). The store
itself knows no model library.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ragattn.store.errors import ChunkStoreError


class Rope(NamedTuple):
    """The model's RoPE (the ragattn convention, docs/ops.md): ``inv_freq`` float32
    ``[rotary_dim // 2]`` (every scaling variant folded in), ``rotary_dim`` (<= head_dim, even),
    ``interleaved`` (False: NeoX halves). ``ragattn.hf.rope.RopeParams`` has these fields too."""
    inv_freq: torch.Tensor
    rotary_dim: int
    interleaved: bool


# prefill(ids int64 [T], positions int64 [T], cu_seqlens int32 [B + 1]) -> (k_layers, v_layers):
# B chunks packed token-major, each at positions 0..n_i-1 and attending only to itself; per layer
# K and V [T, Hkv, D] in the model's dtype on its device, keys rotated at their positions.
Prefill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


@dataclass(frozen=True, eq=False)   # eq: identity (its tensors have no truth value)
class ChunkModel:
    """A model as the chunk store sees it.

    ``fingerprint``: the identity every chunk key is derived from (same weights and config, same
    fingerprint: :func:`ragattn.store.model_fingerprint` for an ``nn.Module``).
    ``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``device``: the K/V each layer
    produces (``[n, num_kv_heads, head_dim]`` in ``dtype``) and where the pool lives.
    ``rope``: :class:`Rope` (``inv_freq`` / ``rotary_dim`` / ``interleaved``).
    ``max_positions``: the model's window; ``vocab_size``: token ids are checked against it (None:
    not checked). ``prefill``: computes chunks' K/V (see :data:`Prefill`); None for a store that
    only serves chunk files (adding a missing chunk then raises ``ChunkStoreError``).
    ``follow``: ``follow(self, full) -> ChunkModel``, the description brought up to date with its
    model's current weights (``full``: checksum every byte); None for a fixed model.
    ``model``: the described object, if any (``ChunkStore.model``)."""
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    rope: Rope
    max_positions: int = 1 << 30
    vocab_size: Optional[int] = None
    prefill: Optional[Prefill] = None
    follow: Optional[Callable[["ChunkModel", bool], "ChunkModel"]] = None
    model: object = None

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_positions"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ChunkStoreError(f"ragattn.ChunkModel: {name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ChunkStoreError(f"ragattn.ChunkModel: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise ChunkStoreError(f"ragattn.ChunkModel: fingerprint must be a non-empty str, got {self.fingerprint!r}")
        inv, rot = self.rope.inv_freq, self.rope.rotary_dim
        if not 0 < rot <= self.head_dim or rot % 2 or tuple(inv.shape) != (rot // 2,) or inv.dtype != torch.float32:
            raise ChunkStoreError(f"ragattn.ChunkModel: rope needs an even rotary_dim in [2, head_dim="
                                  f"{self.head_dim}] and inv_freq float32 [rotary_dim // 2]; got rotary_dim {rot}, "
                                  f"inv_freq {inv.dtype} {tuple(inv.shape)}")

    def current(self, full: bool = False) -> "ChunkModel":
        """This description as of the model's current weights (itself when nothing changed or
        when it follows no model)."""
        return self if self.follow is None else self.follow(self, full)

    def replace(self, **changes) -> "ChunkModel":
        return dataclasses.replace(self, **changes)


# describe(model, fingerprint, device) -> ChunkModel, or None when it does not know that kind of model
_DESCRIBERS: list[Callable[..., Optional[ChunkModel]]] = []


def register_describer(describe: Callable[..., Optional[ChunkModel]]) -> None:
    """Teach :func:`describe_model` a kind of model (``ragattn.hf`` registers transformers models)."""
    if describe not in _DESCRIBERS:
        _DESCRIBERS.append(describe)


def describe_model(model, fingerprint: str | None = None, device=None) -> ChunkModel:
    """``model`` as a :class:`ChunkModel`: a description is returned as is; any other model goes to
    the registered describers. ``fingerprint=`` (fixed: the store does not follow the weights)
    and ``device=`` override what the model says (for a model whose parameters are not
    materialised, such as the vLLM worker's)."""
    if isinstance(model, ChunkModel):
        if fingerprint is not None or device is not None:
            raise ChunkStoreError("ragattn.ChunkStore: fingerprint= and device= are for a model, not a "
                                  "ChunkModel (set them on the description)")
        return model
    for describe in _DESCRIBERS:
        spec = describe(model, fingerprint, device)
        if spec is not None:
            return spec
    hint = (" (a HuggingFace model: import ragattn.hf first, which describes transformers models to the store)"
            if type(model).__module__.startswith("transformers") else "")
    raise ChunkStoreError(f"ragattn.ChunkStore: cannot describe a {type(model).__name__} model: pass a "
                          f"ragattn.store.ChunkModel{hint}")
