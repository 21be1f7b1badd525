"""ragattn's HuggingFace layer: the "ragattn" attention implementation, the paged request cache
as a transformers ``Cache``, model loading and per-family RoPE parameters.

    import ragattn.hf            # registers "ragattn" with transformers
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="ragattn")

Needs transformers (the ``[hf]`` extra); without it, importing this package raises a
ModuleNotFoundError that says what to install.
"""

# What to install when transformers is missing (one line, for `import ragattn.hf` and the CLI).
INSTALL_HINT = ("ragattn.hf needs HuggingFace transformers, which is not installed: pip install "
                "'transformers>=5.17,<5.24' 'accelerate>=1.10' 'gguf>=0.19,<0.20' safetensors "
                "(the [hf] extra: pip install --no-build-isolation '.[hf]' in a ragattn checkout)")

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "transformers":
        raise
    raise ModuleNotFoundError(INSTALL_HINT, name="transformers") from None

from ragattn.hf import registration as _registration  # noqa: E402
from ragattn.hf import store_model as _store_model  # noqa: E402,F401  (ChunkStore(hf_model): describes HF models)


def enable() -> None:
    """Register the "ragattn" attention implementation with transformers (idempotent; importing
    ``ragattn.hf`` already does). Warns (RuntimeWarning) when the installed transformers is
    outside the tested range (``ragattn.hf.registration.TESTED_TRANSFORMERS``)."""
    _registration.register()


_registration.register()
