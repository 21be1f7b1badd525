"""ragattn's HuggingFace layer: the "ragattn" attention implementation, the paged request cache
as a transformers ``Cache``, model loading and per-family RoPE parameters.

    import ragattn.hf
    ragattn.hf.enable()          # register "ragattn" with transformers (idempotent)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="ragattn")
"""


def enable() -> None:
    """Register the "ragattn" attention implementation with transformers (idempotent).

    Raises RuntimeError when the installed transformers is outside the tested range
    (``ragattn.hf.attention.TESTED_TRANSFORMERS``)."""
    from ragattn.hf import attention

    attention.register()
