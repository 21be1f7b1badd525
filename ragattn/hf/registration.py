"""Registering "ragattn" with transformers: the attention function and mask builder, the tested
transformers versions, the family check where an implementation is chosen, and switching a model
to "ragattn" and back."""
from __future__ import annotations

import contextlib
import os
import warnings
import weakref

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ragattn.hf.attention import ragattn_attention_forward
from ragattn.hf.rope import SUPPORTED_FAMILIES

NAME = "ragattn"
# transformers versions this path is tested with (inclusive, major.minor)
TESTED_TRANSFORMERS = ((5, 17), (5, 23))
ALLOW_UNTESTED_ENV = "RAGATTN_ALLOW_UNTESTED_TRANSFORMERS"


def check_transformers_version(version: str | None = None) -> bool:
    """Warn (RuntimeWarning) if transformers ``version`` (default: the installed one) is outside
    :data:`TESTED_TRANSFORMERS`; returns whether it is inside. ``RAGATTN_ALLOW_UNTESTED_TRANSFORMERS=1``
    silences the warning."""
    version = version or transformers.__version__
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    lo, hi = TESTED_TRANSFORMERS
    if lo <= major_minor <= hi:
        return True
    if os.environ.get(ALLOW_UNTESTED_ENV, "0") != "1":
        warnings.warn(f"ragattn.hf: transformers {version} is outside the tested range {lo[0]}.{lo[1]} to "
                      f"{hi[0]}.{hi[1]} (the attention and cache interfaces change between releases); the "
                      f"ragattn attention may fail or differ from sdpa (set {ALLOW_UNTESTED_ENV}=1 to "
                      "silence this warning)", RuntimeWarning, stacklevel=3)
    return False


@contextlib.contextmanager
def use_ragattn(model):
    """Context manager: run ``model`` with the "ragattn" attention implementation, then restore.
    Safe for several threads using one model (:mod:`ragattn.hf.attn_switch`)."""
    from ragattn.hf.attn_switch import attention_implementation

    with attention_implementation(model, NAME, _switch_attn_implementation):
        yield model


# model -> {(from, to): [(config, value before, value after)]}: what set_attn_implementation changed
_SWITCHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _attn_configs(model) -> list:
    """Every config whose ``_attn_implementation`` ``model.set_attn_implementation`` may set: the
    model's, the nested sub-configs, and those of PreTrainedModel submodules (by identity)."""
    from transformers import PreTrainedModel

    found, todo = {}, [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        c = todo.pop()
        if id(c) not in found:
            found[id(c)] = c
            todo += [sub for key in getattr(c, "sub_configs", {}) if (sub := getattr(c, key, None)) is not None]
    return list(found.values())


def _switch_attn_implementation(model, old, new) -> None:
    """``model.set_attn_implementation(new)``, replayed after the first time: transformers walks
    every submodule and re-validates the name on each call (twice per cached prefill); the replay
    writes the same values into the configs it changed, when each still holds the value it had
    then (otherwise, e.g. the user switched in between, the real call runs and is recorded afresh)."""
    per_model = _SWITCHES.setdefault(model, {})
    changes = per_model.get((old, new))
    if changes is not None and all(c._attn_implementation_internal == before for c, before, _ in changes):
        for c, _, after in changes:
            c._attn_implementation_internal = after
        return
    configs = _attn_configs(model)
    before = [c._attn_implementation_internal for c in configs]
    model.set_attn_implementation(new)
    per_model[(old, new)] = [(c, b, c._attn_implementation_internal) for c, b in zip(configs, before)
                             if c._attn_implementation_internal != b]


def refuse_unsupported_family(model) -> None:
    """ValueError naming the family and a working ``attn_implementation`` when ``model`` (a
    ``PreTrainedModel``) is not of :data:`SUPPORTED_FAMILIES`: raised where transformers checks the
    requested implementation (``from_pretrained`` / model init, before any weight is loaded, and
    ``set_attn_implementation``), not at the first forward."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in SUPPORTED_FAMILIES:
        return
    hint = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    raise ValueError(f"ragattn attention: model family {family!r} ({type(model).__name__}) is not supported "
                     f"(supported: {', '.join(sorted(SUPPORTED_FAMILIES))}); load it with "
                     f"attn_implementation={hint!r}")


def _install_family_check() -> None:
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` (every path that sets an attention
    implementation goes through it) so that "ragattn" on an unsupported family is refused there."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_ragattn_family_check", False):
        return

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        if requested_attention == NAME:
            refuse_unsupported_family(self)
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._ragattn_family_check = True
    get_correct_attn_implementation.__wrapped__ = original
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def register() -> None:
    """Register "ragattn" with transformers (idempotent); warns if transformers is untested."""
    check_transformers_version()
    AttentionInterface.register(NAME, ragattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _install_family_check()
